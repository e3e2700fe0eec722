"""Routing decisions from the index and the router's own accounting (no I/O)."""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter

import pytest

from kvtier.errors import ConfigError
from kvtier.router.config import load_router_config
from kvtier.router.events import Stored
from kvtier.router.index import PrefixIndex, block_key
from kvtier.router.policy import Router
from kvtier.router.prompts import Prompt, Uncached

BS = 16


def make(policy="cache_aware", engines=("e0", "e1"), **costs) -> Router:
    config = load_router_config({
        "tokenizer": "/unused", "block_size": BS, "policy": policy,
        "engines": [{"name": n, "url": f"http://127.0.0.1:{8100 + i}"} for i, n in enumerate(engines)],
        "costs": {"prefill_tokens_per_s": 1000, "decode_s_per_request": 0.01, **costs}})
    router = Router(config, PrefixIndex(BS))
    for state in router.engines.values():
        state.healthy = True
    return router


def hold(router: Router, engine: str, tokens, medium="GPU", locality=None) -> None:
    """Announce ``tokens``' whole blocks on ``engine`` as its events would."""
    parent = None
    for i in range(len(tokens) // BS):
        block = tuple(tokens[i * BS:(i + 1) * BS])
        h = hash(("h", engine, tuple(tokens[:(i + 1) * BS])))
        router.index.stored(engine, Stored(hashes=(h,), parent=parent, token_ids=block, block_size=BS,
                                           medium=medium, locality=locality))
        parent = h


DOC = list(range(1000, 1000 + 64 * BS))  # 1,024 tokens


def decoding(router: Router, engine: str, count: int, tag: int = 0) -> None:
    """``count`` requests sent to ``engine`` (on ``DOC``, two tokens of their own each) and answering there (they
    reserve no blocks: what the engine holds stays as the test announced it)."""
    for i in range(count):
        prompt = Prompt(DOC + [tag, i])
        flight = router.engines[engine].flights[router.started(router.decide(prompt, names=[engine])[0], [])]
        flight.answering, flight.keys = True, router.keys(prompt)


def test_goes_where_the_prefix_is_and_predicts_vllms_cached_tokens():
    router = make()
    hold(router, "e1", DOC)
    first = router.decide(Prompt(DOC + [1, 2, 3]))[0]
    assert (first.engine, first.reason, first.predicted_cached) == ("e1", "prefix", 64 * BS)
    # asked again exactly: vLLM computes the last token, so the last block is not a hit
    assert router.decide(Prompt(DOC))[0].predicted_cached == 63 * BS


def test_a_burst_sharing_a_new_prefix_does_not_all_land_on_one_engine():
    router = make()
    order = []
    flights = []
    for i in range(6):
        decision = router.decide(Prompt(DOC + [i] * 20))[0]
        flights.append((decision.engine, router.started(decision, router.keys(Prompt(DOC + [i] * 20)))))
        order.append((decision.engine, decision.reason))
    # The first computes the prefix. The second finds it reserved on e0, behind 1 s of prefill, and computing
    # it on the idle e1 is as fast: it goes there. From then on both hold it and the load decides.
    assert order[:2] == [("e0", "no_prefix"), ("e1", "load")]
    assert all(reason == "prefix" for _, reason in order[2:]), order
    assert Counter(e for e, _ in order) == {"e0": 3, "e1": 3}
    for engine, flight in flights:
        router.finished(engine, flight)


def test_a_prefix_in_a_shared_tier_spreads_over_the_fleet():
    router = make(shared_tokens_per_s=100_000)
    hold(router, "e0", DOC)
    hold(router, "e0", DOC, medium="STORAGE", locality="REMOTE")
    engines = []
    for i in range(8):
        prompt = Prompt(DOC + [i] * 20)
        decision = router.decide(prompt)[0]
        router.started(decision, router.keys(prompt))  # none finishes: the load builds up
        engines.append(decision.engine)
    assert set(engines) == {"e0", "e1"} and max(Counter(engines).values()) <= 5


def test_without_a_shared_tier_a_busy_holder_still_loses_to_an_idle_engine_eventually():
    router = make()
    hold(router, "e0", DOC)
    engines = []
    for i in range(40):
        prompt = Prompt(DOC + [i] * 200)
        decision = router.decide(prompt)[0]
        router.started(decision, router.keys(prompt))
        engines.append(decision.engine)
    assert engines[0] == "e0" and "e1" in engines


def test_round_robin_and_session_affinity():
    router = make("round_robin", engines=("a", "b", "c"))
    assert [router.decide(Prompt(DOC))[0].engine for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    router = make("session", engines=("a", "b", "c"))
    picks = {s: router.decide(Prompt(DOC), session=s)[0].engine for s in ("u1", "u2", "u3", "u4", "u5", "u6")}
    assert all(router.decide(Prompt([1]), session=s)[0].engine == e for s, e in picks.items())
    lost = picks["u1"]
    router.engines[lost].healthy = False
    moved = {s: router.decide(Prompt(DOC), session=s)[0].engine for s in picks}
    assert all(moved[s] == e for s, e in picks.items() if e != lost)  # only the lost engine's sessions move
    assert lost not in moved.values()


def test_unhealthy_engines_are_not_candidates_and_none_healthy_gives_nothing():
    router = make()
    router.engines["e0"].healthy = False
    assert [d.engine for d in router.decide(Prompt(DOC))] == ["e1"]
    router.engines["e1"].healthy = False
    assert router.decide(Prompt(DOC)) == []


def test_lost_engine_is_forgotten():
    router = make()
    hold(router, "e0", DOC)
    router.lost("e0")
    router.engines["e0"].healthy = True
    assert router.decide(Prompt(DOC + [1]))[0].match.blocks == 0


def test_first_bytes_calibrate_prefill_cost():
    router = make(engines=("e0",))
    for i in range(3):  # the first calibration takes the median of three samples
        prompt = Prompt([5000 * (i + 1) + t for t in range(1024)])  # a prefix of its own each time
        decision = router.decide(prompt)[0]
        flight = router.started(decision, router.keys(prompt))
        router.first_byte(decision.engine, flight, ttft_s=0.5)  # 1,024 tokens in 0.5 s, nothing ahead
        router.finished(decision.engine, flight)
    assert router.engines["e0"].calibrated and router.engines["e0"].prefill_s_per_token < 0.6e-3


@pytest.mark.parametrize("patch, field", [
    ({"engines": []}, "engines"),
    ({"engines": [{"name": "a", "url": "ftp://x"}]}, "engines[0].url"),
    ({"engines": [{"name": "a", "url": "http://x:1", "kv_events": "udp://x"}]}, "engines[0].kv_events"),
    ({"engines": [{"name": "a", "url": "http://x:1"}, {"name": "a", "url": "http://y:1"}]}, "engines[1].name"),
    ({"policy": "fastest"}, "policy"),
    ({"listen": "8000"}, "listen"),
    ({"block_size": 0}, "block_size"),
    ({"timeouts": {"idle_s": 0}}, "timeouts.idle_s"),
    ({"costs": {"prefill_tokens_per_s": 0}}, "costs.prefill_tokens_per_s"),
    ({"costs": {"shared_tokens_per_s": "fast"}}, "costs.shared_tokens_per_s"),
    ({"colour": "blue"}, "colour"),
    ({"tokenizer": ""}, "tokenizer"),
])
def test_config_errors_name_the_field(patch, field):
    base = {"tokenizer": "/m", "engines": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    with pytest.raises(ConfigError, match="^" + re.escape(field)):
        load_router_config({**base, **patch})


def test_block_key_depends_on_parent_tokens_and_extras():
    a = block_key(None, [1, 2], None)
    assert a == block_key(None, [1, 2], [])
    assert len({a, block_key(a, [1, 2], None), block_key(None, [1, 3], None), block_key(None, [1, 2], ["s"])}) == 4


def test_ttfts_beside_decoding_requests_calibrate_their_cost():
    router = make(engines=("e0",), decode_s_per_request=0.01)
    flights = []
    for i in range(3):  # three requests answering on e0
        prompt = Prompt([i] * 4)
        decision = router.decide(prompt)[0]
        flight = router.started(decision, router.keys(prompt))
        router.first_byte(decision.engine, flight, ttft_s=0.01)
        flights.append((decision.engine, flight))
    engine = flights[0][0]
    for _ in range(10):  # a short prompt that took 0.31 s beside three decoding: 0.1 s each
        decision = router.decide(Prompt([7] * 4))[0]
        flight = router.started(decision, [])
        router.first_byte(engine, flight, ttft_s=0.31)
        router.finished(engine, flight)
    assert 0.08 < router.engines[engine].decode_s < 0.11


def test_kvtier_hits_count_the_blocks_kvtier_announced_up_to_the_prompts_last_block():
    """kvtier announces whole chunks and a prompt's tail (its blocks after them): it serves every block it
    announced, to the last whole block before the prompt's last token."""
    router = make()  # block 16
    hold(router, "e1", DOC[:40 * BS], medium="CPU", locality="LOCAL")  # 2 chunks of 256 and a tail of 8 blocks
    decision = next(d for d in router.decide(Prompt(DOC + [1])) if d.engine == "e1")
    assert decision.predicted_cached == 40 * BS
    assert decision.load_s == pytest.approx(640 / router.config.costs.host_tokens_per_s)
    decision = next(d for d in router.decide(Prompt(DOC[:600])) if d.engine == "e1")
    assert decision.predicted_cached == 592  # the last whole block before the prompt's last token


def test_requests_not_streamed_count_as_decoding_once_their_prefill_is_over():
    router = make(engines=("e0",))
    decision = router.decide(Prompt([1] * 4))[0]
    router.started(decision, [])
    state = router.engines["e0"]
    queued, decoding = state.load(time.monotonic() + 60)
    assert (queued, decoding) == (0.0, 1)


def test_one_odd_sample_moves_a_calibration_by_a_bounded_step():
    router = make(engines=("e0",))
    state = router.engines["e0"]
    for _ in range(3):
        state.calibrate_prefill(1e-3)
    state.calibrate_prefill(1e-9)  # e.g. an answer that computed nothing it was predicted to
    assert state.prefill_s_per_token == pytest.approx(1e-3)
    state.calibrate_prefill(48e-3)  # a whole answer timed as its first byte
    assert state.prefill_s_per_token == pytest.approx(1e-3)


@pytest.mark.parametrize("order", [(48, 1, 1), (1, 48, 1)])
def test_an_absurd_first_sample_neither_calibrates_an_engine_nor_the_fleet(order):
    """One request whose whole answer was timed as a first byte (48x its prefill) raised every engine's estimate
    48x: the first sample was taken as it came, and engines not yet calibrated take the fleet's mean."""
    router = make(prefill_tokens_per_s=500)  # 2 ms a token configured; the engines really take 1 ms
    e0, e1 = router.engines["e0"], router.engines["e1"]
    router.engines["e0"].calibrate_prefill(order[0] * 1e-3)
    assert not e0.calibrated and router.prefill_rate(e0) == router.prefill_rate(e1) == pytest.approx(2e-3)
    for factor in order[1:]:
        e0.calibrate_prefill(factor * 1e-3)
    assert router.prefill_rate(e0) == router.prefill_rate(e1) == pytest.approx(1e-3)


def test_a_calibration_follows_a_real_change_within_a_few_samples():
    router = make(engines=("e0",))
    state = router.engines["e0"]
    for _ in range(3):
        state.calibrate_prefill(1e-3)
    for _ in range(8):  # the engine got four times slower (a noisy neighbour)
        state.calibrate_prefill(4e-3)
    assert state.prefill_s_per_token > 3e-3


def test_a_ttft_that_included_a_kvtier_load_calibrates_nothing():
    router = make(engines=("e0",))
    hold(router, "e0", DOC, medium="STORAGE", locality="REMOTE")
    state = router.engines["e0"]
    before = (state.prefill_s_per_token, state.base_s, state.decode_s)
    prompt = Prompt(DOC + [1] * 40)
    decision = router.decide(prompt)[0]
    assert decision.load_s > 0
    router.first_byte("e0", router.started(decision, router.keys(prompt)), ttft_s=5.0)
    assert (state.prefill_s_per_token, state.base_s, state.decode_s) == before


def test_between_near_equals_the_shorter_queue_wins():
    router = make()
    hold(router, "e0", DOC)
    hold(router, "e1", DOC)
    router.engines["e0"].prefill_s_per_token = 0.9e-3  # calibrated a little faster
    router.engines["e0"].calibrated = router.engines["e1"].calibrated = True
    busy = router.decide(Prompt(DOC + [1]))[0]
    assert busy.engine == "e0"
    router.started(busy, [])  # one request already there
    assert router.decide(Prompt(DOC + [2]))[0].engine == "e1"


def test_a_burst_between_engines_computing_the_same_goes_by_their_queues_not_by_their_decoding_requests():
    """Both hold the prefix; e1 has two requests decoding, each predicted to add 0.4 s to a new one's wait. A
    burst of four does not all go to e0 by that prediction (measured: a burst of four on one engine, three of
    them answered in 630 ms): e1, with nothing queued before a new prefill, is a near equal, and the engines take
    the burst by their requests waiting for a first token: two each."""
    router = make()
    hold(router, "e0", DOC)
    hold(router, "e1", DOC)
    router.engines["e1"].decode_s = 0.4
    decoding(router, "e1", 2, tag=5)
    for i in range(4):  # 1,000 tokens of their own: 1 s of prefill each, waiting whatever pause the test has
        prompt = Prompt(DOC + list(range(10_000 + 2000 * i, 11_000 + 2000 * i)))
        decision = router.decide(prompt)[0]
        assert decision.uncached == 1000 and decision.reason == "prefix"
        router.started(decision, router.keys(prompt))
    assert {n: len(e.flights) for n, e in router.engines.items()} == {"e0": 2, "e1": 4}


def test_requests_arriving_together_are_split_by_the_requests_waiting_not_only_by_those_in_flight():
    """Requests prefilled together on one engine decode in step and end together, and their client's next ones
    arrive together. Measured under one hot prefix: routed by requests in flight alone, each such group went whole
    to the engine it had left (one request left there, four on the other) and was prefilled there in one step
    again (three first tokens at the same millisecond). Requests waiting for their first token come first: the
    group of three is split two and one."""
    router = make()
    hold(router, "e0", DOC)
    hold(router, "e1", DOC)
    router.engines["e0"].decode_s = router.engines["e1"].decode_s = 0.4
    decoding(router, "e0", 1, tag=3)
    decoding(router, "e1", 4, tag=3)
    sent = []
    for i in range(3):  # 1,000 tokens of their own: 1 s of prefill each, waiting whatever pause the test has
        prompt = Prompt(DOC + list(range(10_000 + 2000 * i, 11_000 + 2000 * i)))
        decision = router.decide(prompt)[0]
        router.started(decision, router.keys(prompt))
        sent.append(decision.engine)
    assert sent == ["e0", "e1", "e0"]


def test_an_engine_with_fewer_requests_but_a_long_prefill_queued_is_not_a_near_equal():
    router = make()
    hold(router, "e0", DOC)
    hold(router, "e1", DOC)
    cold = Prompt(list(range(50_000, 53_000)))  # 3 s of prefill queued on e1
    router.started(router.decide(cold, names=["e1"])[0], router.keys(cold))
    decoding(router, "e0", 2, tag=7)
    assert router.decide(Prompt(DOC + list(range(128))))[0].engine == "e0"


def test_a_slower_engine_with_fewer_requests_is_no_near_equal_for_a_prompt_none_holds():
    """Every engine would compute all of a cold prompt; the one 4x faster (its weight) has a request decoding, the
    slow one none. Queues decide only between engines whose predictions, decoding aside, are near: the fast one."""
    router = make()
    router.engines["e0"].weight = 4.0
    router.engines["e0"].prefill_s_per_token /= 4
    router.engines["e0"].calibrated = router.engines["e1"].calibrated = True
    warm = Prompt(list(range(9_000, 9_100)))
    router.engines["e0"].flights[router.started(router.decide(warm, names=["e0"])[0], [])].answering = True
    decision = router.decide(Prompt(list(range(20_000, 24_000))))[0]
    assert (decision.engine, decision.reason) == ("e0", "no_prefix")


def test_between_near_equals_requests_in_flight_count_over_the_engines_weights():
    """e0 (weight 4) has two requests decoding, e1 (weight 1) one: e0 is the less busy for its size."""
    router = make()
    hold(router, "e0", DOC)
    hold(router, "e1", DOC)
    router.engines["e0"].weight = 4.0
    router.engines["e0"].calibrated = router.engines["e1"].calibrated = True
    decoding(router, "e0", 2, tag=8)
    decoding(router, "e1", 1, tag=8)
    assert router.decide(Prompt(DOC + [1]))[0].engine == "e0"


def test_the_best_engines_decoding_requests_widen_no_near_tie_for_an_engine_computing_more():
    """e0 holds the whole prompt but has eight requests decoding; e1 lacks 208 of its tokens and has six decoding
    at a calibrated 0.3 s each. Without their decoding e0 computes one token, e1 209: e1 is no near equal, however
    far e0's decoding requests put its own prediction."""
    router = make()
    hold(router, "e0", DOC)
    hold(router, "e1", DOC[:len(DOC) - 208])
    router.engines["e0"].decode_s, router.engines["e1"].decode_s = 0.1, 0.3
    decoding(router, "e0", 8, tag=6)
    decoding(router, "e1", 6, tag=6)
    assert router.decide(Prompt(DOC + [1]))[0].engine == "e0"


def test_balance_never_moves_a_request_past_four_times_the_best_prediction():
    """e0 is the best (eight requests decoding, cheaply); e1, a near equal with fewer requests, goes first; e2,
    idle but without the prefix, is within 4x of e1 and yet 5.5x the best: balance leaves the request where it is."""
    router = make(engines=("e0", "e1", "e2"))
    hold(router, "e0", DOC)
    hold(router, "e1", DOC)
    router.engines["e1"].decode_s = 0.1
    decoding(router, "e0", 8, tag=3)
    decoding(router, "e1", 5, tag=3)
    decision = router.decide(Prompt(DOC + list(range(128))))[0]
    assert (decision.engine, decision.reason) == ("e1", "prefix")


def test_decoding_requests_far_slower_on_one_engine_still_count():
    """e1 has fewer requests in flight, but each of its three decoding requests is calibrated to add a second to
    a new one's wait: predicted over 4x slower than e0, it is no near equal."""
    router = make()
    hold(router, "e0", DOC)
    hold(router, "e1", DOC)
    router.engines["e1"].decode_s = 1.0
    decoding(router, "e0", 4, tag=9)
    decoding(router, "e1", 3, tag=9)
    assert router.decide(Prompt(DOC + list(range(128))))[0].engine == "e0"


def test_a_second_request_on_a_reserved_prefix_keeps_it_reserved_when_the_first_fails():
    router = make(engines=("e0",))
    first, second = Prompt(DOC + [1]), Prompt(DOC + [2])
    f1 = router.started(router.decide(first)[0], router.keys(first))
    d2 = router.decide(second)[0]
    assert d2.match.engine == 64  # the first request's reservation
    router.started(d2, router.keys(second))
    router.finished("e0", f1, computed=False)
    assert router.decide(Prompt(DOC + [3]))[0].match.engine == 64  # the second still computes them


@pytest.mark.parametrize("endpoint, field", [
    ({"kv_events": "tcp://*:5557"}, "engines[0].kv_events"),
    ({"kv_events": "tcp://10.0.0.1:5557", "kv_events_replay": "tcp://0.0.0.0:5558"}, "engines[0].kv_events_replay"),
    ({"kv_events": "tcp://10.0.0.1"}, "engines[0].kv_events"),
])
def test_endpoints_the_router_cannot_connect_to_are_refused(endpoint, field):
    with pytest.raises(ConfigError, match="^" + re.escape(field)):
        load_router_config({"tokenizer": "/m", "engines": [{"name": "a", "url": "http://127.0.0.1:1", **endpoint}]})
    load_router_config({"tokenizer": "/m", "engines": [{"name": "a", "url": "http://127.0.0.1:1",
                                                        "kv_events": "tcp://127.0.0.1:5557", "kv_events_bind": True}]})


def test_a_prompt_vllm_reads_nothing_of_from_its_cache_is_predicted_to_compute_every_token():
    router = make(engines=("e0",))
    hold(router, "e0", DOC)
    assert router.decide(Prompt(DOC + [1]))[0].predicted_cached == 64 * BS
    logprobs = Prompt(DOC + [1], uncached=Uncached.PROMPT_LOGPROBS)
    decision = router.decide(logprobs, keys=router.keys(logprobs))[0]
    assert (decision.predicted_cached, decision.uncached, decision.match.blocks) == (0, len(DOC) + 1, 0)
    assert decision.reason == "no_prefix"


def test_an_uncached_prompts_blocks_are_reserved_only_when_its_tokens_are_the_engines():
    """prompt_logprobs: vLLM computes every token and still stores the blocks (the next request finds them);
    media parts: the router's tokens are the text's alone, so nothing is reserved under them."""
    for reason, reserved in ((Uncached.PROMPT_LOGPROBS, 64), (Uncached.CONTENT_PARTS, 0),
                             (Uncached.TRUNCATED_TO_LIMIT, 0)):
        router = make(engines=("e0",))
        prompt = Prompt(DOC + [1], uncached=reason)
        keys = router.keys(prompt)
        router.started(router.decide(prompt, keys=keys)[0], keys)
        assert router.decide(Prompt(DOC + [2]))[0].match.engine == reserved, reason


def test_load_signals_follow_the_routers_accounting():
    """What an autoscaler reads (kvtier_router_queued_*, _in_flight_tokens, _predicted_ttft_now_seconds): a request
    whose predicted prefill is not done is queued; answering, it is in flight only; finished, it is gone."""
    router = make()
    idle = router.signals("e0")
    assert (idle.queued, idle.queued_tokens, idle.in_flight, idle.in_flight_tokens) == (0, 0, 0, 0)
    assert idle.ttft_s == pytest.approx(BS / 1000)  # one block's prefill, nothing ahead
    decision = router.decide(Prompt(DOC[:2000 // BS * BS]), names=["e0"])[0]
    flight = router.started(decision, router.keys(Prompt(DOC[:2000 // BS * BS])))
    busy = router.signals("e0")
    assert (busy.queued, busy.queued_tokens, busy.in_flight, busy.in_flight_tokens) == \
        (1, decision.uncached, 1, decision.uncached)
    assert busy.ttft_s > decision.uncached / 1000 * 0.9  # behind that prefill (less the time since it started)
    router.first_byte("e0", flight, 0.5)
    answering = router.signals("e0")
    assert (answering.queued, answering.queued_tokens, answering.in_flight) == (0, 0, 1)
    assert answering.ttft_s == pytest.approx(router.engines["e0"].decode_s + router.engines["e0"].base_s
                                             + BS * router.prefill_rate(router.engines["e0"]))
    router.finished("e0", flight)
    assert router.signals("e0").in_flight == 0 and router.signals("e1") == idle


def test_a_burst_stays_queued_until_the_engine_has_prefilled_it_one_after_another():
    router = make()
    prompt = Prompt(DOC[:100])
    flights = [router.started(router.decide(prompt, names=["e0"])[0], []) for _ in range(20)]
    for flight in router.engines["e0"].flights.values():
        flight.started -= 0.35  # sent 0.35 s ago: three prefills of 0.1 s done, seventeen to go
    busy = router.signals("e0")
    assert router.engines["e0"].flights[flights[0]].prefill_s == pytest.approx(0.1)
    assert busy.queued == 17 and busy.queued_tokens == 1700 and busy.ttft_s > 1.6


def test_a_new_weight_or_role_keeps_the_engines_state_and_requests():
    router = make()
    engine = router.engines["e0"]
    flight = router.started(router.decide(Prompt(DOC[:100]), names=["e0"])[0], [])
    before = engine.prefill_s_per_token
    router.reconfigure(dataclasses.replace(router.config.engines[0], weight=2.0, role="prefill"))
    assert router.engines["e0"] is engine and flight in engine.flights
    assert engine.prefill_s_per_token == pytest.approx(before / 2) and engine.role == "prefill"
    assert router.disaggregated


def test_a_hot_prefix_spreads_once_its_holder_has_more_requests_in_flight_than_balance_requests_allows():
    """A cached prefix makes its holder the cheapest by far; without the balance rule every request would go
    there while its queue stayed short in the model (8 in flight at most). Here the holder takes requests until it
    has 3 more in flight than the idle engine (balance_requests 2), which then serves (and computes the prefix)."""
    router = make()
    hold(router, "e0", DOC)
    decisions = []
    for i in range(4):  # each with 8 blocks of its own: queued on e0, 0.13 s each; all of it on e1, 1.15 s
        prompt = Prompt(DOC + [i] * 8 * BS)
        d = router.decide(prompt)[0]
        router.started(d, router.keys(prompt))
        decisions.append((d.engine, d.reason))
    assert decisions == [("e0", "prefix")] * 3 + [("e1", "balance")]
    off = make()
    off.config = dataclasses.replace(off.config, balance_requests=None)
    hold(off, "e0", DOC)
    for i in range(6):
        d = off.decide(Prompt(DOC + [i] * 8 * BS))[0]
        off.started(d, [])
        assert d.engine == "e0"


def test_queued_requests_are_predicted_to_prefill_one_after_another():
    router = make(engines=("e0",))
    for _ in range(3):  # three 1,024-token prompts at once: 1.024 s each at 1,000 tokens/s
        router.started(router.decide(Prompt(DOC))[0], [])
    first = min(f.started for f in router.engines["e0"].flights.values())
    queued, decoding = router.engines["e0"].load(first + 1.5)
    # the first is done; the other two end at 2.048 and 3.072 s (their own times alone would say all three ended)
    assert queued == pytest.approx(1.572) and decoding == 1


def test_a_prefix_hit_that_computes_one_block_calibrates_the_fixed_cost_not_the_per_token_rate():
    router = make(engines=("e0",))
    hold(router, "e0", DOC)
    state = router.engines["e0"]
    rate = state.prefill_s_per_token
    for i in range(5):
        d = router.decide(Prompt(DOC + list(range(5000 + i * BS, 5000 + (i + 1) * BS))))[0]
        assert d.uncached == BS
        router.first_byte("e0", router.started(d, []), 0.07)
        router.finished("e0", next(iter(state.flights)))
    assert state.prefill_s_per_token == rate and state.base_s > 0.002  # (a bounded step at a time)


def test_balance_requests_never_sends_a_request_where_it_would_cost_far_more_and_counts_weights():
    router = make()
    long_doc = list(range(20_000, 20_000 + 512 * BS))  # 8,192 tokens, cached on e0
    hold(router, "e0", long_doc)
    for i in range(4):  # e0 busier by 4, on this document (each computing one token): a hot prefix by count
        prompt = Prompt(long_doc + [i])
        router.started(router.decide(prompt, names=["e0"])[0], router.keys(prompt))
    d = router.decide(Prompt(long_doc + [1]))[0]
    assert (d.engine, d.reason) == ("e0", "prefix")  # recomputing 8K tokens on e1 would cost over 4x more
    weighted = make(engines=("fast", "slow"))
    weighted.config = dataclasses.replace(weighted.config, engines=weighted.config.engines)
    weighted.engines["fast"].weight = 4.0
    weighted.engines["fast"].prefill_s_per_token /= 4
    counts = Counter()
    for i in range(20):
        d = weighted.decide(Prompt(list(range(i * 1000, i * 1000 + 32 * BS))))[0]
        weighted.started(d, [])
        counts[d.engine] += 1
    assert counts["fast"] >= 14, counts  # (unweighted counts would have split them 11 / 9)


def test_a_busy_holder_keeps_a_prompt_when_its_requests_in_flight_are_for_other_prefixes():
    """e0 holds the document and has three requests decoding, on another document; e1 is idle. Balance is for a
    hot prefix: e0's requests do not share this one's, so it stays where it is cached (moved, it would be computed
    again, and its second copy would push another document out of e1's cache)."""
    router = make()
    hold(router, "e0", DOC)
    router.engines["e0"].decode_s = 0.1  # e1's 1 s within balance's bound: 4x e0's prediction
    other = [t + 5000 for t in DOC]
    for i in range(3):
        prompt = Prompt(other + [i])
        flight = router.engines["e0"].flights[router.started(router.decide(prompt, names=["e0"])[0], [])]
        flight.answering, flight.keys = True, router.keys(prompt)
    decision = router.decide(Prompt(DOC + [1]))[0]
    assert (decision.engine, decision.reason) == ("e0", "prefix")
    decoding(router, "e0", 1, tag=9)  # four in flight, one on this document: still not a hot prefix
    assert router.decide(Prompt(DOC + [2]))[0].engine == "e0"
    decoding(router, "e0", 2, tag=10)  # three more than e1 on this document: it spreads
    decision = router.decide(Prompt(DOC + [3]))[0]
    assert (decision.engine, decision.reason) == ("e1", "balance")


def test_prompts_no_engine_holds_go_to_near_equals_in_turns():
    """New documents spread evenly over the engines' caches. By queue they did not: each new one went to the engine
    with fewer requests in flight (here e1, while e0 has three decoding), and a run's twelve new documents went
    eight to one engine and four to the other."""
    router = make()
    decoding(router, "e0", 3, tag=11)
    sent = []
    for i in range(4):
        prompt = Prompt(list(range(30_000 + 1000 * i, 30_064 + 1000 * i)))  # four blocks, a near tie anywhere
        decision = router.decide(prompt)[0]
        router.engines[decision.engine].flights[router.started(decision, router.keys(prompt))].answering = True
        sent.append((decision.engine, decision.reason))
    assert Counter(sent) == {("e0", "no_prefix"): 2, ("e1", "no_prefix"): 2}


def test_prompts_no_engine_holds_take_turns_among_the_near_equals_only_and_by_weight():
    """e2 has 3 s of prefill queued (no near equal): six new prompts go three to e0 and three to e1 (turns over the
    fleet's list had given e1 the turn that fell on e2, 4:2). With e0 of weight 2, it takes two for each of e1's."""
    for weight, expected in ((1.0, {"e0": 3, "e1": 3}), (2.0, {"e0": 4, "e1": 2})):
        router = make(engines=("e0", "e1", "e2"))
        router.engines["e0"].weight = weight
        queued = Prompt(list(range(50_000, 53_000)))
        router.started(router.decide(queued, names=["e2"])[0], [])
        sent = Counter()
        for i in range(6):
            prompt = Prompt(list(range(30_000 + 1000 * i, 30_064 + 1000 * i)))
            decision = router.decide(prompt)[0]
            router.engines[decision.engine].flights[router.started(decision, router.keys(prompt))].answering = True
            sent[decision.engine] += 1
        assert sent == expected, weight


def test_an_engine_admitted_with_its_decoding_set_aside_earns_nothing_for_holding_one_block_more():
    """Both hold the document, e0 one block more of this prompt, but e0 has four requests decoding at 0.4 s
    each: predicted 3.7x e1, a near equal only with its decoding set aside. Computing 16 tokens fewer there does
    not outrank its queue: e1 (by tokens to compute first, e0 took it, 0.4 s later)."""
    router = make()
    extra = list(range(7000, 7000 + BS))
    hold(router, "e0", DOC + extra)
    hold(router, "e1", DOC)
    router.engines["e0"].decode_s = router.engines["e1"].decode_s = 0.1
    decoding(router, "e0", 4, tag=12)
    decision = router.decide(Prompt(DOC + extra + list(range(8000, 8128))))[0]
    assert decision.engine == "e1"


def test_a_holder_behind_a_queue_keeps_its_prompt_against_an_idle_engine_predicted_as_fast():
    """e0 holds the document and has 1 s of another prompt's prefill queued; idle e1 would compute the document's
    1,025 tokens in as long: a near tie. The holder keeps it (the fleet computes it once, and no second copy
    pushes another document out of e1's cache); by requests in flight it went to e1, a few times a run under
    prefix_repetition. A prefix only reserved on e0 (still being computed there) is another matter: the burst
    test above."""
    router = make()
    hold(router, "e0", DOC)
    queued = Prompt(list(range(60_000, 61_000)))
    router.started(router.decide(queued, names=["e0"])[0], [])
    decision = router.decide(Prompt(DOC + [1]))[0]
    assert (decision.engine, decision.reason) == ("e0", "prefix")
