#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job, `kvtier bench`: TTFT of repeated 4K-token prefixes on vLLM
# (CPU) with SmolLM2-135M, with and without kvtier. Extra arguments go to it (--quick, --json PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvtier bench "$@"
