#!/usr/bin/env bash
# Install NIXL into the repository's .venv for benchmarks/bench_pd.py's nixl_pd set-up (vLLM's NixlConnector).
# vLLM imports nixl._api, which the `nixl` meta package provides; it requires both the CUDA 12 and CUDA 13 builds,
# so it goes in without its dependencies beside the CUDA 12 build, whose UCX backend runs without a GPU.
# Idempotent: a second run only checks. Usage: bash benchmarks/peers/pd/setup.sh (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../../.."
VPY=.venv/bin/python
[ -x "$VPY" ] || { echo "pd peers setup: run scripts/setup.sh first (no .venv)" >&2; exit 1; }
if ! "$VPY" -c 'import nixl._api' 2>/dev/null; then
  echo "pd peers setup: installing nixl-cu12 1.5.1 and the nixl meta package (about 70 MB)"
  "$VPY" -m pip install --quiet nixl-cu12==1.5.1
  "$VPY" -m pip install --quiet --no-deps nixl==1.5.1
fi
"$VPY" -c 'import nixl._api' || { echo "pd peers setup: nixl._api does not import" >&2; exit 1; }
echo "pd peers setup: NIXL ready"
