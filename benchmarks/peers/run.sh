#!/usr/bin/env bash
# Set up benchmarks/peers/.venv if needed, then run the kvtier vs LMCache benchmark (arguments go to it, e.g.
# --reps 1 for a smoke run). Results: benchmarks/results/peers-<date>.json.
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh
export LMCACHE_TRACK_USAGE=false
exec .venv/bin/python bench_lmcache.py "$@"
