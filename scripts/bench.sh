#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the store benchmarks; extra arguments go to the script (--quick, --json P).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python benchmarks/bench_store.py "$@"
