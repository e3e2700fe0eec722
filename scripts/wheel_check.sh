#!/usr/bin/env bash
# Build kvtier's sdist and wheel (the wheel from the sdist, so a file the sdist leaves out fails here), install
# the wheel into a fresh virtual environment (none of .venv's packages, no source tree on its path) and check it
# there: `import kvtier`, `kvtier --help`, `kvtier --version` (pyproject.toml's version), and a store round trip
# (put, then get from a second store on the same filesystem tier). scripts/test.sh runs it before the tests.
# PYTHON=/path/to/python3.X builds the fresh environment on another interpreter (default: .venv's).
# Usage: bash scripts/wheel_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# Nothing of the caller's path either: with a source tree on PYTHONPATH, pip would take kvtier as installed already.
unset PYTHONPATH
py=${PYTHON:-.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$SECONDS

# The build runs in build's own isolated environment; its log is shown only when it fails.
.venv/bin/python -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
sdist=$(echo "$work"/dist/kvtier-*.tar.gz)
wheel=$(echo "$work"/dist/kvtier-*.whl)
[ -f "$sdist" ] && [ -f "$wheel" ] || { echo "wheel_check: no sdist or wheel in $work/dist" >&2; exit 1; }

"$py" -m venv "$work/venv"
# torch first and pinned, as scripts/setup.sh does: its CPU build lies on disk; an unpinned resolve fetches CUDA.
"$work/venv/bin/pip" install --quiet torch==2.13.0
"$work/venv/bin/pip" install --quiet "$wheel"

want=$(.venv/bin/python -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
cd "$work"  # nothing of the checkout on sys.path: what is imported is what the wheel installed
"$work/venv/bin/kvtier" --help >/dev/null
got=$("$work/venv/bin/kvtier" --version)
[ "$got" = "kvtier $want" ] || { echo "wheel_check: kvtier --version says '$got', pyproject.toml $want" >&2; exit 1; }
"$work/venv/bin/python" - "$work/tier" <<'EOF'
import sys
from pathlib import Path

import torch

import kvtier
from kvtier import KVStore, Namespace

site = Path(kvtier.__file__).resolve()
assert "site-packages" in site.parts, f"kvtier imported from {site}, not the installed wheel"
config = {"chunk_tokens": 16, "dram": {"capacity_bytes": "4MiB", "page_bytes": "16KiB"},
          "tiers": [{"type": "filesystem", "name": "disk", "path": sys.argv[1]}]}
ns = Namespace(model="wheel-check", dtype="float16")
tokens = list(range(64))
kv = torch.randn(2, 2, 2, len(tokens), 8).to(torch.float16)  # [layers, K/V, kv_heads, tokens, head_dim]
with KVStore.from_config(config) as store:
    assert store.put(ns, tokens, kv) == len(tokens)
    store.flush()  # the cascade's writes to the filesystem tier
with KVStore.from_config(config) as store:  # a new DRAM pool: what it finds comes from the files
    assert store.lookup(ns, tokens) == len(tokens)
    got = store.get(ns, tokens)
    assert got is not None and torch.equal(got, kv), "the KV read back differs from the KV put"
EOF
echo "wheel_check: $(basename "$sdist") and $(basename "$wheel") built; the wheel installed into a fresh venv" \
     "($("$work/venv/bin/python" --version)) imports, answers --help and --version ($want), and round-trips a" \
     "store ($((SECONDS - start)) s)"
