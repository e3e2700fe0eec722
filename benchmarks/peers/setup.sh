#!/usr/bin/env bash
# Create benchmarks/peers/.venv for bench_lmcache.py: torch 2.13.0 (CPU build), LMCache 0.5.x, redis-py, and kvtier
# installed in editable mode from this repository. Separate from the repository's .venv, so LMCache's pins (numpy,
# prometheus-client, ...) never touch kvtier's own test environment. Idempotent: a second run only checks.
# Usage: bash benchmarks/peers/setup.sh   (PYTHON=/path/to/python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")"
REPO=$(cd ../.. && pwd)
export LMCACHE_TRACK_USAGE=false LMCACHE_LOG_LEVEL=WARNING

source "$REPO/scripts/python311.sh"

VPY=.venv/bin/python
if [ ! -x "$VPY" ]; then
  echo "peers setup: creating benchmarks/peers/.venv with $($PY --version)"
  "$PY" -m venv .venv
  "$VPY" -m pip install --quiet --upgrade pip
fi
pip_install() { "$VPY" -m pip install --quiet "$@"; }

# torch first and pinned, and pinned again in every later install, so no resolver swaps in another build.
if ! "$VPY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "peers setup: installing torch 2.13.0"
  pip_install torch==2.13.0 || pip_install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
fi

if ! "$VPY" -c 'import importlib.metadata as m, sys; v = m.version("lmcache").split("."); sys.exit(v[:2] != ["0", "5"])' \
    2>/dev/null; then
  echo "peers setup: installing LMCache 0.5.x (with its dependencies, about a minute)"
  pip_install torch==2.13.0 'lmcache>=0.5,<0.6' redis
fi
# The storage layer must import on a CPU-only torch (LMCache picks its CPU platform stub without CUDA).
"$VPY" -c 'import lmcache.v1.cache_engine, lmcache.v1.storage_backend.local_disk_backend' >/dev/null 2>&1 \
  || { echo "peers setup: LMCache's storage layer does not import:" >&2;
       "$VPY" -c 'import lmcache.v1.cache_engine' 2>&1 | tail -5 >&2; exit 1; }

if ! "$VPY" -c "import kvtier, sys; sys.exit(not kvtier.__file__.startswith('$REPO/'))" 2>/dev/null \
    || ! "$VPY" -c 'import redis, hiredis' 2>/dev/null; then
  echo "peers setup: installing kvtier (editable, from $REPO) with its redis extra"
  pip_install torch==2.13.0 -e "$REPO[redis]"
fi

command -v redis-server >/dev/null \
  || echo "peers setup: warning: redis-server is not on PATH (apt-get install redis-server); the Redis rows" \
          "will be skipped" >&2
"$VPY" -c 'import importlib.metadata as m
print("peers setup: ready:", ", ".join(f"{p} {m.version(p)}" for p in ("torch", "lmcache", "redis", "kvtier")))'
