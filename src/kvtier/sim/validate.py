"""``kvtier validate``: replay a trace against the real engine with kvtier and hold the simulator to it.

The trace's requests are sent to vLLM's OpenAI server (with kvtier as its KV connector, configured from the
deployment) at their arrival times, streamed; the time to the first streamed token is the measured TTFT and
``usage.prompt_tokens_details.cached_tokens`` the measured hit. The simulator predicts the same trace on the same
deployment from a calibration (fitted on ``kvtier calibrate``'s sweeps only, never on the trace judged). Requests
are grouped by prompt length (under 1K, 1-4K, 4-8K tokens, 8K and more) and predicted hit class (miss, engine,
dram, or the tier that served the most); a group passes when the median and p90 of predicted over measured TTFT
are both within 0.8-1.25, the whole run when every group of three or more requests passes and the predicted hit
ratio is within 0.01 of the measured one.

Mooncake lines carry no tokens: each block id becomes ``block_tokens`` random token ids drawn from the id, so
prompts share exactly the prefixes their ids share.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import KVTierError
from kvtier.sim.deployment import Deployment
from kvtier.sim.timing import StepCosts, simulate
from kvtier.sim.trace import Trace

BUCKETS = ((0, 1024, "<1K"), (1024, 4096, "1-4K"), (4096, 8192, "4-8K"), (8192, 10**12, ">=8K"))
BAND = (0.8, 1.25)


def prompt_tokens(trace: Trace, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Token ids for every request: block id ``b`` is always the same ``block_tokens`` random ids."""
    bt = trace.block_tokens
    cache: dict[int, list[int]] = {}

    def block(b: int) -> list[int]:
        if b not in cache:
            cache[b] = [int(t) for t in np.random.default_rng([seed, b]).integers(1000, vocab_size - 1000, bt)]
        return cache[b]

    out = []
    for r in trace.requests:
        tokens: list[int] = []
        for b in r.blocks:
            tokens += block(b)
        out.append(tokens[:r.input_length])
    return out


def hit_class(row: dict[str, Any]) -> str:
    loaded = row["loaded_tokens"]
    if loaded:
        return max(loaded, key=loaded.get)
    return "engine" if row["engine_hit_tokens"] else "miss"


def bucket(tokens: int) -> str:
    return next(name for low, high, name in BUCKETS if low <= tokens < high)


def compare(predicted: list[dict[str, Any]], measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Group predicted/measured TTFT ratios; a group of three or more requests passes when its median and p90
    ratios are within :data:`BAND`."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for p, m in zip(predicted, measured):
        key = f"{bucket(p['prompt_tokens'])} {hit_class(p)}"
        groups.setdefault(key, []).append((p["ttft_s"], m["ttft_s"]))
    out = {}
    for key, pairs in sorted(groups.items()):
        ratios = np.array([pr / me for pr, me in pairs])
        pred, meas = np.array([p for p, _ in pairs]), np.array([m for _, m in pairs])
        median = float(np.median(pred) / np.median(meas))
        p90 = float(np.percentile(pred, 90) / np.percentile(meas, 90))
        judged = len(pairs) >= 3
        out[key] = {"requests": len(pairs), "predicted_p50_s": float(np.median(pred)),
                    "measured_p50_s": float(np.median(meas)), "p50_ratio": median, "p90_ratio": p90,
                    "mape": float(np.mean(np.abs(ratios - 1))), "judged": judged,
                    "pass": (not judged) or all(BAND[0] <= r <= BAND[1] for r in (median, p90))}
    return out


def engine_config(deployment: Deployment, trace: Trace, kv_dir: Path, metrics_port: int) -> dict[str, Any]:
    """The kvtier config the real run uses: DRAM and filesystem tiers (under ``kv_dir``) as the deployment sizes
    them, each with its codec."""
    kv = deployment.kvtier
    assert kv is not None
    tiers = []
    for tier in kv.tiers:
        if tier.name not in ("filesystem", "disk"):
            raise KVTierError(f"kvtier.tiers: validate runs DRAM and a filesystem tier (named filesystem or "
                              f"disk) on this machine; {tier.name!r} is not one")
        tiers.append({"type": "filesystem", "name": tier.name, "path": str(kv_dir / tier.name),
                      "capacity_bytes": tier.capacity_bytes, "queue_depth": 4096, "codec": tier.codec})
    return {"chunk_tokens": trace.block_tokens, "metrics_port": metrics_port,
            "dram": {"capacity_bytes": kv.dram_bytes, "eviction": kv.policy, "page_bytes": kv.page_bytes},
            "admission": {"store_after": kv.store_after}, "tiers": tiers}


def _counter(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines()
               if ln.startswith((name + "{", name + " ")))


async def _replay(port: int, model: str, trace: Trace, prompts: list[list[int]], scale: float,
                  log) -> list[dict[str, Any]]:
    import aiohttp

    results: list[dict[str, Any]] = [{} for _ in prompts]
    start = time.perf_counter()
    done = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal done
        request = trace.requests[i]
        await asyncio.sleep(max(0.0, request.timestamp_ms / 1000 / scale - (time.perf_counter() - start)))
        body = {"model": model, "prompt": prompts[i], "max_tokens": max(request.output_length, 1),
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        first = None
        cached = 0
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as reply:
            if reply.status != 200:
                raise KVTierError(f"request {i}: the server answered {reply.status}: {(await reply.text())[:300]}")
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if first is None and event.get("choices"):
                    first = time.perf_counter()
                usage = event.get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached
        results[i] = {"ttft_s": (first or time.perf_counter()) - sent, "cached_tokens": cached,
                      "prompt_tokens": request.input_length, "sent_s": sent - start,
                      "finish_s": time.perf_counter() - start}
        done += 1
        log(f"request {i + 1}/{len(prompts)} ({done} done): {request.input_length} tokens, "
            f"TTFT {results[i]['ttft_s']:.3f} s, {cached} cached")

    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, i) for i in range(len(prompts))))
    return results


def _warm_up(port: int, model: str, vocab_size: int, longest: int) -> None:
    """A server's first requests pay one-time costs (allocations, first kernels at a size) no simulation should
    be held to, as calibration's sweeps skip them too: a short prompt, then one as long as the trace's longest.
    Their random tokens never match the trace's; what they leave in the engine's cache and in DRAM is the least
    recently used there, so it is evicted before anything of the trace."""
    from kvtier.bench.server import post_completion

    rng = np.random.default_rng(12345)
    for length in (100, longest):
        post_completion(port, {"model": model, "prompt": [int(t) for t in rng.integers(1000, vocab_size - 1000,
                                                                                        length)],
                               "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def measure(trace: Trace, deployment: Deployment, model: Path, vocab_size: int, work: Path, log,
            dtype: str) -> dict[str, Any]:
    """Run the trace against vLLM's OpenAI server with kvtier, computing in ``dtype`` (the calibration's); per-request
    TTFT and cached tokens, and the engine's and kvtier's hit counters."""
    from kvtier.bench.server import server_env, stop, wait_healthy
    from kvtier.testing.servers import free_port

    work.mkdir(parents=True, exist_ok=True)
    port, metrics_port = free_port(), free_port()
    engine = deployment.engine
    longest = max(r.input_length + max(r.output_length, 1) for r in trace.requests)
    max_len = -(-(longest + 1) // engine.block_size) * engine.block_size
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--enforce-eager", "--dtype", dtype, "--max-model-len", str(max_len),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens), "--max-num-seqs",
            str(engine.max_num_seqs), "--num-gpu-blocks-override", str(engine.kv_tokens // engine.block_size),
            "--block-size", str(engine.block_size), "--gpu-memory-utilization", "0.3", "--enable-prompt-tokens-details",
            "--enable-chunked-prefill"]
    if not engine.prefix_caching:
        argv.append("--no-enable-prefix-caching")
    scratch = tempfile.TemporaryDirectory(prefix="kvtier-validate-")  # the tiers' files: gone when done
    if deployment.kvtier is not None:
        config = engine_config(deployment, trace, Path(scratch.name), metrics_port)
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": config}})]
    env = server_env()
    env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    prompts = prompt_tokens(trace, vocab_size)
    with open(work / "server.log", "w") as server_log:
        server = subprocess.Popen(argv, stdout=server_log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_healthy(server, port, work / "server.log")
            _warm_up(port, str(model), vocab_size, max(r.input_length for r in trace.requests))
            log(f"engine up; replaying {len(prompts)} requests over "
                f"{trace.requests[-1].timestamp_ms / 1000 / deployment.time_scale:.0f} s")
            names = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total",
                     "vllm:num_preemptions_total")
            before = {n: _counter(port, n) for n in names}
            rows = asyncio.run(_replay(port, str(model), trace, prompts, deployment.time_scale, log))
            after = {n: _counter(port, n) for n in names}
        finally:
            try:
                stop(server)
            except ProcessLookupError:
                pass  # it had exited already (the error above says why)
            scratch.cleanup()
    counters = {n.split(":", 1)[1]: after[n] - before[n] for n in names}
    return {"requests": rows, "counters": counters}


def validate(trace: Trace, deployment: Deployment, calibration: dict[str, Any], model: Path, out: Path,
             plot: bool = True) -> dict[str, Any]:
    """Predict, measure, compare; writes ``validate.json`` and ``validate.png`` under ``out``."""
    def log(msg: str) -> None:
        print(f"validate: {msg}", file=sys.stderr, flush=True)

    predicted = simulate(trace, deployment, StepCosts.from_calibration(calibration))
    if predicted["refused"]:
        raise KVTierError(f"engine.kv_tokens: {predicted['refused']} requests do not fit the engine's KV space; "
                          "validate needs every request served")
    log(f"predicted: TTFT p50 {predicted['ttft_s']['p50']:.3f} s; measuring on vLLM")
    measured = measure(trace, deployment, model, int(calibration["model"]["vocab_size"]), out / "work", log,
                       calibration["model"]["dtype"])
    prompts = sum(r.input_length for r in trace.requests)
    hit_pred = (predicted["engine_hit_tokens"] + sum(predicted["loaded_tokens"].values())) / prompts
    hit_meas = sum(r["cached_tokens"] for r in measured["requests"]) / prompts
    groups = compare(predicted["requests"], measured["requests"])
    result: dict[str, Any] = {
        "trace": trace.source, "requests": len(trace.requests),
        "hit_ratio": {"predicted": hit_pred, "measured": hit_meas, "pass": abs(hit_pred - hit_meas) <= 0.01},
        "kvtier_hit_ratio": {"predicted": sum(predicted["loaded_tokens"].values()) / prompts,
                             "measured": measured["counters"]["external_prefix_cache_hits_total"] / prompts},
        "preemptions": {"predicted": predicted["preemptions"],
                        "measured": measured["counters"]["num_preemptions_total"]},
        "groups": groups,
        "per_request": [{"predicted_ttft_s": p["ttft_s"], "measured_ttft_s": m["ttft_s"], "class": hit_class(p),
                         "prompt_tokens": p["prompt_tokens"],
                         "predicted_cached": p["engine_hit_tokens"] + sum(p["loaded_tokens"].values()),
                         "measured_cached": m["cached_tokens"]}
                        for p, m in zip(predicted["requests"], measured["requests"])],
    }
    result["pass"] = result["hit_ratio"]["pass"] and all(g["pass"] for g in groups.values())
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"hit ratio: predicted {hit_pred:.4f}, measured {hit_meas:.4f} "
          f"({'pass' if result['hit_ratio']['pass'] else 'FAIL'}: within 0.01)")
    print(f"{'group':<16} {'n':>3} {'pred p50':>9} {'meas p50':>9} {'p50 ratio':>9} {'p90 ratio':>9}  verdict")
    for key, g in groups.items():
        verdict = ("pass" if g["pass"] else "FAIL") if g["judged"] else "(too few)"
        print(f"{key:<16} {g['requests']:>3} {g['predicted_p50_s']:>8.3f}s {g['measured_p50_s']:>8.3f}s "
              f"{g['p50_ratio']:>9.2f} {g['p90_ratio']:>9.2f}  {verdict}")
    if plot:
        _scatter(result, out / "validate.png")
    print(f"{'PASS' if result['pass'] else 'FAIL'}; wrote {out / 'validate.json'}")
    return result


def _scatter(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.5))
    rows = result["per_request"]
    for cls in sorted({r["class"] for r in rows}):
        pts = [(r["measured_ttft_s"], r["predicted_ttft_s"]) for r in rows if r["class"] == cls]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=cls, s=18)
    everything = [v for r in rows for v in (r["measured_ttft_s"], r["predicted_ttft_s"])]
    low, high = min(everything) * 0.8, max(everything) * 1.25
    ax.plot([low, high], [low, high], color="grey", linewidth=1)
    ax.plot([low, high], [low * BAND[0], high * BAND[0]], color="grey", linewidth=0.5, linestyle="--")
    ax.plot([low, high], [low * BAND[1], high * BAND[1]], color="grey", linewidth=0.5, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured TTFT (s)")
    ax.set_ylabel("predicted TTFT (s)")
    ax.set_title(f"{Path(result['trace']).name}: predicted vs measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
