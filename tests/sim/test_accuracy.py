"""The lossy codecs' measured accuracy as decide shows it: which result file it reads, what a bad one says, and
that a figure it lacks is "not measured", never made up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.sim.accuracy import AccuracyError, NoAccuracy, describe, find_accuracy, latest, load_accuracy


def result(**codecs: dict[str, Any]) -> dict[str, Any]:
    """A ``benchmarks/bench_codecs.py`` result of the given codecs' rows."""
    return {"kind": "codecs", "date": "2026-12-06", "machine": "Test CPU, 2 cores", "commit": "abc1234",
            "bytes_per_token": 23040, "codecs": codecs}


FP8 = {"agreement": [0.984, 0.969, 0.99], "kl": [0.001, 0.002, 0.0015], "ppl_change": [0.004, -0.001, 0.002],
       "stored_over_raw": 0.531, "encode_mb_s": 300.0, "decode_mb_s": 500.0, "target_met": True}


def write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_the_latest_file_is_the_latest_date_and_of_those_the_plain_name(tmp_path: Path) -> None:
    assert latest(tmp_path) is None
    for name in ("codecs-2026-12-01.json", "codecs-2026-12-06-run2.json", "codecs-2026-12-06.json",
                 "codecs-notes.json", "ttft-2026-12-09.json"):
        write(tmp_path / name, result(fp8=FP8))
    assert latest(tmp_path) == tmp_path / "codecs-2026-12-06.json"
    (tmp_path / "codecs-2026-12-06.json").unlink()
    assert latest(tmp_path) == tmp_path / "codecs-2026-12-06-run2.json"


def test_the_figures_of_a_measured_codec(tmp_path: Path) -> None:
    accuracy = load_accuracy(write(tmp_path / "codecs-2026-12-06.json", result(fp8=FP8)))
    line = describe("fp8", accuracy, 23040)
    assert line.startswith("fp8 is lossy: greedy agreement 98.1% (min 96.9%) over 3 prompt(s), perplexity +0.4% "
                           "worst, mean KL 0.0015 nats; the benchmark's target met; measured by "
                           "benchmarks/bench_codecs.py on the benchmark's model, KV of 23,040 bytes a token")
    assert "codecs-2026-12-06.json, 2026-12-06, Test CPU, 2 cores, commit abc1234" in line
    assert "another model" not in line
    # a calibration of another model, or of the same model in float32: the figures, and that they are another's
    assert "the calibrated model's KV is 4,096 bytes a token: another model or dtype" in describe("fp8", accuracy, 4096)


def test_what_is_not_measured_says_so(tmp_path: Path) -> None:
    accuracy = load_accuracy(write(tmp_path / "codecs-2026-12-06.json", result(fp8=FP8)))
    assert describe("k16v8", accuracy, 23040) == (f"k16v8 is lossy; its accuracy is not measured ({tmp_path}/"
                                                  "codecs-2026-12-06.json has no k16v8 row)")
    missing = find_accuracy(None, results=tmp_path / "results")
    assert isinstance(missing, NoAccuracy)
    line = describe("fp8", missing, 23040)
    assert line.startswith("fp8 is lossy; its accuracy is not measured (no ") and "--accuracy" in line
    assert "%" not in line


def test_find_reads_the_file_given_or_the_latest(tmp_path: Path) -> None:
    given = write(tmp_path / "mine.json", result(fp8=FP8))
    mine = find_accuracy(given, results=tmp_path / "nowhere")
    assert not isinstance(mine, NoAccuracy) and mine.source == str(given)
    results = tmp_path / "results"
    results.mkdir()
    write(results / "codecs-2026-12-06.json", result(fp8=FP8))
    found = find_accuracy(None, results=results)
    assert not isinstance(found, NoAccuracy) and found.source == str(results / "codecs-2026-12-06.json")
    # a latest file that does not load is why the accuracy is not measured; a file given must load
    write(results / "codecs-2026-12-07.json", {"kind": "codecs", "codecs": {"fp8": {"agreement": []}}})
    broken = find_accuracy(None, results=results)
    assert isinstance(broken, NoAccuracy) and "codecs-2026-12-07.json: codecs.fp8.agreement: expected" in broken.reason
    with pytest.raises(AccuracyError, match="codecs-2026-12-07.json: codecs.fp8.agreement"):
        find_accuracy(results / "codecs-2026-12-07.json")


@pytest.mark.parametrize("data, message", [
    ({"kind": "ttft"}, r"kind: expected \"codecs\""),
    ({**result(), "codecs": []}, r"codecs: expected a mapping"),
    (result(fp8={**FP8, "agreement": []}), r"codecs.fp8.agreement: expected a non-empty list of numbers"),
    (result(fp8={**FP8, "ppl_change": [0.1, "big"]}), r"codecs.fp8.ppl_change: expected a non-empty list"),
    (result(fp8={**FP8, "kl": [float("nan")]}), r"codecs.fp8.kl: expected"),
    (result(fp8=[1, 2]), r"codecs.fp8: expected a mapping"),
])
def test_a_malformed_accuracy_file_names_the_field(tmp_path: Path, data: dict, message: str) -> None:
    with pytest.raises(AccuracyError, match=r"a.json: " + message):
        load_accuracy(write(tmp_path / "a.json", data))


def test_an_unreadable_accuracy_file(tmp_path: Path) -> None:
    with pytest.raises(AccuracyError, match=r"nope.json: cannot read the codec accuracy"):
        find_accuracy(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(AccuracyError, match=r"bad.json: not JSON"):
        load_accuracy(tmp_path / "bad.json")
