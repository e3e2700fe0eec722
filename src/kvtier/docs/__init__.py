"""The generated reference pages, ``docs/reference/*.md``: made from the code and the benchmark results, so they
cannot drift from either.

    python -m kvtier.docs            # (re)write docs/reference/ under the current directory (the repository)
    python -m kvtier.docs --check    # exit 1, naming the pages, if a committed page differs from what it would be

One module per kind of page: :mod:`.configuration` (the store's, router's and fleet's config dataclasses and their
fields' help), :mod:`.cli` (the
argparse parsers), :mod:`.metrics` (the Prometheus registries) and :mod:`.benchmarks` (``benchmarks/results/``).
Each renders text only; writing and checking are here. The output depends on nothing but the code and the files:
no time, no terminal width, no ordering of a set.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REGENERATE = "python -m kvtier.docs"
PAGES = ("configuration.md", "router-configuration.md", "fleet-configuration.md", "cli.md", "metrics.md",
         "benchmarks.md")


def render(root: Path) -> dict[str, str]:
    """Each page's text, by file name under ``docs/reference/``."""
    from kvtier.docs import benchmarks, cli, configuration, metrics

    return {"configuration.md": configuration.render(), "router-configuration.md": configuration.render_router(),
            "fleet-configuration.md": configuration.render_fleet(), "cli.md": cli.render(),
            "metrics.md": metrics.render(), "benchmarks.md": benchmarks.render(root / "benchmarks" / "results")}


def stale(root: Path) -> list[str]:
    """The pages under ``root/docs/reference`` that differ from what :func:`render` makes (or are missing)."""
    out = root / "docs" / "reference"
    return [name for name, text in render(root).items()
            if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (default: this directory)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    if not (args.root / "benchmarks" / "results").is_dir():
        parser.error(f"{args.root} is not kvtier's repository (no benchmarks/results/)")
    if args.check:
        names = stale(args.root)
        for name in names:
            print(f"docs/reference/{name} is out of date: run `{REGENERATE}` and commit it", file=sys.stderr)
        return 1 if names else 0
    out = args.root / "docs" / "reference"
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render(args.root).items():
        (out / name).write_text(text, encoding="utf-8")
        print(f"wrote {out / name}")
    return 0
