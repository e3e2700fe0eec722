"""The benchmark's API-server phase: vLLM's OpenAI-compatible server, driven over HTTP, the way vLLM is served.

There the scheduler and the worker are separate processes, each with a store of its own; the store config is
DRAM-only, so every kvtier hit is a chunk the scheduler learned of from the worker's reports. TTFT is the time of
a one-token completion request; vLLM's own counters (``vllm:external_prefix_cache_*``) give the share of the
tokens it asked the connector about that the connector served. vLLM alone, in a server with room for every
document, gives its own prefix-cache hits over the same HTTP path, for the ratio.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

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


def _counter(port: int, name: str) -> float:
    """A vLLM counter from the server's /metrics, summed over its label sets."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        body = reply.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines()
               if ln.startswith((name + "{", name + " ")))


def run(job: dict, work: Path, log: Callable[[str], None]) -> dict[str, object]:
    """kvtier with a DRAM-only config and vLLM's KV memory of 1.5 documents; then vLLM alone with room for every
    document (its own prefix-cache hits, the figure to compare with), each in a server of its own."""
    result = _serve(job, work, log, kvtier=True)
    result.update(_serve(job, work, log, kvtier=False))
    return result


def _serve(job: dict, work: Path, log: Callable[[str], None], *, kvtier: bool) -> dict[str, object]:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", job["model"],
            "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "bfloat16",
            "--max-model-len", str(job["max_model_len"]), "--max-num-batched-tokens", str(job["max_model_len"]),
            "--num-gpu-blocks-override", str(job["small_blocks" if kvtier else "large_blocks"]),
            "--block-size", "128", "--gpu-memory-utilization", "0.3"]
    if kvtier:
        store = {**job["store"], "tiers": [], "metrics_port": free_port()}  # DRAM only
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": store, "store_tails": job.get("store_tails", True)}})]
    env = server_env()
    name = "api_server_kvtier" if kvtier else "api_server_vllm"
    with open(work / f"{name}.log", "w") as server_log:
        server = subprocess.Popen(argv, stdout=server_log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"vLLM's API server exited ({server.returncode}); see {work / f'{name}.log'}")
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("vLLM's API server did not answer /health within 600 s") from None
                    time.sleep(1)
            log(f"API server up ({'kvtier, DRAM only' if kvtier else 'vLLM alone'})")

            def ttft(tokens: list[int]) -> float:
                start = time.perf_counter()
                post_completion(port, {"model": job["model"], "prompt": tokens, "max_tokens": 1, "temperature": 0})
                return time.perf_counter() - start

            def counters() -> tuple[float, float]:
                if not kvtier:
                    return 0.0, 0.0
                return (_counter(port, "vllm:external_prefix_cache_queries_total"),
                        _counter(port, "vllm:external_prefix_cache_hits_total"))

            times: list[float] = []
            before = (0.0, 0.0)
            for req in job["requests"]:
                if req["round"] == 1 and not times:
                    before = counters()  # round 0 computed and stored every document: count the repeats only
                seconds = ttft(req["tokens"])
                if req["round"] > 0:
                    times.append(seconds)
                log(f"API server ({'kvtier' if kvtier else 'vLLM'}): round {req['round']} doc {req['doc']}: "
                    f"TTFT {seconds:.3f} s")
            after = counters()
            queries, hits = after[0] - before[0], after[1] - before[1]
        finally:
            stop(server)
    if not kvtier:
        return {"vLLM prefix-cache hit, API server": times}
    return {"kvtier, API server, DRAM hit (DRAM-only config)": times,
            "external_hits": {"query_tokens": queries, "hit_tokens": hits}}
