"""Disaggregated prefill and decode in the router, without engines: roles in the config, the P/D plan, the bodies of
the two hops, what a prefill answer must carry, and the prefill hop's retries and fallback against engines faked
with aiohttp (the faults real engines cannot produce on demand: an answer without params, a 500, a hang)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence

import pytest
from aiohttp import web

from kvtier import pd as wire
from kvtier.errors import ConfigError
from kvtier.router.config import RouterConfig, load_router_config
from kvtier.router.engines import Engines
from kvtier.router.handoff import Prefills, bodies, promise_of
from kvtier.router.index import PrefixIndex
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import Router
from kvtier.router.prompts import Prompt, Uncached
from kvtier.router.reading import _parse

BS = 16
DOC = list(range(1000, 1000 + 64 * BS))  # 1,024 tokens


def config(roles: Sequence[str], **pd: object) -> dict:
    return {"tokenizer": "/unused", "block_size": BS,
            "engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{8100 + i}", "role": role}
                        for i, role in enumerate(roles)],
            "costs": {"prefill_tokens_per_s": 1000, "shared_tokens_per_s": 20000},
            "pd": {"local_tokens": 256, **pd}}


def make(roles: Sequence[str] = ("prefill", "decode", "decode"), **pd: object) -> Router:
    router = Router(load_router_config(config(roles, **pd)), PrefixIndex(BS))
    for state in router.engines.values():
        state.healthy = True
    return router


def test_roles_are_checked_with_the_field_named() -> None:
    with pytest.raises(ConfigError, match=r"engines\[0\]\.role: expected one of 'both', 'prefill', 'decode'"):
        load_router_config(config(["prefiller"]))
    with pytest.raises(ConfigError, match="every engine has role prefill"):
        load_router_config(config(["prefill", "prefill"]))
    with pytest.raises(ConfigError, match="policy: engines with role prefill need policy cache_aware"):
        load_router_config({**config(["prefill", "decode"]), "policy": "round_robin"})
    with pytest.raises(ConfigError, match=r"pd\.wait_s: must be in \[0, 60\]"):
        load_router_config(config(["prefill", "decode"], wait_s=-1))
    with pytest.raises(ConfigError, match=r"pd\.local_tokens"):
        load_router_config(config(["prefill", "decode"], local_tokens="many"))
    assert load_router_config(config(["both", "decode"])).engines[1].role == "decode"


def test_a_long_prompt_is_prefilled_and_a_short_one_served_whole() -> None:
    router = make()
    plan = router.plan(Prompt(DOC))
    assert [d.engine for d in plan.prefill] == ["e0"]  # only prefill engines prefill
    assert {d.engine for d in plan.serve} == {"e1", "e2"} and plan.serve[0].reason == "pd"
    # the decode engine is predicted to find every block before the last token (loaded from the shared tier)
    assert plan.serve[0].predicted_cached == (len(DOC) - 1) // BS * BS
    short = router.plan(Prompt(DOC[:200]))
    assert not short.prefill and short.serve[0].engine in ("e1", "e2") and short.serve[0].reason != "pd"


def test_a_follow_up_stays_on_the_decode_engine_holding_its_prefix() -> None:
    from tests.router.test_policy import hold
    router = make()
    hold(router, "e2", DOC)
    plan = router.plan(Prompt(DOC + list(range(50))))
    assert not plan.prefill and plan.serve[0].engine == "e2"


def test_a_short_prompt_served_whole_goes_where_the_policy_put_it_first() -> None:
    """Both decode engines hold the prefix; e2 has two requests decoding, each predicted to add 0.4 s, e1 three
    requests queued behind short prefills. The policy puts e2 first (fewer requests in flight, nothing queued:
    a near equal), and the plan serves it there, not on the engine predicted fastest by the decoding cost."""
    from tests.router.test_policy import decoding, hold
    router = make()
    for name in ("e1", "e2"):
        hold(router, name, DOC)
    router.engines["e2"].decode_s = 0.4
    decoding(router, "e2", 2, tag=5)
    for i in range(3):
        prompt = Prompt(DOC + list(range(3000 + 100 * i, 3064 + 100 * i)))
        router.started(router.decide(prompt, names=["e1"])[0], router.keys(prompt))
    prompt = Prompt(DOC + list(range(64)))
    first = router.decide(prompt, names=router.answering())[0]
    plan = router.plan(prompt)
    assert first.engine == "e2" and first.predicted_s > router.decide(prompt, names=["e1"])[0].predicted_s
    assert not plan.prefill and plan.serve[0].engine == "e2"


def test_a_prompt_served_whole_is_not_moved_to_a_busier_holder_predicted_far_slower() -> None:
    """e1 lacks the prompt's last 128 tokens and is idle; e2 holds them all but has three requests decoding at
    0.15 s each. Both compute fewer than local_tokens: the plan serves where the policy put it, e1, not on e2 for
    the 128 tokens it would not compute."""
    from tests.router.test_policy import decoding, hold
    router = make()
    hold(router, "e1", DOC[:-128])
    hold(router, "e2", DOC)
    router.engines["e2"].decode_s = 0.15
    decoding(router, "e2", 3, tag=4)
    prompt = Prompt(DOC + [1])
    assert router.decide(prompt, names=router.answering())[0].engine == "e1"
    plan = router.plan(prompt)
    assert not plan.prefill and plan.serve[0].engine == "e1"


def test_a_prompt_served_whole_on_another_engine_than_the_policys_first_is_labelled_by_its_own_blocks() -> None:
    """The policy puts idle e1 first (e2, which holds the prompt, has three requests decoding: reason balance),
    but e1 would compute the whole prompt, past local_tokens; e2 holds it and is predicted the fastest: served whole
    there, labelled prefix (not balance, the first's reason)."""
    from tests.router.test_policy import decoding, hold
    router = make()
    hold(router, "e2", DOC)
    router.engines["e2"].decode_s = 0.1  # e1 (computing 1 s) within balance's 4x bound of e2's prediction
    decoding(router, "e2", 3)
    prompt = Prompt(DOC + [1])
    first = router.decide(prompt, names=router.answering())[0]
    assert (first.engine, first.reason) == ("e1", "balance")
    plan = router.plan(prompt)
    assert not plan.prefill and (plan.serve[0].engine, plan.serve[0].reason) == ("e2", "prefix")


def test_no_healthy_prefill_engine_serves_whole_and_a_prefill_engine_never_answers() -> None:
    router = make()
    router.engines["e0"].healthy = False
    plan = router.plan(Prompt(DOC))
    assert not plan.prefill and plan.serve[0].engine in ("e1", "e2")
    router.engines["e1"].healthy = router.engines["e2"].healthy = False
    router.engines["e0"].healthy = True
    assert router.plan(Prompt(DOC)).serve == []  # a prefill engine alone answers no client


def test_a_burst_sharing_a_new_prefix_goes_to_one_prefill_engine() -> None:
    router = make(("prefill", "prefill", "decode"))
    keys = router.keys(Prompt(DOC + [1]))
    first = router.plan(Prompt(DOC + [1]), keys=keys)
    router.started(first.prefill[0], keys)  # its blocks are reserved on its prefill engine
    second = router.plan(Prompt(DOC + [2]))
    assert second.prefill[0].engine == first.prefill[0].engine


def test_the_bodies_of_the_two_hops() -> None:
    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 50,
            "min_tokens": 5, "echo": True, "logprobs": 5, "n": 3}
    pd = bodies(json.dumps(body).encode())
    assert pd is not None
    prefill = json.loads(pd.prefill)
    assert prefill == {"model": "m", "prompt": "p", "stream": False, "max_tokens": 1,
                       "kv_transfer_params": {"kvtier": {"pd": "prefill"}}}
    promise = wire.Stored(512, "ab", "cd")
    decode = json.loads(pd.decode(promise, 2.5))
    assert decode == {**body, "kv_transfer_params": {"kvtier": {
        "pd": "decode", "tokens": 512, "namespace": "ab", "key": "cd", "wait_s": 2.5}}}
    assert wire.read_request(decode["kv_transfer_params"]) == ("decode", promise, 2.5)  # what the connector reads
    # a client's text holding what looks like the slot changes nothing
    tricky = {"prompt": 'kvtier-slot-"x"'}
    assert json.loads(bodies(json.dumps(tricky).encode()).decode(promise, 1))["prompt"] == tricky["prompt"]  # type: ignore[union-attr]
    assert bodies(json.dumps({"prompt": "p", "use_beam_search": True}).encode()) is None
    chat = json.loads(bodies(json.dumps({"messages": [], "max_completion_tokens": 9}).encode()).prefill)  # type: ignore[union-attr]
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1


def test_a_clients_own_kv_transfer_params_never_reach_an_engine() -> None:
    for params in ({"kvtier": {"pd": "decode", "wait_s": 60}}, {"prompt_token_ids": [1, 2]},
                   {"do_remote_prefill": True, "remote_prefill_cached_tokens": 99}):
        body, sent = _parse(json.dumps({"prompt": "p", "kv_transfer_params": params}).encode())
        assert "kv_transfer_params" not in json.loads(sent) and "kv_transfer_params" not in body


@pytest.mark.parametrize("answer, expected", [
    ({"kv_transfer_params": {"kvtier": {"pd": "stored", "tokens": 256, "namespace": "ab", "key": "cd"}}},
     wire.Stored(256, "ab", "cd")),
    ({"kv_transfer_params": {"kvtier": {"pd": "none"}}}, None),
])
def test_what_a_prefill_answer_says(answer: object, expected: object) -> None:
    assert promise_of(json.dumps(answer).encode()) == expected


@pytest.mark.parametrize("answer", [
    {"kv_transfer_params": None},
    {"kv_transfer_params": {"kvtier": {"pd": "stored", "tokens": -1, "namespace": "ab", "key": "cd"}}},
    {"kv_transfer_params": {"kvtier": {"pd": "stored", "tokens": True, "namespace": "ab", "key": "cd"}}},
    {"kv_transfer_params": {"kvtier": {"pd": "stored", "tokens": 1, "namespace": "a" * 129, "key": "cd"}}},
    {"kv_transfer_params": {"kvtier": {"pd": "stored", "tokens": 1, "namespace": "AB", "key": "cd"}}},
    {"kv_transfer_params": {"kvtier": {"pd": "decode"}}},
    [1, 2],
])
def test_a_prefill_answer_the_decode_engine_would_refuse_is_refused_here(answer: object) -> None:
    with pytest.raises(wire.BadParams):
        promise_of(json.dumps(answer).encode())
    with pytest.raises(wire.BadParams):
        promise_of(b"{not json")


class FakeEngines:
    """Prefill engines faked with aiohttp on loopback, each answering as ``behaviour`` says."""

    def __init__(self, behaviours: dict[str, str]) -> None:
        self.behaviours = behaviours
        self.seen: dict[str, int] = dict.fromkeys(behaviours, 0)
        self.runners: list[web.AppRunner] = []
        self.urls: dict[str, str] = {}

    async def start(self) -> None:
        for name, behaviour in self.behaviours.items():
            async def handle(request: web.Request, name: str = name, behaviour: str = behaviour) -> web.Response:
                self.seen[name] += 1
                body = await request.json()
                assert body["kv_transfer_params"]["kvtier"] == {"pd": "prefill"} and body["max_tokens"] == 1
                if behaviour in ("500", "400"):
                    return web.Response(status=int(behaviour))
                if behaviour == "hang":
                    await asyncio.sleep(2)
                if behaviour == "slow":
                    await asyncio.sleep(0.25)
                if behaviour == "no_params":
                    return web.json_response({"choices": []})
                if behaviour == "huge":
                    return web.Response(body=b" " * (2 << 20))
                return web.json_response({"kv_transfer_params": {"kvtier": {
                    "pd": "stored", "tokens": 512, "namespace": "ab", "key": name.encode().hex()}}})
            app = web.Application()
            app.router.add_post("/v1/completions", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.urls[name] = f"http://127.0.0.1:{port}"
            self.runners.append(runner)

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


def against(cfg: RouterConfig, fakes: FakeEngines) -> tuple[Router, RouterMetrics, Engines]:
    """A router for ``cfg`` whose engines (all healthy) are the fakes."""
    router = Router(cfg, PrefixIndex(BS))
    for state in router.engines.values():
        state.healthy = True
    metrics = RouterMetrics()
    engines = Engines(cfg, metrics, router.index, router)
    engines.urls.update(fakes.urls)
    return router, metrics, engines


def run_hop(behaviours: dict[str, str], retries: int = 1, timeout_s: float = 60) -> tuple[object, FakeEngines,
                                                                                            RouterMetrics]:
    async def go() -> tuple[object, FakeEngines, RouterMetrics]:
        fakes = FakeEngines(behaviours)
        await fakes.start()
        roles = ["prefill"] * len(behaviours) + ["decode"]
        cfg = load_router_config({**config(roles, prefill_timeout_s=timeout_s), "retries": retries})
        router, metrics, engines = against(cfg, fakes)
        try:
            plan = router.plan(Prompt(DOC))
            pd = bodies(json.dumps({"prompt": "p", "max_tokens": 9}).encode())
            assert pd is not None
            order = sorted(plan.prefill, key=lambda d: d.engine)  # e0 first
            promise = await Prefills(cfg, metrics, router, engines).run(pd, "/v1/completions", {"X-Request-Id": "r"},
                                                                         order, router.keys(Prompt(DOC)))
            assert all(not state.flights for state in router.engines.values())  # every flight accounted
            return promise, fakes, metrics
        finally:
            await engines.upstream.close()
            await fakes.stop()
    return asyncio.run(go())


def _count(metrics: RouterMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_failed_prefill_engine_is_retried_on_the_next() -> None:
    promise, fakes, metrics = run_hop({"e0": "500", "e1": "ok"})
    assert promise == wire.Stored(512, "ab", b"e1".hex())
    assert fakes.seen == {"e0": 1, "e1": 1}
    assert _count(metrics, "kvtier_router_pd_requests_total", outcome="handoff") == 1


@pytest.mark.parametrize("behaviour, cause", [("500", "http_error"), ("huge", "bad_answer"), ("hang", "timeout")])
def test_when_every_prefill_engine_fails_the_request_is_served_whole(behaviour: str, cause: str) -> None:
    promise, fakes, metrics = run_hop({"e0": behaviour, "e1": behaviour}, timeout_s=0.5)
    assert promise is None and fakes.seen == {"e0": 1, "e1": 1}
    assert _count(metrics, "kvtier_router_pd_requests_total", outcome="prefill_failed") == 1
    assert sum(_count(metrics, "kvtier_router_pd_prefill_failures_total", engine=e, cause=cause)
               for e in ("e0", "e1")) == 2


@pytest.mark.parametrize("behaviour, cause", [("400", "http_error"), ("no_params", "no_params")])
def test_what_every_prefill_engine_would_answer_alike_is_not_retried(behaviour: str, cause: str) -> None:
    """A 4xx (the request's fault) or an answer without kvtier's params (not kvtier's connector, a request it
    skips) would be the same on every prefill engine: served whole at once."""
    promise, fakes, metrics = run_hop({"e0": behaviour, "e1": "ok"})
    assert promise is None and fakes.seen == {"e0": 1, "e1": 0}
    assert _count(metrics, "kvtier_router_pd_prefill_failures_total", engine="e0", cause=cause) == 1


def test_a_prefill_waits_for_one_in_flight_computing_its_prefix_and_only_then() -> None:
    """Two prompts sharing a new 1,024-token prefix on one prefill engine: the second is sent once the first has
    answered (the engine then computes only what differs); a third, on an engine that announced the prefix
    already, is sent at once."""
    async def go() -> list[tuple[str, float]]:
        fakes = FakeEngines({"e0": "slow", "e1": "slow"})
        await fakes.start()
        router, metrics, engines = against(load_router_config(config(["prefill", "prefill", "decode"])), fakes)
        prefills = Prefills(router.config, metrics, router, engines)
        pd = bodies(b'{"prompt": "p"}')
        assert pd is not None
        ends: list[tuple[str, float]] = []
        start = asyncio.get_running_loop().time()

        async def one(tag: str, engine: str, tail: int) -> None:
            keys = router.keys(Prompt(DOC + [tail] * 40))
            decision = next(d for d in router.decide(Prompt(DOC + [tail] * 40), None, keys, [engine]))
            await prefills.run(pd, "/v1/completions", {}, [decision], keys)
            ends.append((tag, asyncio.get_running_loop().time() - start))
        try:
            from tests.router.test_policy import hold
            hold(router, "e1", DOC)  # e1 holds the prefix: no wait there
            await asyncio.gather(one("first", "e0", 1), one("second", "e0", 2), one("held", "e1", 3))
        finally:
            await engines.upstream.close()
            await fakes.stop()
        return ends
    ends = dict(asyncio.run(go()))
    # each answer takes 0.25 s: the second starts once the first has ended, the one on e1 beside the first
    assert ends["second"] - ends["first"] >= 0.25 and ends["held"] < ends["second"], ends


def test_a_follow_up_near_a_tie_stays_on_the_engine_holding_its_prefix() -> None:
    """The engine holding the prefix is busier (near a tie with an idle one, which a near tie puts first for its
    shorter queue): the request is still served whole there, not prefilled elsewhere."""
    from tests.router.test_policy import hold
    router = make()
    hold(router, "e2", DOC)
    keys = router.keys(Prompt(DOC + [7] * 20))
    busy = router.decide(Prompt(DOC + [7] * 20), None, keys, ["e2"])[0]
    router.started(dataclasses.replace(busy, uncached=900, load_s=0.0), [])  # a prefill queued on e2 (0.9 s)
    plan = router.plan(Prompt(DOC + list(range(40))))
    assert not plan.prefill and plan.serve[0].engine == "e2"


def test_a_prompt_read_from_no_cache_is_not_prefilled_elsewhere() -> None:
    router = make()
    plan = router.plan(Prompt(DOC, uncached=Uncached.PROMPT_LOGPROBS))
    assert not plan.prefill


def test_new_prompts_take_turns_between_prefill_engines() -> None:
    """Two prefill engines: six new prompts, each prefilled and done before the next, go three to each (the
    policy's other decisions for the same request, the decode engine's, take no turn from them)."""
    router = make(("prefill", "prefill", "decode"))
    sent = []
    for i in range(6):
        prompt = Prompt(list(range(30_000 + 2000 * i, 31_024 + 2000 * i)))
        keys = router.keys(prompt)
        plan = router.plan(prompt, keys=keys)
        assert plan.prefill, "a 1,024-token prompt is prefilled apart"
        prefill = plan.prefill[0]
        router.finished(prefill.engine, router.started(prefill, keys))
        sent.append(prefill.engine)
    assert sorted(sent) == ["e0"] * 3 + ["e1"] * 3, sent
