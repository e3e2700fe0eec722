"""Benchmark result files (``benchmarks/results/KIND-DATE[-VARIANT].json``) and which of a kind is its latest: the
latest date and, of those, the plain ``KIND-DATE.json``, else the last by name. Read by the generated benchmark
reference (:mod:`kvtier.docs.benchmarks`) and by ``kvtier decide``'s codec accuracy (:mod:`kvtier.sim.accuracy`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

_NAME = re.compile(r"^(?P<kind>.+?)-(?P<date>\d{4}-\d{2}-\d{2})(?P<variant>-.+)?\.json$")


@dataclasses.dataclass(frozen=True)
class Latest:
    """The latest result file of one kind."""

    kind: str
    path: Path
    date: str
    others: int  # files of the same kind not the latest (older runs, variants)


def latest(results: Path) -> dict[str, Latest]:
    """The latest file of each kind under ``results``, by kind (sorted)."""
    kinds: dict[str, list[tuple[str, bool, str, Path]]] = {}
    for path in sorted(results.glob("*.json")):
        match = _NAME.match(path.name)
        if match:
            kinds.setdefault(match["kind"], []).append((match["date"], match["variant"] is None, path.name, path))
    return {kind: Latest(kind, max(files)[3], max(files)[0], len(files) - 1) for kind, files in sorted(kinds.items())}
