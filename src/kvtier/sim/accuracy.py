"""What a lossy codec does to a model's output, as ``benchmarks/bench_codecs.py`` measured it, for ``kvtier decide`` to
show beside an answer that stores KV lossily.

The figures come from a ``codecs-DATE.json`` result file: ``kvtier decide --accuracy FILE``, else the latest under
``benchmarks/results/`` of the current directory (as ``python -m kvtier.docs`` reads that directory): the latest
date and, of those, the plain ``codecs-DATE.json``, else the last by name (the rule of
:func:`kvtier.results.latest`, which the benchmark reference follows too). Nothing is invented: with no
file, or a file without the codec, the accuracy reads "not measured". A file measured on another model's KV, or on
KV of another dtype (its ``bytes_per_token`` differs from the calibration's), is shown with that said.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier import results as result_files
from kvtier.errors import KVTierError

RESULTS = Path("benchmarks") / "results"
BENCHMARK = "benchmarks/bench_codecs.py"


class AccuracyError(KVTierError, ValueError):
    """A codec accuracy file is unreadable or malformed: the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class CodecAccuracy:
    """One codec's figures, one per prompt measured: the share of greedy tokens that agree with the uncompressed
    KV's, the mean KL divergence (nats) and the perplexity change (0.004: +0.4%)."""

    agreement: tuple[float, ...]
    kl: tuple[float, ...]
    ppl_change: tuple[float, ...]
    target_met: bool | None = None


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """An accuracy file: where it is, what it was measured on, and each codec's figures by name."""

    source: str
    codecs: Mapping[str, CodecAccuracy]
    date: str | None = None
    machine: str | None = None
    commit: str | None = None
    bytes_per_token: int | None = None
    model: str | None = None


@dataclasses.dataclass(frozen=True)
class NoAccuracy:
    """No accuracy file: why (where it was looked for)."""

    reason: str


def latest(results: Path) -> Path | None:
    """The latest ``codecs-*.json`` under ``results`` (:func:`kvtier.results.latest`), or None."""
    found = result_files.latest(results).get("codecs")
    return None if found is None else found.path


def find_accuracy(path: Path | None, results: Path = RESULTS) -> Accuracy | NoAccuracy:
    """The file at ``path`` when given (it must load: :class:`AccuracyError`), else the latest under ``results``,
    else why there is none. A latest file that does not load is a reason too, not an error: nobody asked for it,
    and it matters only to an answer that stores KV lossily."""
    if path is not None:
        return load_accuracy(path)
    newest = latest(results)
    if newest is None:
        return NoAccuracy(f"no {results}/codecs-*.json under {Path.cwd()}; run {BENCHMARK} --json "
                          f"{results}/codecs-DATE.json, or give a file with --accuracy")
    try:
        return load_accuracy(newest)
    except AccuracyError as exc:
        return NoAccuracy(str(exc))


def load_accuracy(path: Path) -> Accuracy:
    """Read a ``bench_codecs.py`` result; every problem names the file and the field."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise AccuracyError(f"{path}: cannot read the codec accuracy: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise AccuracyError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("kind") != "codecs":
        raise AccuracyError(f"{path}: kind: expected \"codecs\" (a {BENCHMARK} result)")
    rows = data.get("codecs")
    if not isinstance(rows, dict):
        raise AccuracyError(f"{path}: codecs: expected a mapping of codec name to its figures")
    codecs = {name: _codec(row, f"{path}: codecs.{name}") for name, row in rows.items()}
    per_token = data.get("bytes_per_token")
    return Accuracy(str(path), codecs, _text(data.get("date")), _text(data.get("machine")), _text(data.get("commit")),
                    per_token if isinstance(per_token, int) and not isinstance(per_token, bool) else None,
                    _text(data.get("model")))


def _codec(row: Any, where: str) -> CodecAccuracy:
    if not isinstance(row, dict):
        raise AccuracyError(f"{where}: expected a mapping")
    def figures(field: str) -> tuple[float, ...]:
        values = row.get(field)
        if not isinstance(values, list) or not values or not all(_finite(v) for v in values):
            raise AccuracyError(f"{where}.{field}: expected a non-empty list of numbers (one a prompt)")
        return tuple(float(v) for v in values)

    met = row.get("target_met")
    return CodecAccuracy(figures("agreement"), figures("kl"), figures("ppl_change"),
                         met if isinstance(met, bool) else None)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def describe(codec: str, accuracy: Accuracy | NoAccuracy, kv_bytes_per_token: int) -> str:
    """One line on what lossy ``codec`` does to the output, from ``accuracy`` (never a figure it lacks)."""
    if isinstance(accuracy, NoAccuracy):
        return f"{codec} is lossy; its accuracy is not measured ({accuracy.reason})"
    row = accuracy.codecs.get(codec)
    if row is None:
        return f"{codec} is lossy; its accuracy is not measured ({accuracy.source} has no {codec} row)"
    worst = max(row.ppl_change, key=abs)
    target = {True: "; the benchmark's target met", False: "; the benchmark's target NOT met", None: ""}[row.target_met]
    line = (f"{codec} is lossy: greedy agreement {_mean(row.agreement):.1%} (min {min(row.agreement):.1%}) over "
            f"{len(row.agreement)} prompt(s), perplexity {worst:+.1%} worst, mean KL {_mean(row.kl):.4f} nats"
            f"{target}; measured by {BENCHMARK} on {_what(accuracy)}")
    if accuracy.bytes_per_token is not None and accuracy.bytes_per_token != kv_bytes_per_token:
        line += (f"; the calibrated model's KV is {kv_bytes_per_token:,} bytes a token: another model or dtype, "
                 f"whose accuracy may differ (measure it with {BENCHMARK})")
    return line


def _what(a: Accuracy) -> str:
    model = a.model or "the benchmark's model"
    kv = f", KV of {a.bytes_per_token:,} bytes a token" if a.bytes_per_token is not None else ""
    where = ", ".join(x for x in (a.source, a.date, a.machine, a.commit and f"commit {a.commit}") if x)
    return f"{model}{kv} ({where})"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
