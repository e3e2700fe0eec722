"""The benchmark's API-server phase: vLLM's OpenAI-compatible server, driven over HTTP, the way vLLM is served.

There the scheduler and the worker are separate processes, each with a store of its own; the store config is
DRAM-only, so every kvtier hit is a chunk the scheduler learned of from the worker's reports. TTFT is the time of
a one-token completion request; kvtier's counters (each process's store serves its metrics) say which chunks
kvtier served and missed, and each reply's ``usage.prompt_tokens_details.cached_tokens`` how many of its prompt's
tokens vLLM did not compute. vLLM's own hit, the figure to compare with, is measured in the same server beside
each kvtier hit (:mod:`kvtier.bench.pairs`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.bench import pairs
from kvtier.errors import KVTierError
from kvtier.testing.servers import free_port


def post_completion(port: int, body: dict) -> dict:
    """POST ``body`` to a vLLM OpenAI server's /v1/completions; its JSON reply."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as reply:
        return json.loads(reply.read())


def server_env() -> dict[str, str]:
    """The environment vLLM runs in for a measurement: the server's own defaults (multiprocessing on; an
    in-process engine sets it off), and the same compute cores with and without a KV connector.

    On CPU, vLLM's API server binds its worker's OpenMP threads to the cores it does not reserve, and reserves one
    core per rank (for the scheduler's process), plus one more when a KV connector is configured; on 2 cores the
    second reservation leaves none, and vLLM then falls back to all of them. So by default vLLM alone computes on
    1 core of 2 and vLLM with kvtier on 2: a comparison between them would credit kvtier with a core. Reserving
    one for both (unless the caller set ``VLLM_CPU_NUM_OF_RESERVED_CPU``), vLLM's own default without a
    connector, makes them compute on the same core, the other left to Python (the scheduler, kvtier's threads).
    Reserving none was tried: OpenMP threads on every core then wait on the Python threads they share them with,
    and vLLM's own exact-repeat hit took 0.61 s instead of 0.44 s. An in-process engine applies no reservation:
    :func:`inprocess_env` gives it the same compute cores."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return env


def compute_threads(env: dict[str, str]) -> int:
    """The OpenMP threads vLLM's API server gives its worker here: this process's cores less the reserved ones
    (all of them when none would be left, as vLLM falls back)."""
    cores = len(os.sched_getaffinity(0))
    left = cores - int(env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or 0)
    return left if left >= 1 else cores


def inprocess_env() -> dict[str, str]:
    """:func:`server_env` for an engine in this process's child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). vLLM's
    reservation of cores applies only to the workers its API server starts (an in-process engine computed on
    both cores of 2: two threads busy through a recompute), so the in-process engine is given the
    worker's thread count itself (``OMP_NUM_THREADS``, unless the caller set it): every phase computes with the
    same number of threads, the rest of the cores left to Python and kvtier's threads. Unlike the API server's
    worker, the threads are not pinned to cores (the OS places them), and the count is of this process's CPUs
    (vLLM's own binding takes one per physical core of the rank's NUMA node: on hosts with SMT or several nodes
    the two differ)."""
    env = server_env()
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("OMP_NUM_THREADS", str(compute_threads(env)))
    return env


def stop(server: subprocess.Popen) -> None:
    """Stop a server started in a session of its own (``start_new_session``) with every process it started:
    SIGTERM to its process group, SIGKILL after 60 s."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def run(job: dict, work: Path, log: Callable[[str], None]) -> dict[str, object]:
    """kvtier with a DRAM-only config and vLLM's KV memory of 1.5 documents, in one server: every document
    computed and stored once, then pairs of hits (:mod:`kvtier.bench.pairs`), kvtier's from its DRAM beside vLLM's
    own of the same prompt shape, over the same HTTP path. vLLM's prefix cache is emptied through its
    ``/reset_prefix_cache`` (a development route: ``VLLM_SERVER_DEV_MODE=1`` in this server only); which requests
    kvtier served comes from kvtier's own counters (the chunks its stores served and missed, scraped from every
    process's metrics), how many tokens vLLM did not compute from each reply."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", job["model"],
            "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "bfloat16",
            "--max-model-len", str(job["max_model_len"]), "--max-num-batched-tokens", str(job["max_model_len"]),
            "--num-gpu-blocks-override", str(job["small_blocks"]), "--block-size", str(job["block_tokens"]),
            "--gpu-memory-utilization", "0.3", "--enable-prompt-tokens-details"]
    store = {**job["store"], "tiers": [], "metrics_port": free_port()}  # DRAM only
    argv += ["--kv-transfer-config", json.dumps({
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": store, "store_tails": job.get("store_tails", True)}})]
    env = {**server_env(), "VLLM_SERVER_DEV_MODE": "1"}
    with open(work / "api_server_kvtier.log", "w") as server_log:
        server = subprocess.Popen(argv, stdout=server_log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        try:
            wait_healthy(server, port, work / "api_server_kvtier.log")
            log("API server up (kvtier, DRAM only)")
            ask = _ask(port, store["metrics_port"], job)
            for req in job["requests"]:
                if req["round"] == 0:  # computes and stores every document
                    log(f"API server: store, doc {req['doc']}: TTFT {ask.ttft(req['tokens']):.3f} s")
            measured = pairs.measure(ask, job["docs"], job["suffixes"]["api_server"], job["pair_rounds"],
                                     kinds=("DRAM hit",), log=lambda m: log(f"API server: {m}"))
        finally:
            stop(server)
    label = "kvtier, API server, DRAM hit (DRAM-only config)"
    return {"pairs": {label: measured["DRAM hit"]}, label: measured["DRAM hit"]["kvtier"]}


def wait_healthy(server: subprocess.Popen, port: int, log_path: Path) -> None:
    """Until vLLM's API server on ``port`` answers /health (KVTierError if it exits first or takes 600 s)."""
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            raise KVTierError(f"vLLM's API server exited ({server.returncode}); see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise KVTierError("vLLM's API server did not answer /health within 600 s") from None
            time.sleep(1)


def kvtier_ports(metrics_port: int, tries: int = 8) -> list[int]:
    """The ports from ``metrics_port`` on where this engine's kvtier stores serve their metrics (each process's
    store takes the next free one, :meth:`kvtier.metrics.StoreMetrics.serve`): those that answer with kvtier's
    counters. KVTierError when none does."""
    ports = []
    for port in range(metrics_port, metrics_port + tries):
        try:
            body = _metrics(port)
        except (OSError, ValueError):  # nothing there, or not answering like a kvtier store
            continue
        if "kvtier_miss_chunks_total" in body:
            ports.append(port)
    if not ports:
        raise KVTierError(f"no kvtier metrics on ports {metrics_port}-{metrics_port + tries - 1}")
    return ports


def kvtier_served(ports: Sequence[int]) -> tuple[float, float, float]:
    """Chunks kvtier served from DRAM and from other tiers, and chunks it found nowhere, summed over the stores
    serving metrics on ``ports`` (:func:`kvtier_ports`); an error from any of them is raised, as a count read
    from fewer stores than before would look like chunks served."""
    dram = other = missed = 0.0
    for port in ports:
        for line in _metrics(port).splitlines():
            if line.startswith("kvtier_hit_chunks_total{"):
                value = float(line.rsplit(" ", 1)[1])
                if 'tier="dram"' in line:
                    dram += value
                else:
                    other += value
            elif line.startswith(("kvtier_miss_chunks_total{", "kvtier_miss_chunks_total ")):
                missed += float(line.rsplit(" ", 1)[1])
    return dram, other, missed


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def _ask(port: int, metrics_port: int, job: dict) -> pairs.Ask:
    """The pairs' view of an API server: a one-token completion's TTFT; chunks served by kvtier, from its stores'
    counters; the prompt tokens vLLM did not compute, from each reply's usage; vLLM's prefix cache emptied over
    HTTP."""
    cached = [0]

    def ttft(tokens: list[int]) -> float:
        start = time.perf_counter()
        reply = post_completion(port, {"model": job["model"], "prompt": tokens, "max_tokens": 1, "temperature": 0})
        seconds = time.perf_counter() - start
        cached[0] += cached_tokens(reply)
        return seconds

    def reset() -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as reply:
            if not json.loads(reply.read() or b"{}").get("success", True):
                raise RuntimeError("vLLM's API server did not empty its prefix cache")

    def drop() -> None:
        raise RuntimeError("the API server's kvtier config is DRAM-only: it has no disk hits to measure")

    ports = kvtier_ports(metrics_port)
    return pairs.Ask(ttft=ttft, served=lambda: kvtier_served(ports),
                     cached=lambda: cached[0], reset=reset, drop=drop, **pairs.units(job))


def cached_tokens(reply: dict) -> int:
    """A completion reply's prompt tokens vLLM did not compute (``--enable-prompt-tokens-details``)."""
    details = (reply.get("usage") or {}).get("prompt_tokens_details")
    if details is None:
        raise RuntimeError("vLLM's reply has no usage.prompt_tokens_details: start it with "
                           "--enable-prompt-tokens-details")
    return int(details.get("cached_tokens") or 0)
