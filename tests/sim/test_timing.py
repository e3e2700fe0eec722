"""The timing layer against hand-computed cases (costs chosen so every step can be added up by hand)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtier.sim.codec_model import NONE, CodecCost, UnmeasuredCodec
from kvtier.sim.deployment import Deployment, DeploymentError, load_deployment
from kvtier.sim.timing import StepCosts, simulate
from kvtier.sim.trace import Request, Trace

B = 4  # tokens per block
# A step with a prefill: 0.1 s + 0.01 s a new token + 0.001 s a new token per token of context (n*(n + 2m));
# a decode step: 0.05 s + 0.002 s per decoding request. Loads: DRAM 0.001 s + 1 MB/s, disk 0.01 s + 0.5 MB/s.
COSTS = StepCosts(a=0.1, b=0.01, c=0.001, d0=0.05, d1=0.002, kv_bytes_per_token=1000,
              load={"dram": (0.001, 1e6), "disk": (0.01, 5e5)}, dram_store_bytes_per_s=4e6)
CHUNK = 1000 * B  # bytes per block


def trace(*requests: tuple[float, list[int], int, int]) -> Trace:
    """(arrival s, block ids, prompt tokens, output tokens) per request."""
    return Trace(tuple(Request(t * 1000, n, out, tuple(blocks), n // B) for t, blocks, n, out in requests), B, "t")


def deployment(kv_tokens: int = 64, budget: int = 64, kvtier: dict | None = None, caching: bool = True):
    """An engine whose KV space has ``kv_tokens`` usable tokens (and vLLM's null block, of B tokens, besides)."""
    return load_deployment({"engine": {"kv_tokens": kv_tokens + B, "block_size": B, "max_num_batched_tokens": budget,
                                       "prefix_caching": caching}, "kvtier": kvtier})


def test_one_request_prefills_in_one_step_then_decodes() -> None:
    out = simulate(trace((0, [1, 2, 3], 12, 3)), deployment(), COSTS)
    prefill = 0.1 + 0.01 * 12 + 0.001 * 12 * 12
    assert out["ttft_s"]["p50"] == pytest.approx(prefill)
    assert out["requests"][0]["finish_s"] == pytest.approx(prefill + 2 * (0.05 + 0.002))
    assert out["steps"] == 3 and out["preemptions"] == 0


def test_a_long_prompt_is_chunked_to_the_token_budget() -> None:
    out = simulate(trace((0, [1, 2, 3, 4], 16, 1)), deployment(budget=8), COSTS)
    first = 0.1 + 0.01 * 8 + 0.001 * 8 * 8
    second = 0.1 + 0.01 * 8 + 0.001 * 8 * (8 + 2 * 8)
    assert out["ttft_s"]["p50"] == pytest.approx(first + second)


def test_the_engine_prefix_cache_serves_all_but_the_last_block() -> None:
    # The second asks the same 12 tokens after the first finished: 8 tokens hit, the last block is computed.
    out = simulate(trace((0, [1, 2, 3], 12, 1), (10, [1, 2, 3], 12, 1)), deployment(), COSTS)
    assert out["requests"][1]["engine_hit_tokens"] == 8
    assert out["requests"][1]["ttft_s"] == pytest.approx(0.1 + 0.01 * 4 + 0.001 * 4 * (4 + 2 * 8))
    off = simulate(trace((0, [1, 2, 3], 12, 1), (10, [1, 2, 3], 12, 1)), deployment(caching=False), COSTS)
    assert off["requests"][1]["engine_hit_tokens"] == 0


def test_kvtier_loads_what_the_engine_evicted_from_dram_then_disk() -> None:
    # KV space of 4 blocks: request 2 (another prompt) evicts request 1's last two blocks (vLLM frees a request's
    # blocks tail first); request 3 repeats request 1: block 1 from the engine, block 2 from kvtier, and the last
    # block (never a hit) computed.
    requests = trace((0, [1, 2, 3], 12, 1), (10, [7, 8, 9], 12, 1), (20, [1, 2, 3], 12, 1))
    rest = 0.1 + 0.01 * 4 + 0.001 * 4 * (4 + 2 * 8)
    plain = simulate(requests, deployment(kv_tokens=16), COSTS)
    assert plain["requests"][2]["engine_hit_tokens"] == 4
    assert plain["requests"][2]["ttft_s"] == pytest.approx(0.1 + 0.01 * 8 + 0.001 * 8 * (8 + 2 * 4))
    full = 0.1 + 0.01 * 12 + 0.001 * 144
    store = 3 * CHUNK / 4e6  # the DRAM copy of a finished prompt's blocks, in its step
    with_dram = simulate(requests, deployment(kv_tokens=16, kvtier={"dram_bytes": 10 * 4096, "page_bytes": 4096}),
                         COSTS)
    assert with_dram["requests"][0]["ttft_s"] == pytest.approx(full + store)
    assert with_dram["requests"][2]["loaded_tokens"] == {"dram": 4} and \
        with_dram["requests"][2]["engine_hit_tokens"] == 4
    assert with_dram["requests"][2]["ttft_s"] == pytest.approx(0.001 + CHUNK / 1e6 + rest)
    assert with_dram["loaded_bytes"] == {"dram": CHUNK} and with_dram["stored_bytes"]["dram"] == 6 * CHUNK
    # DRAM of 3 pages of 4 KiB (a block each) holds only request 2's: block 2 comes back from the disk tier,
    # and blocks 1 and 3 are copied into DRAM again when request 3 is done.
    with_disk = simulate(requests, deployment(kv_tokens=16, kvtier={"dram_bytes": 3 * 4096, "page_bytes": 4096,
                                                                    "tiers": [{"name": "disk"}]}), COSTS)
    assert with_disk["requests"][2]["loaded_tokens"] == {"disk": 4}
    assert with_disk["requests"][2]["ttft_s"] == pytest.approx(0.01 + CHUNK / 5e5 + rest + 2 * CHUNK / 4e6)
    assert with_disk["avoided_prefill_s"] == pytest.approx(0.01 * 4 + 0.001 * 4 * (4 + 2 * 4))
    # Pages: a block of 4,000 bytes takes a whole page of 4,096, so 40,000 bytes hold 9 blocks, not 10: after ten
    # other prompts the first one's block is gone from DRAM (the engine's 2 blocks hold none of them either).
    ten = trace(*[(i, [i * 10 + 1, 1000 + i], 5, 1) for i in range(10)], (20, [1, 2000], 5, 1))
    tight = simulate(ten, deployment(kv_tokens=8, kvtier={"dram_bytes": 10 * 4000, "page_bytes": 4096}), COSTS)
    roomy = simulate(ten, deployment(kv_tokens=8, kvtier={"dram_bytes": 10 * 4096, "page_bytes": 4096}), COSTS)
    assert tight["requests"][10]["loaded_tokens"] == {} and roomy["requests"][10]["loaded_tokens"] == {"dram": 4}


def test_memory_pressure_preempts_the_latest_request_and_kvtier_saves_its_recompute() -> None:
    # 5 blocks of KV; two 8-token prompts decoding 8 tokens each need 4 + 4 blocks at their end: the later one
    # is preempted and computes its prompt (and output so far) again.
    requests = trace((0, [1, 2], 8, 8), (0, [5, 6], 8, 8))
    plain = simulate(requests, deployment(kv_tokens=20), COSTS)
    assert plain["preemptions"] >= 1 and plain["requests"][1]["preemptions"] >= 1
    cached = simulate(requests, deployment(kv_tokens=20, kvtier={"dram_bytes": 10 * 4096, "page_bytes": 4096}),
                      COSTS)
    assert cached["preemptions"] == plain["preemptions"]
    assert cached["loaded_tokens"].get("dram", 0) > 0  # the preempted prompt came back from DRAM
    assert cached["requests"][1]["finish_s"] < plain["requests"][1]["finish_s"]


def test_one_block_of_the_kv_space_is_vllms_null_block() -> None:
    # 16 tokens of KV space in blocks of 4: three blocks usable, so a 12-token prompt generating 1 token fits
    # and a 16-token one does not.
    space = load_deployment({"engine": {"kv_tokens": 16, "block_size": B}})
    assert simulate(trace((0, [1, 2, 3], 11, 1)), space, COSTS)["refused"] == 0
    with pytest.raises(ValueError, match="hold no request"):
        simulate(trace((0, [1, 2, 3, 4], 16, 1)), space, COSTS)


def test_refused_and_arrival_gaps() -> None:
    out = simulate(trace((0, [1], 4, 1), (5, [2, 3, 4, 5, 6, 7], 24, 1)), deployment(kv_tokens=16), COSTS)
    assert out["refused"] == 1 and len(out["requests"]) == 1
    later = simulate(trace((0, [1], 4, 1), (5, [2], 4, 1)), deployment(), COSTS)
    assert later["requests"][1]["ttft_s"] == pytest.approx(0.1 + 0.04 + 0.016)  # an idle engine: no queueing


@pytest.mark.parametrize("raw, message", [
    ({}, r"engine: missing \(expected a mapping"),
    ({"engine": {}}, r"engine.kv_tokens: missing"),
    ({"engine": {"kv_tokens": 0}}, r"engine.kv_tokens: expected an integer >= 1, got 0"),
    ({"engine": {"kv_tokens": 64, "budget": 3}}, r"engine.budget: unknown key; allowed: kv_tokens, "),
    ({"engine": {"kv_tokens": 64, "prefix_caching": "yes"}}, r"engine.prefix_caching: expected true or false"),
    ({"engine": {"kv_tokens": 64}, "kvtier": {}}, r"kvtier.dram_bytes: missing"),
    ({"engine": {"kv_tokens": 64}, "kvtier": {"dram_bytes": "lots"}}, r"kvtier.dram_bytes: expected a byte size"),
    ({"engine": {"kv_tokens": 64}, "kvtier": {"dram_bytes": "1GiB", "policy": "mru"}},
     r"kvtier.policy: unknown policy 'mru'; known: lru, prefix_lru"),
    ({"engine": {"kv_tokens": 64}, "kvtier": {"dram_bytes": "1GiB", "tiers": [{"capacity_bytes": 1}]}},
     r"kvtier.tiers\[0\].name: expected the name"),
    ({"engine": {"kv_tokens": 64}, "time_scale": 0}, r"time_scale: expected a number > 0"),
])
def test_a_bad_deployment_names_the_field(raw: dict, message: str) -> None:
    with pytest.raises(DeploymentError, match=message):
        load_deployment(raw)


def test_deployment_files_and_unknown_tiers(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text("engine:\n  kv_tokens: 64\nkvtier:\n  dram_bytes: 1MiB\n  tiers:\n    - name: nvme\n")
    dep = load_deployment(path)
    assert dep.kvtier is not None and dep.kvtier.dram_bytes == 2**20 and dep.kvtier.tiers[0].name == "nvme"
    with pytest.raises(ValueError, match=r"'nvme' is not a tier of the calibration \(calibrated: dram, disk\)"):
        simulate(trace((0, [1], 4, 1)), dep, COSTS)
    path.write_text("engine: [")
    with pytest.raises(DeploymentError, match=r"d.yaml: the deployment is not YAML"):
        load_deployment(path)


def test_on_a_cpu_engine_the_tier_writes_take_the_engines_time() -> None:
    import dataclasses

    # The first request's blocks are written to the disk tier while the second (arriving at once) computes.
    cpu = dataclasses.replace(COSTS, store={"disk": 2e6}, shared_cpu=True)
    requests = trace((0, [1, 2, 3], 12, 1), (0, [5], 4, 1))
    first = 0.1 + 0.01 * 12 + 0.001 * 144 + 3 * CHUNK / 4e6
    second = 0.1 + 0.01 * 4 + 0.001 * 16 + CHUNK / 4e6
    solo = dataclasses.replace(cpu, shared_cpu=False)
    chunked = load_deployment({"engine": {"kv_tokens": 68, "block_size": B, "max_num_batched_tokens": 12},  # one a step
                               "kvtier": {"dram_bytes": 10 * 4096, "page_bytes": 4096, "tiers": [{"name": "disk"}]}})
    assert simulate(requests, chunked, solo)["requests"][1]["ttft_s"] == pytest.approx(first + second)
    on_cpu = simulate(requests, chunked, cpu)
    assert on_cpu["requests"][0]["ttft_s"] == pytest.approx(first)  # its own writes come after its token
    assert on_cpu["requests"][1]["ttft_s"] == pytest.approx(first + second + 3 * CHUNK / 2e6)


def test_break_even_lengths_and_a_tier_slower_than_recompute() -> None:
    import dataclasses

    from kvtier.sim.breakeven import break_even, needed_bandwidth, recompute_s, served_s

    assert recompute_s(COSTS, 8) == pytest.approx(0.1 + 0.08 + 0.064)
    # 9 tokens from DRAM: 8 loaded (2 blocks), 1 computed after them.
    assert served_s(COSTS, "dram", 9, B) == pytest.approx(0.001 + 8000 / 1e6 + 0.1 + 0.01 + 0.001 * (1 + 16))
    assert break_even(COSTS, "dram", B, grid=[4, 8, 16, 64]) == 8  # at 4 tokens nothing is loaded: a tie
    slow = dataclasses.replace(COSTS, load={**COSTS.load, "s3": (0.5, 1e3)})
    assert break_even(slow, "s3", B, grid=[8, 16, 64]) is None  # 1 KB/s: recompute always wins
    # The bandwidth that ties recompute: 1,000 bytes a token over the time 64 tokens take to compute.
    assert needed_bandwidth(COSTS, 64) == pytest.approx(64 * 1000 / (0.01 * 64 + 0.001 * 64 * 64))


def test_kvtier_loads_nothing_when_it_lost_the_prefix_the_engine_still_holds() -> None:
    # Request 2 evicts request 1's blocks 2-3 from the engine and block 1 from an LRU DRAM of 4 blocks; kvtier's
    # lookup counts from the first chunk, so request 3 loads nothing though DRAM holds block 2.
    requests = trace((0, [1, 2, 3], 12, 1), (10, [7, 8, 9], 9, 1), (20, [1, 2, 3], 12, 1))
    out = simulate(requests, deployment(kv_tokens=16, kvtier={"dram_bytes": 4 * 4096, "page_bytes": 4096,
                                                              "policy": "lru"}), COSTS)
    assert out["requests"][2]["engine_hit_tokens"] == 4 and out["requests"][2]["loaded_tokens"] == {}


def test_simulate_with_a_deployment_writes_the_timing_report(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    lines = (root / "benchmarks" / "validate" / "trace.jsonl").read_text().splitlines()[:20]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "simulate", "--trace", str(tmp_path / "t.jsonl"),
                          "--block-tokens", "256", "--deployment", str(root / "benchmarks" / "validate" /
                                                                         "deployment.yaml"),
                          "--calibration", str(root / "benchmarks" / "results" / "calibration-2026-12-01.json"),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "out" / "timing.json").read_text())
    assert set(report["runs"]) == {"kvtier", "engine_alone"}
    assert report["runs"]["kvtier"]["ttft_s"]["p50"] < report["runs"]["engine_alone"]["ttft_s"]["p50"]
    grid = report["heatmap"]
    assert grid["disk_tier"] == "filesystem" and grid["disk_bytes"][0] == 0
    assert len(grid["ttft_p90_s"]) == len(grid["disk_bytes"]) and len(grid["ttft_p90_s"][0]) == len(grid["dram_bytes"])
    # more DRAM never makes p90 worse without a disk here (the same trace, a bigger cache)
    assert grid["ttft_p90_s"][0][-1] <= grid["ttft_p90_s"][0][0]
    for name in ("ttft_cdf.png", "ttft_vs_length.png", "heatmap.png", "requests.csv", "hit_ratio.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name


def test_admission_stores_a_prompt_at_its_second_put_and_serves_it_from_the_third() -> None:
    # KV space of 4 blocks, two prompts taking turns: the engine keeps only the first block of the one asked
    # before last. With store_after 2 nothing is stored (nor copied, in the first request's step) until a prompt
    # is put again; its next time then loads block 2 from DRAM, as the second time does when every put is stored.
    requests = trace(*[(10 * i, [1, 2, 3] if i % 2 == 0 else [7, 8, 9], 12, 1) for i in range(5)])
    kvtier = {"dram_bytes": 10 * 4096, "page_bytes": 4096}
    every = simulate(requests, deployment(kv_tokens=16, kvtier=kvtier), COSTS)
    second = simulate(requests, deployment(kv_tokens=16, kvtier={**kvtier, "store_after": 2}), COSTS)
    full = 0.1 + 0.01 * 12 + 0.001 * 144
    assert every["requests"][0]["ttft_s"] == pytest.approx(full + 3 * CHUNK / 4e6)
    assert second["requests"][0]["ttft_s"] == pytest.approx(full)  # no copy into DRAM
    assert [r["loaded_tokens"] for r in every["requests"]] == [{}, {}, {"dram": 4}, {"dram": 4}, {"dram": 4}]
    assert [r["loaded_tokens"] for r in second["requests"]] == [{}, {}, {}, {}, {"dram": 4}]
    assert every["stored_bytes"]["dram"] == 6 * CHUNK and second["stored_bytes"]["dram"] == 6 * CHUNK
    with pytest.raises(DeploymentError, match="kvtier.store_after"):
        deployment(kvtier={**kvtier, "store_after": 17})


# fp8 as the codec model costs it: 0.53125 of a chunk's bytes stored; encode 1 MB/s, decode 2 MB/s (raw bytes)
FP8 = CodecCost("fp8", False, 0.53125, 1e6, 2e6)
CODED = dataclasses.replace(COSTS, codecs={"none": NONE, "fp8": FP8})


def coded_deployment(codec: str) -> Deployment:
    """No prefix caching (the engine never hits), a DRAM of 2 blocks, a disk tier of 16 raw blocks' bytes."""
    return deployment(caching=False, kvtier={"dram_bytes": 2 * 4096, "page_bytes": 4096,
                                             "tiers": [{"name": "disk", "capacity_bytes": 16 * CHUNK,
                                                        "codec": codec}]})


def test_a_tier_with_fp8_holds_1_88_times_the_chunks_and_its_loads_move_fewer_bytes() -> None:
    # 20 prompts of 2 whole blocks, then the same again last first: DRAM holds the last prompt, the disk tier (an
    # LRU) the last 8 prompts raw (16 blocks) or the last 15 in fp8 (64,000 // 2,125 = 30 blocks).
    prompts = [[10 * i + 1, 10 * i + 2, 10 * i + 3] for i in range(20)]
    requests = trace(*[(10 * i, p, 9, 1) for i, p in enumerate(prompts)],
                     *[(200 + 10 * i, p, 9, 1) for i, p in enumerate(reversed(prompts))])
    raw, fp8 = (simulate(requests, coded_deployment(c), CODED) for c in ("none", "fp8"))
    assert raw["loaded_tokens"] == {"dram": 8, "disk": 7 * 8} and fp8["loaded_tokens"] == {"dram": 8, "disk": 14 * 8}
    hit_blocks = [sum(run["loaded_tokens"].values()) // B for run in (raw, fp8)]
    assert hit_blocks == [16, 30] and hit_blocks[1] / hit_blocks[0] == pytest.approx(1.88, abs=0.01)
    # each block loaded moves 2,125 bytes, not 4,000; the tier stores as much less
    assert raw["loaded_bytes"]["disk"] == 14 * CHUNK and fp8["loaded_bytes"]["disk"] == 28 * 2125
    assert fp8["stored_bytes"]["disk"] == 2125 * fp8["stored_bytes"]["dram"] // CHUNK
    # a load: latency, the stored bytes at the tier's bandwidth, then the decode; then the last token computed
    last = 0.1 + 0.01 + 0.001 * (1 + 2 * 8)
    assert raw["requests"][21]["ttft_s"] == pytest.approx(0.01 + 2 * CHUNK / 5e5 + last)
    assert fp8["requests"][21]["ttft_s"] == pytest.approx(0.01 + 2 * 2125 / 5e5 + 2 * CHUNK / 2e6 + last)
    assert fp8["decode_s"] == pytest.approx(28 * CHUNK / 2e6) and raw["decode_s"] == 0.0


def test_a_codec_the_calibration_did_not_measure_is_refused_naming_the_field() -> None:
    with pytest.raises(UnmeasuredCodec, match=r"kvtier.tiers\[0\].codec: codec 'fp8' is not measured by the "
                                              r"calibration \(measured: none\)"):
        simulate(trace((0, [1, 2, 3], 9, 1)), coded_deployment("fp8"), COSTS)
    with pytest.raises(DeploymentError, match=r"kvtier.tiers\[0\].codec: unknown codec 'zip'; known: fp8, k16v8, "
                                              r"lossless, none"):
        load_deployment({"engine": {"kv_tokens": 64}, "kvtier": {"dram_bytes": "1GiB",
                                                                 "tiers": [{"name": "disk", "codec": "zip"}]}})


def test_the_encode_runs_with_the_tier_writes_off_the_engine_s_path() -> None:
    # As test_on_a_cpu_engine_the_tier_writes_take_the_engines_time, the disk tier in fp8: a CPU engine's next
    # step also takes the encode of the 3 blocks written; a GPU engine's takes nothing, the CPU time is reported.
    cpu = dataclasses.replace(CODED, store={"disk": 2e6}, shared_cpu=True)
    requests = trace((0, [1, 2, 3], 12, 1), (0, [5], 4, 1))
    first = 0.1 + 0.01 * 12 + 0.001 * 144 + 3 * CHUNK / 4e6
    second = 0.1 + 0.01 * 4 + 0.001 * 16 + CHUNK / 4e6
    chunked = load_deployment({"engine": {"kv_tokens": 68, "block_size": B, "max_num_batched_tokens": 12},
                               "kvtier": {"dram_bytes": 10 * 4096, "page_bytes": 4096,
                                          "tiers": [{"name": "disk", "codec": "fp8"}]}})
    on_cpu = simulate(requests, chunked, cpu)
    assert on_cpu["requests"][1]["ttft_s"] == pytest.approx(first + second + 3 * 2125 / 2e6 + 3 * CHUNK / 1e6)
    on_gpu = simulate(requests, chunked, dataclasses.replace(cpu, shared_cpu=False))
    assert on_gpu["requests"][1]["ttft_s"] == pytest.approx(first + second)
    assert on_gpu["encode_cpu_s"] == on_cpu["encode_cpu_s"] == pytest.approx(4 * CHUNK / 1e6)  # both prompts'


def test_simulate_times_a_tier_s_codec_and_refuses_one_the_calibration_did_not_measure(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    lines = (root / "benchmarks" / "validate" / "trace.jsonl").read_text().splitlines()[:20]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "d.yaml").write_text("engine: {kv_tokens: 8192}\nkvtier:\n  dram_bytes: 64MiB\n  tiers:\n"
                                     "    - {name: filesystem, codec: fp8}\n")
    old = root / "benchmarks" / "results" / "calibration-2026-12-01.json"

    def simulate_with(calibration: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvtier.cli", "simulate", "--trace", str(tmp_path / "t.jsonl"),
                               "--block-tokens", "256", "--deployment", str(tmp_path / "d.yaml"), "--calibration",
                               str(calibration), "--out", str(tmp_path / "out"), "--no-plot"],
                              capture_output=True, text=True)

    run = simulate_with(old)
    assert run.returncode == 2, run.stderr
    assert "kvtier.tiers[0].codec: codec 'fp8' is not measured by the calibration (measured: none)" in run.stderr
    assert not (tmp_path / "out" / "cache.json").exists()  # refused before the cache layer ran
    measured = json.loads(old.read_text())
    measured["codecs"] = {"by_codec": {"fp8": {"stored_over_raw": 0.53125, "encode_bytes_per_s": 3e8,
                                               "decode_bytes_per_s": 5e8}}}
    (tmp_path / "cal.json").write_text(json.dumps(measured))
    run = simulate_with(tmp_path / "cal.json")
    assert run.returncode == 0, run.stderr
    timed = json.loads((tmp_path / "out" / "timing.json").read_text())["runs"]["kvtier"]
    assert timed["encode_cpu_s"] > 0 and "CPU-s encoding on the writer threads" in run.stdout
    stored_chunk = 23040 * 256 * 17 // 32  # an fp8 chunk of SmolLM2's: 0.53125 of 5,898,240 bytes
    assert timed["stored_bytes"]["filesystem"] % stored_chunk == 0 and timed["stored_bytes"]["filesystem"] > 0
