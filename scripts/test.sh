#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
# Some fault tests mount a small tmpfs for a real full disk; they need root (CI runs as root).
# The shared tiers' tests start real servers on loopback (redis-server, a 3-node Redis Cluster, SeaweedFS,
# a Mooncake master and client: kvtier.testing.servers), wait until each answers, and stop them by PID when
# the session ends, also when tests fail.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lint, types and the import contract (pyproject.toml: [tool.ruff], [tool.mypy], [tool.importlinter]) first:
# a minute or two, and a failure here fails the run like a failed test.
echo "test: ruff, mypy, import-linter, mkdocs"
.venv/bin/ruff check --quiet src tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports --no-cache | tail -1
# The docs site, every warning an error (a broken link, a page outside the nav); its reference pages are generated
# (python -m kvtier.docs) and tests/test_docs.py checks they are current.
if [ -f mkdocs.yml ]; then
  site="$(mktemp -d)"
  # (NO_MKDOCS_2_WARNING: Material's end-of-life banner, printed on every build, is not a warning about the docs)
  NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
  rm -rf "$site"
fi
bash scripts/wheel_check.sh  # the sdist and wheel built, the wheel installed in a fresh venv and run (~35 s)
# Two workers (pytest-xdist), a test file to each at a time: many tests wait on servers, timeouts and vLLM's
# subprocesses, so two at once take ~10.5 min where one takes ~16 on 2 cores. Each worker starts its own servers
# (kvtier.testing.servers picks free ports). `-n 0` (or any later -n) overrides it.
# pytest exits 5 when it collected no test: that fails this script like any other failure. The 25 slowest
# tests are listed at the end: where the suite's time goes on this machine.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 "$@"
