"""The router's decisions when it runs in replicas, and when its fleet changes mid-run, on scripted engines.

The engines are :class:`kvtier.testing.scripted.CachingEngine`: each caches every prompt it computed, publishes its
KV events and replay buffer as vLLM does, and waits 1 ms per token it computes. What is measured is the router's
own doing (where requests go, what the engines had to compute), not an engine's speed:

- ``agreement``: two replicas, each following every engine's events, each asked for the same 200 requests (over
  12 documents of 48 tokens, alternately first): the share routed to the same engine.
- ``burst``: 24 requests that share one new document (160 tokens, 160 ms to compute), one every 20 ms, sent to
  one router, then split over two replicas (alternately): how many of them computed the document (the rest found
  it cached), on how many engines, and the burst's time. In-flight accounting is per replica: a replica does
  not see the other's requests, so a split burst may compute a new prefix once per replica.
- ``fleet change``: 150 requests, 4 at a time, through one router of two engines; a third joins after 50 (the
  config reloaded), the first leaves after 100: failed requests, and each phase's cached share.

    python benchmarks/bench_router_replicas.py [--json PATH]

About a minute. Prints a Markdown table; ``--json`` writes what it printed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import aiohttp

from kvtier.router.app import RouterApp
from kvtier.router.config import load_router_config
from kvtier.testing.scripted import CachingEngine, TokenIds

sys.path.insert(0, str(Path(__file__).parent))
from bench_store import machine

BS = 16
SECONDS_PER_TOKEN = 0.001


def router(engines: list[CachingEngine]) -> RouterApp:
    config = load_router_config({"tokenizer": "unused", "block_size": BS, "policy": "cache_aware",
                                 "explain_headers": True, "health_interval_s": 0.5,
                                 "engines": [e.router_entry() for e in engines]})
    return RouterApp(config, tokenizer=TokenIds())


async def listening(app: RouterApp) -> tuple[str, list]:
    runners = await app.listen("127.0.0.1", 0)
    return f"http://127.0.0.1:{app.port()}", runners


async def send(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[int, str]:
    async with session.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}) as r:
        await r.read()
        return r.status, r.headers.get("X-KVTier-Engine", "")


def documents(rng: random.Random, n: int, tokens: int) -> list[list[int]]:
    return [[rng.randrange(1, 50_000) for _ in range(tokens)] for _ in range(n)]


async def agreement(seed: int) -> float:
    rng = random.Random(seed)
    docs = documents(rng, 12, 3 * BS)
    engines = [await CachingEngine(f"e{i}", BS, SECONDS_PER_TOKEN).start() for i in range(3)]
    a, b = router(engines), router(engines)
    (url_a, ra), (url_b, rb) = await listening(a), await listening(b)
    same = 0
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(200):
                prompt = rng.choice(docs) + [rng.randrange(1, 50_000) for _ in range(BS)]
                first, second = (url_a, url_b) if i % 2 else (url_b, url_a)
                same += (await send(session, first, prompt))[1] == (await send(session, second, prompt))[1]
    finally:
        for r in [*ra, *rb][::-1]:
            await r.cleanup()
        for e in engines:
            await e.stop()
    return same / 200


async def burst(seed: int, replicas: int) -> dict:
    rng = random.Random(seed)
    doc = documents(rng, 1, 10 * BS)[0]
    engines = [await CachingEngine(f"e{i}", BS, SECONDS_PER_TOKEN).start() for i in range(3)]
    apps = [router(engines) for _ in range(replicas)]
    listeners = [await listening(app) for app in apps]
    try:
        async with aiohttp.ClientSession() as session:
            async def one(i: int) -> None:
                await asyncio.sleep(i * 0.02)  # one every 20 ms: the document takes 160 ms to compute
                await send(session, listeners[i % replicas][0], doc + [rng.randrange(1, 50_000) for _ in range(BS)])

            started = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(24)))
            seconds = time.monotonic() - started
    finally:
        for _, runners in listeners:
            for r in reversed(runners):
                await r.cleanup()
        for e in engines:
            await e.stop()
    computed = [(e.name, cached) for e in engines for _, cached in e.served if cached < len(doc)]
    return {"computed": len(computed), "engines_computing": len({name for name, _ in computed}),
            "seconds": seconds}


async def fleet_change(seed: int) -> dict:
    rng = random.Random(seed)
    docs = documents(rng, 8, 6 * BS)
    engines = [await CachingEngine(f"e{i}", BS, SECONDS_PER_TOKEN).start() for i in range(3)]
    app = router(engines[:2])
    url, runners = await listening(app)
    phases: list[dict] = [{"requests": 0, "failed": 0, "prompt": 0, "cached": 0} for _ in range(3)]
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(0, 150, 4):
                if i == 52:  # (the batch after the 50th request)
                    await app.reload(dataclasses.replace(app.config, engines=tuple(
                        load_router_config({"tokenizer": "u", "engines": [e.router_entry() for e in engines]}
                                           ).engines)))
                if i == 100:
                    await app.reload(dataclasses.replace(app.config, engines=app.config.engines[1:] + (
                        load_router_config({"tokenizer": "u", "engines": [engines[2].router_entry()]}).engines)))
                phase = phases[0 if i < 52 else 1 if i < 100 else 2]
                prompts = [rng.choice(docs) + [rng.randrange(1, 50_000) for _ in range(BS)] for _ in range(4)]
                before = {e.name: len(e.served) for e in engines}
                results = await asyncio.gather(*(send(session, url, p) for p in prompts))
                phase["requests"] += len(results)
                phase["failed"] += sum(status != 200 for status, _ in results)
                for e in engines:
                    for tokens, cached in e.served[before[e.name]:]:
                        phase["prompt"] += tokens
                        phase["cached"] += cached
    finally:
        for r in reversed(runners):
            await r.cleanup()
        for e in engines:
            await e.stop()
    return {name: {"requests": p["requests"], "failed": p["failed"], "cached_share": p["cached"] / p["prompt"]}
            for name, p in zip(("two engines", "a third joined", "the first left"), phases)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    seeds = (1, 2, 3)
    agreements = [asyncio.run(agreement(s)) for s in seeds]
    one = [asyncio.run(burst(s, 1)) for s in seeds]
    two = [asyncio.run(burst(s, 2)) for s in seeds]
    changes = [asyncio.run(fleet_change(s)) for s in seeds]
    rows = [
        {"name": "agreement: same engine for the same request, two replicas", "values": agreements},
        {"name": "burst of 24 on a new document: requests that computed it, one router",
         "values": [r["computed"] for r in one]},
        {"name": "the same, split over two replicas", "values": [r["computed"] for r in two]},
        {"name": "engines that computed it, one router", "values": [r["engines_computing"] for r in one]},
        {"name": "engines that computed it, two replicas", "values": [r["engines_computing"] for r in two]},
        {"name": "burst time (s), one router", "values": [r["seconds"] for r in one]},
        {"name": "burst time (s), two replicas", "values": [r["seconds"] for r in two]},
    ]
    for phase in changes[0]:
        rows.append({"name": f"fleet change, {phase}: failed requests", "values": [c[phase]["failed"]
                                                                                for c in changes]})
        rows.append({"name": f"fleet change, {phase}: cached share", "values": [c[phase]["cached_share"]
                                                                             for c in changes]})
    print(f"\nRouter replicas and fleet changes, {date.today()}, scripted engines (seeds {seeds})\n")
    print("| measure | per seed |")
    print("|---|---|")
    for row in rows:
        print(f"| {row['name']} | {' / '.join(f'{v:.3g}' for v in row['values'])} |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        args.json.write_text(json.dumps({"date": str(date.today()), "machine": machine(),
                                         "commit": commit, "seeds": list(seeds), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
