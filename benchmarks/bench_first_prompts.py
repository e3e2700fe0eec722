"""The first prompts after start, in vLLM's API server: vLLM alone against ``kvtier serve``, fresh servers in a
rotating order, every prompt unique (nothing can hit).

Each server is started as a user starts it: vLLM alone with its own defaults (``python -m
vllm.entrypoints.openai.api_server``), kvtier with the command and environment ``kvtier serve`` builds (DRAM only,
``--dram``; on 2 cores it leaves vLLM's core reservation for a connector as it is, and vLLM computes on both
cores), and kvtier serve's command on the cores vLLM alone computes on (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``): what
kvtier costs the first prompts with the model's cores the same. Once a server answers /health, ``--prompts``
unique prompts of ``--tokens`` tokens are sent at once (the same ones to every server: each starts empty; one
output token each: TTFT is the reply's time), then as many again: the first wave is the first prompts after start,
the second the same load once the server has served some. Each round runs every variant once, the order rotated;
the figures are medians over the rounds of each wave's mean TTFT as a ratio to vLLM alone's in the same round,
with their spread. Usage:

    python benchmarks/bench_first_prompts.py [--rounds 3] [--prompts 4] [--tokens 2048] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from kvtier.bench.model import prepare_model
from kvtier.bench.server import post_completion, stop, wait_healthy
from kvtier.bench.ttft import commit, machine
from kvtier.bench.workload import documents
from kvtier.cli import serve
from kvtier.fleet.run import write_private
from kvtier.testing.servers import free_port

VARIANTS = ("vLLM alone", "kvtier serve", "kvtier serve, vLLM alone's cores")


def command(variant: str, model: Path, port: int, tokens: int, work: Path) -> tuple[list[str], dict[str, str]]:
    """The variant's command line and environment."""
    vllm = ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "bfloat16",
            "--max-model-len", str(tokens + 256), "--gpu-memory-utilization", "0.3"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", serve.RESERVED)}  # each server's own defaults
    if variant == "vLLM alone":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *vllm], env
    args = argparse.Namespace(model=str(model), dram="1GiB", disk=None, redis=None, config=None, work_dir=work,
                              dry_run=False)
    plan = serve.make_plan(args, vllm)
    write_private(plan.store_file, yaml.safe_dump(plan.store, sort_keys=False))
    if variant.endswith("cores"):
        return plan.argv, {**env, serve.RESERVED: "1"}
    # kvtier serve's reservation as it sets it where the user has not (this process's own setting is not vLLM's)
    return plan.argv, {**env, **serve.reserved_cores(1, environ={})}


def wave(port: int, model: Path, prompts: list[list[int]]) -> list[float]:
    """Send ``prompts`` at once; each one's seconds to its one-token reply."""
    def one(tokens: list[int]) -> float:
        start = time.perf_counter()
        post_completion(port, {"model": str(model), "prompt": tokens, "max_tokens": 1, "temperature": 0})
        return time.perf_counter() - start

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def run_variant(variant: str, model: Path, prompts: list[list[int]], tokens: int, work: Path) -> dict:
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    argv, env = command(variant, model, port, tokens, work)
    log = work / f"server-{port}.log"
    with open(log, "w") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        start = time.perf_counter()
        wait_healthy(server, port, log)
        started = time.perf_counter() - start
        half = len(prompts) // 2
        first, second = wave(port, model, prompts[:half]), wave(port, model, prompts[half:])
    finally:
        stop(server)
    binding = [ln.strip() for ln in log.read_text().splitlines() if "core ids=" in ln or "reserved_cpus=" in ln]
    return {"start_s": started, "first_wave_s": first, "second_wave_s": second, "omp_binding": binding}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts in each wave (default 4)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens a prompt (default 2048)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    for name in ("rounds", "prompts", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: at least 1, got {getattr(args, name)}")
    from transformers import AutoTokenizer

    model = prepare_model()
    # The same prompts for every server: each starts empty (DRAM only), so none can hit, and each variant is
    # timed on the same work.
    docs = documents(AutoTokenizer.from_pretrained(model), 2 * args.prompts, args.tokens)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kvtier-first-") as tmp:
        for r in range(args.rounds):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            got = {}
            for v, variant in enumerate(order):
                got[variant] = run_variant(variant, model, docs, args.tokens, Path(tmp) / f"r{r}-{v}")
                w = got[variant]
                print(f"round {r + 1}/{args.rounds}, {variant}: up in {w['start_s']:.0f} s; first wave mean TTFT "
                      f"{statistics.fmean(w['first_wave_s']):.2f} s, second {statistics.fmean(w['second_wave_s']):.2f}"
                      f" s; {' '.join(w['omp_binding'])}", flush=True)
            rounds.append({"order": list(order), **got})
    rows = {}
    for variant in VARIANTS[1:]:
        for key in ("first_wave_s", "second_wave_s"):
            rows[f"{key.split('_')[0]} wave mean TTFT, {variant}"] = [
                statistics.fmean(r[variant][key]) / statistics.fmean(r["vLLM alone"][key]) for r in rounds]
    print(f"\n{args.prompts} unique prompts of {args.tokens} tokens at once after start, then {args.prompts} more; "
          f"ratio to vLLM alone in the same round ({args.rounds} rounds):")
    for name, values in rows.items():
        print(f"  {name}: median {statistics.median(values):.3f}, spread {min(values):.3f}-{max(values):.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": machine(),
                                         "commit": commit(), "prompts": args.prompts, "tokens": args.tokens,
                                         "rows": rows, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
