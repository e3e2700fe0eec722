"""The package's metadata agrees with itself and with what the docs say: the version the CLI reports is
pyproject.toml's and has a CHANGELOG section; every extra a user is told to install exists; the Python floor is
the one ruff and mypy check against. (scripts/wheel_check.sh installs the built wheel and checks it runs.)"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import kvtier
from kvtier.cli import main

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS = set(PROJECT["optional-dependencies"])
# `kvtier[redis,s3]` in the docs, the Dockerfile and kvtier's own messages; `.[docs]` for a checkout's extras
NAMED_EXTRAS = re.compile(r"""(?:\bkvtier|(?<=[\s'"])\.)\[([a-z0-9_,\- ]+)\]""")
# where a user is told what to install: the docs, the deployment files and the messages kvtier prints
USER_TEXT = ["README.md", "docs/**/*.md", "deploy/**/Dockerfile", "scripts/*.sh", "src/kvtier/**/*.py"]
CONTRIBUTORS_EXTRAS = {"test", "docs"}  # a checkout's (the suite, the docs site), not a user's
NEWEST_PYTHON = (3, 13)  # the newest Python vLLM 0.32 and kvtier's dependencies are tested on


def _floor() -> tuple[int, int]:
    found = re.fullmatch(r">=\s*(\d+)\.(\d+)", PROJECT["requires-python"])
    assert found, f"requires-python {PROJECT['requires-python']!r}: expected a floor alone ('>=3.X')"
    return int(found[1]), int(found[2])


def _named_extras() -> dict[str, set[str]]:
    """Each extra named in the user-facing text, with the files that name it."""
    named: dict[str, set[str]] = {}
    for pattern in USER_TEXT:
        for path in sorted(ROOT.glob(pattern)):
            for group in NAMED_EXTRAS.findall(path.read_text()):
                for extra in group.split(","):
                    named.setdefault(extra.strip(), set()).add(str(path.relative_to(ROOT)))
    return named


def test_the_cli_reports_pyprojects_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"kvtier {PROJECT['version']}\n"
    # the installed metadata: a stale one means the checkout's version changed since `pip install -e .`
    assert kvtier.__version__ == PROJECT["version"], "reinstall: bash scripts/setup.sh (pip install -e '.[test]')"


def test_the_changelog_has_a_section_for_the_version() -> None:
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings[0] == "Unreleased", headings
    assert PROJECT["version"] in headings, f"CHANGELOG.md has no '## [{PROJECT['version']}]' section: {headings}"


def test_every_extra_the_docs_name_exists() -> None:
    named = _named_extras()
    assert {"redis", "s3", "router", "encryption"} <= set(named), "the pattern no longer finds the docs' extras"
    unknown = {extra: sorted(files) for extra, files in named.items() if extra not in EXTRAS}
    assert not unknown, f"extras named but not in pyproject.toml's [project.optional-dependencies]: {unknown}"


def test_every_users_extra_is_named_in_the_docs() -> None:
    docs = {extra for extra, files in _named_extras().items()
            if any(f == "README.md" or f.startswith("docs/") for f in files)}
    undocumented = EXTRAS - CONTRIBUTORS_EXTRAS - docs
    assert not undocumented, f"extras no page of README.md or docs/ tells a user to install: {sorted(undocumented)}"


def test_a_store_config_loads_without_the_encryption_extra() -> None:
    # as after a plain `pip install kvtier`: cryptography cannot be imported (scripts/wheel_check.sh installs so)
    script = """if True:
        import sys
        sys.modules["cryptography"] = None
        from kvtier import ConfigError, load_config
        load_config({"chunk_tokens": 16, "dram": {"capacity_bytes": "4MiB"}})
        try:
            load_config({"chunk_tokens": 16, "dram": {"capacity_bytes": "4MiB"},
                         "encryption": {"key": "env:K", "keyring": "/k"}})
        except ConfigError as exc:
            print(exc)
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "encryption: needs the cryptography package (pip install 'kvtier[encryption]')" in done.stdout


def test_the_python_floor_is_what_ruff_and_mypy_check() -> None:
    major, minor = _floor()
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == f"{major}.{minor}"


def test_the_classifiers_list_each_python_from_the_floor() -> None:
    major, minor = _floor()
    listed = {c.rsplit(" :: ", 1)[1] for c in PROJECT["classifiers"]
              if re.fullmatch(r"Programming Language :: Python :: \d+\.\d+", c)}
    assert listed == {f"{major}.{m}" for m in range(minor, NEWEST_PYTHON[1] + 1)}
