#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
# Some fault tests mount a small tmpfs for a real full disk; they need root (CI runs as root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# pytest exits 5 when it collected no test: that fails this script like any other failure.
exec .venv/bin/python -m pytest -q "$@"
