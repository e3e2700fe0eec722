"""Routers in replicas: each follows every engine's KV events, so for the same requests they decide alike; one
started late replays the engines' events before it listens (its readiness). Engines are scripted
(kvtier.testing.scripted): they cache prompts and publish their events as vLLM does."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import zmq
import zmq.asyncio

from kvtier.router.app import RouterApp
from kvtier.router.config import load_router_config
from kvtier.testing.scripted import CachingEngine, TokenIds
from kvtier.testing.servers import free_port

BS = 4


def requests(seed: int, n: int, documents: int = 8, doc_blocks: int = 12) -> list[list[int]]:
    """``n`` prompts over ``documents`` shared documents, each with a suffix of its own."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1, 50_000) for _ in range(doc_blocks * BS)] for _ in range(documents)]
    return [rng.choice(docs) + [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 3) * BS)]
            for _ in range(n)]


def replica(engines: list[CachingEngine], **overrides) -> RouterApp:
    config = load_router_config({"tokenizer": "unused", "block_size": BS, "policy": "cache_aware",
                                 "explain_headers": True, "health_interval_s": 0.5,
                                 "engines": [e.router_entry() for e in engines], **overrides})
    return RouterApp(config, tokenizer=TokenIds())


async def routed(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> str:
    async with session.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-KVTier-Engine"]


async def started(apps: list[RouterApp]) -> tuple[list[str], list]:
    urls, runners = [], []
    for app in apps:
        runners += await app.listen("127.0.0.1", 0)
        urls.append(f"http://127.0.0.1:{app.port()}")
    return urls, runners


def test_two_replicas_decide_alike_for_the_same_requests():
    async def main():
        engines = [await CachingEngine(f"e{i}", BS, seconds_per_token=0.0002).start() for i in range(3)]
        a, b = replica(engines), replica(engines)
        (url_a, url_b), runners = await started([a, b])
        same = 0
        stream = requests(1, 80)
        try:
            async with aiohttp.ClientSession() as session:
                for i, prompt in enumerate(stream):
                    first, second = (url_a, url_b) if i % 2 else (url_b, url_a)
                    same += await routed(session, first, prompt) == await routed(session, second, prompt)
        finally:
            for r in reversed(runners):
                await r.cleanup()
            for e in engines:
                await e.stop()
        assert same / len(stream) >= 0.95, same
        assert len({name for name, blocks in ((e.name, len(e.blocks)) for e in engines) if blocks}) >= 2

    asyncio.run(main())


def test_a_replica_started_late_replays_every_engines_events_before_it_listens():
    """It answers its first request knowing what the engines hold (without the replay gate, its index would be
    empty and its first decisions would scatter the documents)."""
    async def main():
        engines = [await CachingEngine(f"e{i}", BS).start() for i in range(3)]
        a = replica(engines)
        (url_a,), runners = await started([a])
        try:
            async with aiohttp.ClientSession() as session:
                stream = requests(2, 60)
                for prompt in stream[:40]:
                    await routed(session, url_a, prompt)
                await asyncio.sleep(0.3)  # (the last events reach a)
                late = replica(engines)
                (url_late,), more = await started([late])
                runners += more
                for e in engines:  # what it holds as soon as it listens
                    assert late.index.blocks(e.name) == a.index.blocks(e.name) > 0
                for prompt in stream[40:]:
                    assert await routed(session, url_late, prompt) == await routed(session, url_a, prompt)
        finally:
            for r in reversed(runners):
                await r.cleanup()
            for e in engines:
                await e.stop()

    asyncio.run(main())


def test_a_router_starting_refuses_connections_until_it_is_ready_and_then_answers_no_5xx():
    """Readiness: while a (re)started replica replays its engines' events it does not listen (a load balancer's
    connection is refused, and its probe fails), so a restart behind a Service costs no 5xx."""
    async def main():
        engines = [await CachingEngine(f"e{i}", BS).start() for i in range(2)]
        ctx = zmq.asyncio.Context()
        silent = ctx.socket(zmq.ROUTER)  # an engine's replay socket that never answers: the replay takes replay_s
        silent_port = free_port()
        silent.bind(f"tcp://127.0.0.1:{silent_port}")
        entries = [e.router_entry() for e in engines]
        entries[1]["kv_events_replay"] = f"tcp://127.0.0.1:{silent_port}"
        config = load_router_config({"tokenizer": "unused", "block_size": BS, "policy": "cache_aware",
                                     "engines": entries, "events": {"replay_s": 1.0}})
        app = RouterApp(config, tokenizer=TokenIds())
        port = free_port()
        starting = asyncio.get_running_loop().create_task(app.listen("127.0.0.1", port))
        refused = 0
        try:
            async with aiohttp.ClientSession() as session:
                while not starting.done():
                    try:
                        async with session.get(f"http://127.0.0.1:{port}/health") as r:
                            raise AssertionError(f"answered {r.status} before it was ready")
                    except aiohttp.ClientConnectorError:
                        refused += 1
                    await asyncio.sleep(0.05)
                runners = await starting
                async def status() -> int:
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                            json={"model": "m", "prompt": requests(3, 1)[0]}) as r:
                        await r.read()
                        return r.status

                statuses = await asyncio.gather(*(status() for _ in range(8)))
                async with session.get(f"http://127.0.0.1:{port}/health") as r:
                    assert r.status == 200
        finally:
            runners = await starting
            for r in reversed(runners):
                await r.cleanup()
            silent.close(0)
            ctx.term()
            for e in engines:
                await e.stop()
        assert refused >= 5 and list(statuses) == [200] * 8

    asyncio.run(main())
