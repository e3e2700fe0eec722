"""kvtier bench's report: the encryption's cost from alternating pairs of re-reading processes (the median pair's
ratio, so one disturbed pair does not decide), next to the single pair of phases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.ttft import report


def test_the_encryption_ratio_is_the_median_of_alternating_pairs(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    results = {
        "baseline": {"vLLM, recompute": [10.0, 10.0]},
        "kvtier": {"kvtier, disk hit": [0.10, 0.10]},
        "encrypted": {"kvtier, disk hit, encrypted": [0.13, 0.13]},
        "engine_hit": {"vLLM prefix-cache hit": [0.08], "vLLM prefix-cache hit, exact repeat": [0.4]},
        "reread": {"plain": [[0.10, 0.10], [0.10], [0.20]], "sealed": [[0.105, 0.105], [0.20], [0.21]]},
    }
    out = tmp_path / "ttft.json"
    assert report(results, {"name": "quick", "docs": 3, "doc_tokens": 2048}, out) == 0
    encryption = json.loads(out.read_text())["encryption"]
    assert encryption["disk_hit_ttft_ratio"] == pytest.approx(1.3)
    assert encryption["reread"]["pair_ratios"] == pytest.approx([1.05, 2.0, 1.05])
    assert encryption["reread"]["ratio"] == pytest.approx(1.05)
    printed = capsys.readouterr().out
    assert "1.30 in the two phases above" in printed
    assert "(3 pairs: 1.05, 2.00, 1.05): median sealed / plain 1.05 (target <= 1.10: met)" in printed
