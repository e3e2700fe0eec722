"""The named preemption scenario: its sweep, its report and its command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvtier.sim.scenario import Preemption, preemption
from kvtier.sim.timing import StepCosts

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "benchmarks" / "results" / "calibration-2026-12-01.json"
# Prefill dominated by attention, so recomputing a long prompt after a preemption is expensive.
COSTS = StepCosts(a=0.01, b=1e-4, c=1e-6, d0=0.01, d1=1e-4, kv_bytes_per_token=1000, load={"dram": (0.0, 1e9)},
              dram_store_bytes_per_s=1e9)


def test_preemptions_start_when_demand_passes_the_kv_space_and_the_dram_tier_avoids_re_prefill() -> None:
    s = Preemption(prompt_tokens=1024, output_tokens=512, kv_tokens=4096, block_tokens=128,
                   concurrency=(1, 2, 4, 8))
    out = preemption(COSTS, s)
    rows = {r["requests"]: r for r in out["rows"]}
    assert [r["utilization"] for r in out["rows"]] == [n * 1536 / 4096 for n in (1, 2, 4, 8)]
    assert rows[1]["preemptions"] == rows[2]["preemptions"] == {"engine_alone": 0, "kvtier": 0}
    assert rows[1]["prefilled_tokens"]["engine_alone"] == 1024  # nothing computed twice
    for n in (4, 8):
        r = rows[n]
        assert r["preemptions"]["engine_alone"] > 0
        # every prompt prefilled at least once; the preempted ones again, less of it with kvtier
        assert r["prefilled_tokens"]["engine_alone"] > n * 1024
        assert n * 1024 <= r["prefilled_tokens"]["kvtier"] < r["prefilled_tokens"]["engine_alone"]
        assert r["re_prefill_avoided_tokens"] == r["prefilled_tokens"]["engine_alone"] - r["prefilled_tokens"]["kvtier"]
        assert r["loaded_tokens"] > 0
    # Below the KV space the tier costs a little (its copies); past it, the re-prefill it avoids is time won.
    assert rows[1]["throughput_gain"] <= 0
    assert rows[4]["throughput_gain"] > 0 and rows[8]["throughput_gain"] > 0
    assert out["pays_from_utilization"] is None or out["pays_from_utilization"] > 1.0


def test_the_command_writes_the_scenario_and_refuses_wrong_arguments(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "simulate", "--scenario", "preemption",
                          "--calibration", str(CALIBRATION), "--out", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "preemption scenario: prompts of 768 tokens" in run.stdout
    saved = json.loads((tmp_path / "preemption.json").read_text())
    assert saved["scenario"] == "preemption" and len(saved["rows"]) == len(Preemption().concurrency)
    assert (tmp_path / "preemption.png").stat().st_size > 0
    for argv, message in ((["--scenario", "preemption"], "--scenario takes --calibration"),
                          (["--scenario", "preemption", "--trace", "t.jsonl"], "--trace or --scenario (one of them)"),
                          ([], "--trace or --scenario")):
        bad = subprocess.run([sys.executable, "-m", "kvtier.cli", "simulate", *argv], capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
