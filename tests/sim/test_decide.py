"""``kvtier decide``: its rule on hand-made numbers, a shared tier seen across engines, the costs and sizes it
reports, and its answers against the right answers measured on vLLM (benchmarks/decide/measure.py)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.sim.accuracy import load_accuracy
from kvtier.sim.calibrate import load_calibration
from kvtier.sim.codec_model import split_option
from kvtier.sim.card import generate, load_card
from kvtier.sim.decide import FactsError, choose, crossing_share, decide, load_facts, print_decision, unique
from kvtier.sim.deployment import load_deployment
from kvtier.sim.timing import StepCosts, simulate
from kvtier.sim.trace import Request, Trace

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "benchmarks" / "results" / "calibration-2026-12-01.json"


def option(p50: float, p90: float) -> dict[str, float]:
    return {"ttft_p50_s": p50, "ttft_p90_s": p90}


@pytest.mark.parametrize("options, answer, rival, close", [
    ({"none": option(1, 2), "local": option(0.99, 1.98)}, "none", "local", False),  # 1% gains nothing
    ({"none": option(1, 2), "local": option(1.01, 2.08)}, "none", "local", False),  # it costs
    ({"none": option(1, 2), "local": option(0.97, 2.0)}, "none", "local", True),  # 3%: close to paying
    ({"none": option(1, 2), "local": option(0.5, 1.0)}, "local", "none", False),
    ({"none": option(1, 2), "local": option(0.93, 2.0)}, "local", "none", True),  # pays, barely
    ({"none": option(1, 2), "local": option(0.5, 2.2)}, "none", "local", True),  # p50 halved, p90 10% worse
    # a shared tier must beat local by 5% too (also when local alone does not pay), and a near rival makes the
    # answer close
    ({"none": option(1, 2), "local": option(0.5, 1.0), "shared:redis": option(0.5, 0.97)}, "local",
     "shared:redis", True),
    ({"none": option(1, 2), "local": option(0.5, 1.0), "shared:redis": option(0.3, 0.6)}, "shared:redis", "none",
     False),
    ({"none": option(1, 2), "local": option(0.97, 1.95), "shared:r": option(0.95, 1.90)}, "none", "shared:r", True),
    # the best shared tier that does not beat local does not hide one that does
    ({"none": option(1, 2), "local": option(0.5, 1.0), "shared:a": option(0.5, 0.98), "shared:b": option(0.4, 0.5)},
     "shared:b", "none", False),
    # a rival must pay to be close: a tier with a far worse p50 is no rival, and the nearest rival is named
    ({"none": option(1, 2), "local": option(0.5, 1.0), "shared:a": option(5.0, 1.0)}, "local", "none", False),
    ({"none": option(1, 2), "local": option(0.5, 1.0), "shared:a": option(0.4, 1.08), "shared:b": option(0.4, 1.02)},
     "local", "shared:b", True),
    # a codec must pay against the same tiers without it (3% does not: the answer stays exact, close to it) ...
    ({"none": option(1, 2), "local": option(0.5, 1.0), "local+fp8": option(0.5, 0.97)}, "local", "local+fp8", True),
    ({"none": option(1, 2), "local": option(0.5, 1.0), "local+fp8": option(0.3, 0.6)}, "local+fp8", "none", False),
    # ... and a shared tier with a codec against engine-local offloading with the same codec
    ({"none": option(1, 2), "local": option(0.5, 1.0), "local+fp8": option(0.4, 0.62),
      "shared:r+fp8": option(0.39, 0.6)}, "local+fp8", "shared:r+fp8", True),
    ({"none": option(1, 2), "local": option(0.5, 1.0), "local+fp8": option(0.4, 0.8), "shared:r": option(0.45, 0.9),
      "shared:r+fp8": option(0.3, 0.6)}, "shared:r+fp8", "none", False),
])
def test_choose(options, answer, rival, close) -> None:
    assert choose(options) == (answer, rival, close)


def test_an_option_that_costs_throughput_does_not_pay() -> None:
    base = {**option(1, 2), "output_tokens_per_s": 100.0}
    assert choose({"none": base, "local": {**option(0.5, 1.0), "output_tokens_per_s": 99.0}})[0] == "local"
    assert choose({"none": base, "local": {**option(0.5, 1.0), "output_tokens_per_s": 90.0}})[0] == "none"


FACTS = {"engine": {"kv_tokens": 2048, "max_num_batched_tokens": 4096}, "dram_bytes": "1GiB"}


@pytest.mark.parametrize("change, message", [
    ({"engnes": 2}, "facts.engnes: unknown key"),
    ({"engines": 0}, "facts.engines: expected an integer from 1 to 4096"),
    ({"routing": "random"}, "facts.routing: expected session or round_robin"),
    ({"engines": 10**6}, "facts.engines: expected an integer from 1 to 4096"),
    ({"block_tokens": 4096}, r"facts.block_tokens: 4096 is more than the engine's KV space \(2048 tokens\)"),
    ({"shared": [{"name": "dram"}]}, r"facts.shared\[0\].name: 'dram' is kvtier's DRAM"),
    ({"disk_bytes": "1GiB", "shared": [{"name": "filesystem"}]}, r"facts.shared\[0\].name: 'filesystem'"),
    ({"shared": {}}, "facts.shared: expected a list"),
    ({"engine": None}, "engine: missing"),
    ({"dram_bytes": None}, "facts.dram_bytes: missing"),
    ({"disk_bytes": "lots"}, "disk_bytes"),
    ({"policy": "mru"}, "facts.policy: unknown policy 'mru'; known:"),
    ({"shared": [{"name": "redis", "size": 1}]}, r"facts.shared\[0\].size: unknown key"),
    ({"engine": {"kv_tokens": -1}}, "engine.kv_tokens: expected an integer >= 1"),
    ({"shared": [{"name": "redis", "codec": "fp8"}]}, r"facts.shared\[0\].codec: decide weighs the codecs itself"),
    ({"shared": [{"name": "redis", "codec": "zip"}]}, r"facts.shared\[0\].codec: unknown codec 'zip'; known: fp8, "),
])
def test_bad_facts_name_the_field(change, message) -> None:
    with pytest.raises(FactsError, match=message):
        load_facts({k: v for k, v in {**FACTS, **change}.items() if v is not None or k == "engine"})


def test_a_tier_the_calibration_did_not_measure_is_an_error() -> None:
    facts = load_facts({**FACTS, "shared": [{"name": "redis"}]})
    with pytest.raises(FactsError, match="facts.shared: 'redis' is not a tier of the calibration"):
        decide(load_card({"requests": 5}), facts, load_calibration(CALIBRATION))


def trace(*requests: tuple[float, list[int]]) -> Trace:
    return Trace(tuple(Request(t * 1000, 4 * len(b), 1, tuple(b), len(b)) for t, b in requests), 4, "t")


COSTS = StepCosts(a=0.1, b=0.01, c=0.0, d0=0.05, d1=0.0, kv_bytes_per_token=1000,
              load={"dram": (0.001, 1e6), "shared": (0.01, 1e6)}, dram_store_bytes_per_s=1e9,
              store={"shared": 2e6})
SHARED = load_deployment({"engine": {"kv_tokens": 68, "block_size": 4},
                          "kvtier": {"dram_bytes": 1 << 20, "page_bytes": 4096, "tiers": [{"name": "shared"}]}})


def test_a_shared_tier_serves_what_another_engine_wrote_while_it_holds_it() -> None:
    # Engine A computes blocks 1-3 (and a last block 4); its store log says when they reached the shared tier:
    # the end of the step, plus writing the 4 blocks at the tier's store bandwidth (2 MB/s).
    log: dict[int, float] = {}
    first = simulate(trace((0, [1, 2, 3, 4])), SHARED, COSTS, shared="shared", store_log=log)
    stored = first["requests"][0]["ttft_s"] + 4 * 4000 / 2e6
    assert set(log) == {1, 2, 3, 4} and all(at == pytest.approx(stored) for at in log.values())
    # Engine B asks the same prompt before, during and after the window the tier holds them in.
    window = {b: (at, stored + 1.0) for b, at in log.items()}
    before = simulate(trace((stored / 2, [1, 2, 3, 4])), SHARED, COSTS, shared="shared", elsewhere=window)
    after = simulate(trace((stored + 0.01, [1, 2, 3, 4])), SHARED, COSTS, shared="shared", elsewhere=window)
    evicted = simulate(trace((stored + 1.5, [1, 2, 3, 4])), SHARED, COSTS, shared="shared", elsewhere=window)
    assert before["loaded_tokens"] == {} and evicted["loaded_tokens"] == {}
    assert after["loaded_tokens"] == {"shared": 12}
    # one load of 3 blocks, the last block computed, and its copy into DRAM
    assert after["requests"][0]["ttft_s"] == pytest.approx(0.01 + 12 * 1000 / 1e6 + 0.1 + 0.01 * 4 + 4000 / 1e9)
    # Without sharing, the log is nobody's.
    alone = simulate(trace((stored + 0.01, [1, 2, 3, 4])), SHARED, COSTS)
    assert alone["loaded_tokens"] == {}


def test_crossing_share_counts_reuse_on_an_engine_that_never_had_the_block() -> None:
    w = generate(load_card({"requests": 400, "shared_prefix": {"tokens": 1024},
                            "sessions": {"turns": 2, "think_time_s": 5},
                            "prompt_tokens": {"median": 300, "p90": 300}}), 256)
    assert crossing_share(w, 1, "session") == 0.0
    # One system prompt of 4 blocks: each of 4 engines misses it once; the sessions' own history stays on their
    # engine with session routing, and crosses half the time with round robin over two engines.
    reuses = sum(1 for r in w.trace.requests for _ in r.blocks[:r.whole]) - w.trace.distinct_blocks
    assert crossing_share(w, 4, "session") == pytest.approx(3 * 4 / reuses)
    assert crossing_share(w, 2, "round_robin") > crossing_share(w, 2, "session") > 0


def test_unique_keeps_arrivals_and_lengths_and_shares_nothing_across_engines() -> None:
    t = generate(load_card({"requests": 30, "shared_prefix": {"tokens": 1024}}), 256).trace
    halves = [Trace(t.requests[:15], 256, "a"), Trace(t.requests[15:], 256, "b")]
    u = unique(halves)
    assert [(r.timestamp_ms, r.input_length, r.whole) for part in u for r in part.requests] == \
        [(r.timestamp_ms, r.input_length, r.whole) for r in t.requests]
    blocks = [b for part in u for r in part.requests for b in r.blocks]
    assert len(blocks) == len(set(blocks))  # engine b's blocks are not engine a's either


def test_two_engines_round_robin_pay_for_a_shared_tier_and_a_slow_one_does_not() -> None:
    cal = copy.deepcopy(load_calibration(CALIBRATION))
    fs = cal["tiers"]["filesystem"]
    cal["tiers"]["fast"] = copy.deepcopy(fs)
    slow = cal["tiers"]["slow"] = copy.deepcopy(fs)  # a tier slower than recomputing: 2 MB/s
    slow["bandwidth_bytes_per_s"] = 2e6
    slow["streams"][0]["load_bytes_per_s"] = 2e6
    card = load_card({"requests": 60, "arrival": {"rate_per_s": 0.5}, "shared_prefix": {"tokens": 1024, "fan_out": 8},
                      "prompt_tokens": {"median": 60, "p90": 120}, "output_tokens": 8})
    facts = load_facts({"engines": 2, "routing": "round_robin", "engine": {"kv_tokens": 2048,
                                                                           "max_num_batched_tokens": 4096},
                        "dram_bytes": "30MiB", "shared": [{"name": "fast"}, {"name": "slow"}]})
    out = decide(card, facts, cal)
    assert out["answer"] == "shared:fast"
    o = out["options"]
    assert o["shared:fast"]["loaded_tokens"].get("fast", 0) > 0
    assert o["shared:fast"]["ttft_p90_s"] < 0.95 * o["local"]["ttft_p90_s"]
    assert o["shared:slow"]["ttft_p50_s"] > o["local"]["ttft_p50_s"]
    assert out["tiers"]["slow"]["break_even_tokens"] is None
    assert out["tiers"]["fast"]["break_even_tokens"] is not None
    assert out["crossing_share"] > 0.1
    assert any("slow: delivers 2.0 MB/s" in line and "slower than recompute" in line for line in out["reasons"])
    assert "sized to" in print_answer(out)
    # with nothing reused, a shared tier finds nothing another engine wrote: it cannot be faster than none
    assert out["zero_hit_cost"]["shared:fast"]["ttft_p50_ratio"] >= 0.999


def test_a_shared_tier_smaller_than_the_reuse_gives_less() -> None:
    cal = load_calibration(CALIBRATION)
    card = load_card({"requests": 80, "arrival": {"rate_per_s": 0.5}, "shared_prefix": {"tokens": 1024, "fan_out": 16},
                      "prompt_tokens": {"median": 60, "p90": 120}, "output_tokens": 8})
    common = {"engines": 2, "routing": "round_robin", "engine": {"kv_tokens": 2048, "max_num_batched_tokens": 4096},
              "dram_bytes": "60MiB"}
    big = decide(card, load_facts({**common, "shared": [{"name": "filesystem"}]}), cal)
    small = decide(card, load_facts({**common, "shared": [{"name": "filesystem", "capacity_bytes": "24MiB"}]}), cal)
    tokens = lambda r: r["options"]["shared:filesystem"]["loaded_tokens"].get("filesystem", 0)  # noqa: E731
    assert tokens(small) < tokens(big)


def print_answer(result) -> str:
    import io

    out = io.StringIO()
    print_decision(result, out)
    return out.getvalue()


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("decide-*.json")),
                         ids=lambda p: p.name)
def test_decide_gives_the_answers_and_hit_ratios_measured_on_vllm(path: Path) -> None:
    """benchmarks/decide/measure.py ran each card without offloading and with kvtier on vLLM; decide, from the
    calibration alone, must give each option's prefix-hit ratio within 0.015 of vLLM's cached tokens, and the
    measured answer beyond run-to-run noise (an option that served nothing more than the engine's own cache
    gains nothing; measure.py's `judge`)."""
    results = json.loads(path.read_text())
    facts = load_facts(ROOT / "benchmarks" / "decide" / "facts.yaml")
    calibration = load_calibration(ROOT / results["calibration"])
    assert results["cards"], "no cards were measured"
    for name, row in results["cards"].items():
        card = load_card(ROOT / "benchmarks" / "decide" / "cards" / f"{name}.yaml")
        out = decide(card, facts, calibration)
        assert out["answer"] == row["answer_beyond_noise"], name
        for option in ("none", "local"):
            assert out["options"][option]["hit_ratio"] == pytest.approx(row["measured"][option]["hit_ratio"],
                                                                        abs=0.015), (name, option)


def test_the_measured_runs_say_whether_kvtier_served_anything() -> None:
    """The rule behind the answers beyond noise, on the stored runs: cards that share nothing had no hits in
    either run, and the cards decide sends to local offloading had kvtier serve over a tenth of their tokens."""
    results = json.loads((ROOT / "benchmarks" / "results" / "decide-2026-12-01.json").read_text())
    for name in ("short", "unique"):
        assert results["cards"][name]["measured"]["local"]["hit_ratio"] == 0.0
    for name in ("documents", "tenants"):
        assert results["cards"][name]["kvtier_served_share"] > 0.1


def test_the_command_prints_and_writes_the_decision(tmp_path: Path) -> None:
    (tmp_path / "card.yaml").write_text("requests: 20\nshared_prefix: {tokens: 1024}\ntenants: 4\n"
                                        "prompt_tokens: {median: 100}\n")
    (tmp_path / "facts.yaml").write_text("engine: {kv_tokens: 2048}\ndram_bytes: 200MiB\ndisk_bytes: 1GiB\n")
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "decide", "--card", str(tmp_path / "card.yaml"),
                          "--facts", str(tmp_path / "facts.yaml"), "--calibration", str(CALIBRATION),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("answer: local")
    assert "local when nothing is reused" in run.stdout and "decide: timing local" in run.stderr
    saved = json.loads((tmp_path / "out" / "decide.json").read_text())
    assert saved["answer"] == "local" and set(saved["options"]) == {"none", "local"}
    (tmp_path / "card.yaml").write_text("requests: 20\nshared_prefix: {tokens: -5}\n")
    bad = subprocess.run([sys.executable, "-m", "kvtier.cli", "decide", "--card", str(tmp_path / "card.yaml"),
                          "--facts", str(tmp_path / "facts.yaml"), "--calibration", str(CALIBRATION)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "shared_prefix.tokens: expected an integer from 0 to" in bad.stderr


MIXED = {"requests": 200, "arrival": {"rate_per_s": 0.3}, "documents": {"count": 8, "tokens": 2048, "skew": 1.0},
         "prompt_tokens": {"median": 1500, "p90": 2500}, "output_tokens": 16}
ENGINE = {"kv_tokens": 6144, "max_num_batched_tokens": 8192, "max_num_seqs": 64}


def test_decide_recommends_admission_where_one_off_prompts_push_reused_documents_out() -> None:
    # Long questions asked once after popular documents: storing every put fills a 240 MiB DRAM with questions
    # and evicts documents; storing a prefix once it comes again keeps the documents and hits more.
    cal = load_calibration(CALIBRATION)
    facts = load_facts({"engine": ENGINE, "dram_bytes": "240MiB", "block_tokens": 256})
    out = decide(load_card(MIXED), facts, cal)
    assert out["answer"] == "local"
    admission, every = out["admission"], out["options"]["local"]
    assert admission["store_after"] == 2 and admission["recommended"]
    assert admission["card"]["hit_ratio"] > every["hit_ratio"] + 0.1
    assert admission["card"]["ttft_p90_s"] < 0.95 * every["ttft_p90_s"]
    # with nothing reused it stores nothing, so it costs nothing
    assert admission["zero_hit_cost"]["ttft_p90_ratio"] == pytest.approx(1.0, abs=1e-3)
    text = print_answer(out)
    assert text.startswith("answer: local with admission.store_after: 2")
    assert "admission.store_after 2" in text and ": recommended" in text


def test_decide_does_not_recommend_admission_where_the_first_repeat_is_the_hit() -> None:
    cal = load_calibration(CALIBRATION)
    facts = load_facts(ROOT / "benchmarks" / "decide" / "facts.yaml")
    tenants = decide(load_card(ROOT / "benchmarks" / "decide" / "cards" / "tenants.yaml"), facts, cal)
    assert tenants["answer"] == "local" and not tenants["admission"]["recommended"]
    assert tenants["admission"]["card"]["hit_ratio"] < tenants["options"]["local"]["hit_ratio"]
    assert print_answer(tenants).startswith("answer: local\n") and ": not recommended" in print_answer(tenants)
    # no offloading: nothing to admit
    unique_card = decide(load_card(ROOT / "benchmarks" / "decide" / "cards" / "unique.yaml"), facts, cal)
    assert unique_card["answer"] == "none" and unique_card["admission"] is None


# Codec measurements as `kvtier calibrate` writes them (fixed here: a test asserts no speed), on the shipped
# calibration, which predates them.
CODECS = {"fp8": {"stored_over_raw": 0.53125, "encode_bytes_per_s": 3e8, "decode_bytes_per_s": 5e8},
          "k16v8": {"stored_over_raw": 0.765625, "encode_bytes_per_s": 1.4e8, "decode_bytes_per_s": 7.5e8},
          "lossless": {"stored_over_raw": 0.74, "encode_bytes_per_s": 2.4e8, "decode_bytes_per_s": 3e8}}
# Eight documents of 8 chunks asked uniformly: a 200 MiB disk holds 35 raw chunks of the 64, all of them in fp8.
DOCUMENTS = {"requests": 200, "arrival": {"rate_per_s": 0.5}, "documents": {"count": 8, "tokens": 2048, "skew": 0},
             "prompt_tokens": {"median": 60, "p90": 60}, "output_tokens": 8}
DISK = {"engine": {"kv_tokens": 2560, "max_num_batched_tokens": 4096}, "dram_bytes": "60MiB",
        "disk_bytes": "200MiB", "block_tokens": 256}
ACCURACY = {"kind": "codecs", "date": "2026-12-06", "machine": "Test CPU", "commit": "abc1234",
            "bytes_per_token": 23040,
            "codecs": {"fp8": {"agreement": [0.984, 0.969, 0.99], "kl": [0.001, 0.002, 0.0015],
                               "ppl_change": [0.004, -0.001, 0.002], "target_met": True}}}


def measured_codecs() -> dict:
    cal = copy.deepcopy(load_calibration(CALIBRATION))
    cal["codecs"] = {"by_codec": copy.deepcopy(CODECS)}
    return cal


def test_decide_never_weighs_a_lossy_codec_unless_the_card_allows_lossy_kv(tmp_path: Path) -> None:
    cal, facts = measured_codecs(), load_facts(DISK)
    exact = decide(load_card(DOCUMENTS), facts, cal)
    assert set(exact["options"]) == {"none", "local", "local+lossless"}
    assert exact["answer"] == "local+lossless" and split_option(exact["answer"]).codec == "lossless"
    assert "lossy codecs (fp8, k16v8) not weighed: the card does not allow lossy KV (lossy_kv: true allows it)" in \
        exact["reasons"] and exact["codecs"]["accuracy"] == []
    (tmp_path / "codecs-2026-12-06.json").write_text(json.dumps(ACCURACY))
    lossy = decide(load_card({**DOCUMENTS, "lossy_kv": True}), facts, cal,
                   accuracy=load_accuracy(tmp_path / "codecs-2026-12-06.json"))
    assert set(lossy["options"]) == {"none", "local", "local+lossless", "local+fp8", "local+k16v8"}
    o = lossy["options"]
    assert lossy["answer"] == "local+fp8" and o["local+fp8"]["hit_ratio"] > o["local"]["hit_ratio"] + 0.3
    assert o["local+fp8"]["encode_cpu_s"] > 0 and o["local"]["encode_cpu_s"] == 0
    text = print_answer(lossy)
    assert text.startswith("answer: local+fp8 (its tiers besides DRAM store chunks in fp8: lossy)")
    assert "\n  - fp8 is lossy: greedy agreement 98.1% (min 96.9%) over 3 prompt(s), perplexity +0.4% worst, mean KL " \
           "0.0015 nats; the benchmark's target met; measured by benchmarks/bench_codecs.py" in text
    assert "codec fp8 (lossy): a tier stores 0.531 of the raw bytes (1.88x the chunks); one thread encodes 300.0 MB/s" \
        in text
    # without a file the figures are not made up
    unmeasured = decide(load_card({**DOCUMENTS, "lossy_kv": True}), facts, cal)
    assert unmeasured["codecs"]["accuracy"] == ["fp8 is lossy; its accuracy is not measured (no accuracy file was "
                                                "given)"]


def test_a_calibration_without_codec_measurements_weighs_none_and_says_so() -> None:
    out = decide(load_card({**DOCUMENTS, "requests": 40, "lossy_kv": True}), load_facts(DISK),
                 load_calibration(CALIBRATION))
    assert set(out["options"]) == {"none", "local"} and out["codecs"]["weighed"] == []
    assert any(line.startswith("codecs the calibration did not measure, not weighed: fp8, k16v8, lossless")
               for line in out["reasons"])


def test_the_command_shows_the_accuracy_file_beside_a_lossy_answer(tmp_path: Path) -> None:
    (tmp_path / "cal.json").write_text(json.dumps(measured_codecs()))
    (tmp_path / "card.json").write_text(json.dumps({**DOCUMENTS, "lossy_kv": True}))
    (tmp_path / "facts.json").write_text(json.dumps(DISK))
    (tmp_path / "acc.json").write_text(json.dumps(ACCURACY))
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "decide", "--card", str(tmp_path / "card.json"),
                          "--facts", str(tmp_path / "facts.json"), "--calibration", str(tmp_path / "cal.json"),
                          "--accuracy", str(tmp_path / "acc.json"), "--out", str(tmp_path / "out"), "--no-plot"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("answer: local+fp8")
    assert "fp8 is lossy: greedy agreement 98.1% (min 96.9%)" in run.stdout
    assert str(tmp_path / "acc.json") in run.stdout
    saved = json.loads((tmp_path / "out" / "decide.json").read_text())
    assert saved["codecs"]["weighed"] == ["fp8", "k16v8", "lossless"] and len(saved["codecs"]["accuracy"]) == 1
    (tmp_path / "acc.json").write_text("{}")
    bad = subprocess.run([sys.executable, "-m", "kvtier.cli", "decide", "--card", str(tmp_path / "card.json"),
                          "--facts", str(tmp_path / "facts.json"), "--calibration", str(tmp_path / "cal.json"),
                          "--accuracy", str(tmp_path / "acc.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and "acc.json: kind: expected \"codecs\"" in bad.stderr
