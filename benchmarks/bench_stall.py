"""Engine step time while Redis is stalled, against the same workload with Redis answering.

    python benchmarks/bench_stall.py [--runs 2] [--pause 10] [--json PATH]

One vLLM engine (CPU, in-process, SmolLM2-135M) with kvtier over a Redis tier (a server started here). Each run
serves the same workload: four requests whose prefixes the engine's DRAM holds (decoding 48 tokens each) and,
every 0.4 s, a new 1,024-token prompt that no tier holds, whose lookup has to ask Redis to learn that. In a
stalled run Redis is paused (``CLIENT PAUSE``) for ``--pause`` seconds as the run starts. Runs alternate (answering,
stalled, ...). Every engine step is timed; the figure is the p99 step time of stalled runs over answering ones
(target: within 10%). A new prompt's lookup waits at most ``lookup_timeout_seconds`` (1 s) for the paused
server, then it is computed; the steps meanwhile serve the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each kind, alternating (default 2)")
    parser.add_argument("--pause", type=float, default=10.0, help="seconds Redis is paused in a stalled run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.runs < 1 or not 1 <= args.pause <= 60:
        parser.error("--runs: at least 1; --pause: 1 to 60 seconds")

    import redis
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.bench.model import prepare_model
    from kvtier.bench.ttft import machine
    from kvtier.bench.workload import documents
    from kvtier.testing.servers import RedisServer

    model = prepare_model()
    docs = documents(AutoTokenizer.from_pretrained(model), 4, 1024)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-stall-") as tmp:
        server = RedisServer(Path(tmp) / "redis", maxmemory="1gb").start()
        try:
            store = {"chunk_tokens": 256, "dram": {"capacity_bytes": "1GiB"},
                     "tiers": [{"type": "redis", **server.tier_options(), "socket_timeout": 5}]}
            llm = LLM(model=str(model), enforce_eager=True, dtype="bfloat16", max_model_len=2048, block_size=128,
                      enable_prefix_caching=False, gpu_memory_utilization=0.3, max_num_batched_tokens=2048,
                      kv_transfer_config={"kv_connector": "KVTierConnector",
                                          "kv_connector_module_path": "kvtier.integrations.vllm",
                                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                          "kv_connector_extra_config": {"config": store}})
            engine = llm.llm_engine
            client = redis.Redis.from_url(server.url)
            warm = SamplingParams(max_tokens=1)
            llm.generate([TokensPrompt(prompt_token_ids=d) for d in docs], warm, use_tqdm=False)  # into DRAM
            decode = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
            once = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            steps: dict[str, list[float]] = {"answering": [], "stalled": []}
            runs = []
            for i in range(2 * args.runs):
                kind = "stalled" if i % 2 else "answering"
                fresh = [rng.integers(10, 40000, 1024).tolist() for _ in range(6)]
                for j, doc in enumerate(docs):
                    engine.add_request(f"{i}-dram-{j}", TokensPrompt(prompt_token_ids=doc + [13, 13]), decode)
                if kind == "stalled":
                    client.client_pause(int(args.pause * 1000))
                start = time.monotonic()
                times: list[float] = []
                next_new = 0
                while engine.has_unfinished_requests() or next_new < len(fresh):
                    if next_new < len(fresh) and time.monotonic() - start >= 0.4 * next_new:
                        engine.add_request(f"{i}-new-{next_new}", TokensPrompt(prompt_token_ids=fresh[next_new]),
                                           once)
                        next_new += 1
                    began = time.monotonic()
                    engine.step()
                    times.append(time.monotonic() - began)
                took = time.monotonic() - start
                steps[kind] += times
                runs.append({"kind": kind, "seconds": took, "steps": len(times), "p50": percentile(times, 0.5),
                             "p99": percentile(times, 0.99), "max": max(times)})
                print(f"run {i + 1}: {kind}: {len(times)} steps in {took:.1f} s, p50 "
                      f"{1000 * runs[-1]['p50']:.1f} ms, p99 {1000 * runs[-1]['p99']:.1f} ms, max "
                      f"{1000 * runs[-1]['max']:.1f} ms", file=sys.stderr, flush=True)
                if kind == "stalled":
                    time.sleep(max(0.0, args.pause - took) + 0.5)  # the next run starts with Redis answering
        finally:
            server.stop()
    p99 = {k: percentile(v, 0.99) for k, v in steps.items()}
    p50 = {k: statistics.median(v) for k, v in steps.items()}
    ratio = p99["stalled"] / p99["answering"]
    print(f"Machine: {machine()}; Redis on loopback, paused {args.pause:.0f} s in each stalled run\n")
    print("| steps | count | p50 | p99 |")
    print("|---|---|---|---|")
    for k in ("answering", "stalled"):
        print(f"| Redis {k} | {len(steps[k])} | {1000 * p50[k]:.1f} ms | {1000 * p99[k]:.1f} ms |")
    print(f"\np99 step time, stalled / answering: {ratio:.2f} (target <= 1.10)")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "pause_seconds": args.pause, "runs": runs,
                                         "p50": p50, "p99": p99, "p99_ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
