"""vLLM's own disaggregated prefill/decode on CPUs: two OpenAI API servers joined by vLLM's ``NixlConnector``
(NIXL's UCX backend), one core each, and the two-hop proxy of :mod:`.proxy` in front.

    python -m benchmarks.peers.pd.nixl --smoke      # from the repository root, with .venv's python

Needs NIXL as vLLM imports it (``nixl._api``): the CUDA 12 build, whose UCX backend runs without a GPU, and the
``nixl`` meta package that picks it, without its dependencies (they include the CUDA 13 build)::

    .venv/bin/pip install nixl-cu12==1.5.1 && .venv/bin/pip install --no-deps nixl==1.5.1

The prefill engine runs with ``kv_role`` ``kv_producer``, the decode engine with ``kv_consumer``; the decode engine
reads the prompt's KV out of the prefill engine's memory (a NIXL READ) after a handshake on the prefill engine's
side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``: each engine binds one, on a free port here). UCX carries
the read over TCP (``UCX_TLS=tcp``), as between two hosts, unless told otherwise. Each engine is an
:class:`ApiServer`: a :class:`kvtier.fleet.process.Process` (its own session, stopped by PID) whose worker computes
on one core (``VLLM_CPU_OMP_THREADS_BIND``); its API server and engine-core processes are not pinned.

Core pinning: on CPUs, vLLM's NIXL worker moves the thread that builds it to the last core of each NUMA node
(vLLM means to keep KV loads off the compute cores); that thread is the worker's main thread, which also runs
the model, so with one core per engine both engines would compute on the last core. :meth:`ApiServer.pin_worker`
moves every thread of the worker process back to its engine's core once the engine answers /health.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.model import prepare_model
from kvtier.bench.pairs import kv_bytes_per_token
from kvtier.fleet.process import Process, stop_all
from kvtier.fleet.run import engine_env
from kvtier.testing.fleet import BLOCK_SIZE
from kvtier.testing.servers import free_port

from .proxy import ProxyThread

REPO = Path(__file__).resolve().parents[3]
SERVED_NAME = "smol"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What both engines of a pair (and a colocated engine to compare with) are started with: vLLM's block size,
    context length, KV blocks (``--num-gpu-blocks-override``) and KV memory (``VLLM_CPU_KVCACHE_SPACE``, GiB)."""

    block_size: int = BLOCK_SIZE
    max_model_len: int = 4096
    blocks: int = 64
    kvcache_gib: int = 1


def transfer_config(role: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the ``prefill`` or ``decode`` side of a NIXL pair."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(sorted(ROLES))}")
    return {"kv_connector": "NixlConnector", "kv_role": ROLES[role], "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"backends": ["UCX"]}}


class ApiServer(Process):
    """One vLLM OpenAI API server whose worker computes on core ``cpu``: the ``prefill`` or ``decode`` side of a
    NIXL pair (``role``), or, with ``role`` None, an engine without a KV connector (colocated prefill and
    decode). ``env`` is added to its environment (``UCX_TLS``, for one)."""

    def __init__(self, name: str, model: Path, work: Path, *, cpu: int, role: str | None = None,
                 shape: Shape = Shape(), extra: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.cpu = cpu
        self.role = role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                "--block-size", str(shape.block_size), "--max-model-len", str(shape.max_model_len),
                "--max-num-batched-tokens", str(shape.max_model_len), "--num-gpu-blocks-override",
                str(shape.blocks), "--enforce-eager", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3",
                "--enable-prompt-tokens-details", *extra]
        extra_env = {"VLLM_CPU_KVCACHE_SPACE": str(shape.kvcache_gib)}
        self.side_channel_port: int | None = None
        if role is not None:
            argv += ["--kv-transfer-config", json.dumps(transfer_config(role))]
            self.side_channel_port = free_port()
            extra_env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                             VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port))
        super().__init__(name, argv, work / f"{name}.log", engine_env(str(cpu), {**extra_env, **(env or {})}),
                         self.url + "/health")

    def worker_pid(self) -> int:
        """The PID of the engine's worker process: the descendant vLLM titled ``VLLM::Worker...`` (it titles its
        processes through ``setproctitle``, a dependency of vllm-cpu)."""
        assert self.pid is not None
        for pid in _descendants(self.pid):
            if _title(pid).startswith("VLLM::Worker"):
                return pid
        raise RuntimeError(f"{self.name}: no process titled VLLM::Worker under PID {self.pid}")

    def pin_worker(self) -> dict[int, list[int]]:
        """Move every thread of the worker process to :attr:`cpu`; the threads that were elsewhere, with the cores
        they were allowed before."""
        moved = {}
        for tid in _threads(self.worker_pid()):
            try:
                before = sorted(os.sched_getaffinity(tid))
                if before != [self.cpu]:
                    os.sched_setaffinity(tid, {self.cpu})
                    moved[tid] = before
            except OSError:  # a thread that ended meanwhile
                continue
        return moved

    def affinities(self) -> dict[str, list[int]]:
        """Each process of the engine (its title: ``VLLM::Worker_...``, ``VLLM::EngineCore``, the API server's
        command) with the cores its threads may run on, as a union."""
        assert self.pid is not None
        out = {}
        for pid in [self.pid, *_descendants(self.pid)]:
            try:
                cores = set().union(*(os.sched_getaffinity(tid) for tid in _threads(pid)))
            except OSError:  # ended meanwhile
                continue
            out[f"{pid} {_title(pid)[:40]}"] = sorted(cores)
        return out


@dataclasses.dataclass(frozen=True)
class Started:
    """Engines that answer /health: the seconds from their start (all at once) to the last one's answer, and, per
    engine, the worker threads :meth:`ApiServer.pin_worker` moved back to its core (thread id: cores before)."""

    start_s: float
    moved: dict[str, dict[int, list[int]]]


@contextlib.contextmanager
def serving(engines: Sequence[ApiServer], *, pin: bool = True, timeout: float = 600) -> Iterator[Started]:
    """Start ``engines`` at once, wait until every one answers /health, move each worker's threads back to its
    core (``pin``), and stop them all, by PID, on exit (also when one fails to start)."""
    start = time.perf_counter()
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy(timeout)
        start_s = time.perf_counter() - start
        yield Started(start_s, {e.name: e.pin_worker() for e in engines} if pin else {})
    finally:
        stop_all(list(engines))


@dataclasses.dataclass(frozen=True)
class Pair:
    prefill: ApiServer
    decode: ApiServer
    started: Started


@contextlib.contextmanager
def nixl_pair(work: Path, *, model: Path | None = None, prefill_cpu: int = 0, decode_cpu: int = 1,
              shape: Shape = Shape(), ucx_tls: str | None = "tcp", pin: bool = True,
              env: dict[str, str] | None = None, timeout: float = 600) -> Iterator[Pair]:
    """A prefill engine on core ``prefill_cpu`` and a decode engine on ``decode_cpu``, joined by NIXL, for the
    ``with`` block; their logs under ``work`` (``prefill.log``, ``decode.log``). ``model``: SmolLM2-135M-Instruct
    (:func:`prepare_model`) unless given. ``ucx_tls``: UCX's transports (``UCX_TLS``); the default, TCP, is what
    engines on two hosts would use, where UCX left to itself (None) reads across processes of one host with
    CMA (``process_vm_readv``). ``pin``: see :meth:`ApiServer.pin_worker`. ``env``: more environment for both."""
    model = model or prepare_model()
    env = {**({"UCX_TLS": ucx_tls} if ucx_tls else {}), **(env or {})}
    prefill = ApiServer("prefill", model, work, cpu=prefill_cpu, role="prefill", shape=shape, env=env)
    decode = ApiServer("decode", model, work, cpu=decode_cpu, role="decode", shape=shape, env=env)
    with serving([prefill, decode], pin=pin, timeout=timeout) as started:
        yield Pair(prefill, decode, started)


@contextlib.contextmanager
def nixl_pd(model: Path | None, work: Path, *, blocks: int = Shape.blocks, ucx_tls: str | None = "tcp",
            proxy_process: bool = False) -> Iterator[str]:
    """:func:`nixl_pair` (``blocks`` KV blocks each) behind the proxy, for the ``with`` block; yields the proxy's
    URL. The proxy runs on a thread of this process (:class:`.proxy.ProxyThread`), or, with ``proxy_process``, in
    a process of its own (log ``pd-proxy.log``), as a router would: then it shares no interpreter lock with the
    benchmark's clients."""
    with nixl_pair(work, model=model, shape=Shape(blocks=blocks), ucx_tls=ucx_tls) as pair:
        if not proxy_process:
            with ProxyThread(pair.prefill.url, pair.decode.url) as proxy:
                yield proxy.url
            return
        port = free_port()
        argv = [sys.executable, "-m", "benchmarks.peers.pd.proxy", "--prefill", pair.prefill.url, "--decode",
                pair.decode.url, "--port", str(port)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        proxy_proc = Process("pd-proxy", argv, work / "pd-proxy.log", env, f"http://127.0.0.1:{port}/health")
        try:
            proxy_proc.start().wait_healthy(60)
            yield f"http://127.0.0.1:{port}"
        finally:
            proxy_proc.stop()


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _title(pid: int) -> str:
    """A process's title (its command line's first word, which ``setproctitle`` rewrites); "" if it ended."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url``; the JSON answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as reply:
        return json.loads(reply.read())


def post_stream(url: str, body: dict[str, Any], timeout: float = 600) -> tuple[str, dict[str, Any]]:
    """POST a streamed completion request; its text, joined from the server-sent events, and the usage of the
    last event that has one (``stream_options.include_usage``)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    text: list[str] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=timeout) as reply:
        for line in reply:
            data = line.decode().strip().removeprefix("data:").strip()
            if not data or data == "[DONE]":
                continue
            event = json.loads(data)
            text += [choice.get("text") or "" for choice in event.get("choices") or []]
            usage = event.get("usage") or usage
    return "".join(text), usage


def cached_tokens(usage: dict[str, Any]) -> int:
    """A reply's ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``). A decode
    engine reports there the prefill engine's prefix-cache hits (handed over in ``kv_transfer_params``), not the
    tokens it read over NIXL: those are in :func:`nixl_counters`."""
    return int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def nixl_counters(engine: ApiServer) -> dict[str, float]:
    """The engine's NIXL transfer counters from its /metrics: transfers, their seconds and bytes (sums)."""
    names = {"vllm:nixl_xfer_time_seconds_count": "transfers", "vllm:nixl_xfer_time_seconds_sum": "seconds",
             "vllm:nixl_bytes_transferred_sum": "bytes", "vllm:nixl_num_failed_transfers_total": "failed"}
    out = dict.fromkeys(names.values(), 0.0)
    with urllib.request.urlopen(engine.url + "/metrics", timeout=30) as reply:
        for line in reply.read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def smoke_prompt(model: Path, tokens: int) -> list[int]:
    """About ``tokens`` tokens of real text (:mod:`kvtier.bench.workload`'s document) and a question."""
    from transformers import AutoTokenizer

    from kvtier.bench.workload import documents, requests

    tokenizer = AutoTokenizer.from_pretrained(model)
    return requests(tokenizer, documents(tokenizer, 1, tokens), 1)[0].tokens


def smoke(work: Path, tokens: int, max_tokens: int, ucx_tls: str | None) -> bool:
    """One prompt through the pair, streamed and not, against the same request colocated on the decode engine
    (with a cache salt of its own, so that it shares no prefix blocks with the others; the streamed request has
    another, so it is prefilled and read again); True if the three texts are equal and the decode engine read
    the prompt's full blocks over NIXL."""
    model = prepare_model()
    prompt = smoke_prompt(model, tokens)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    print(f"smoke: prompt of {len(prompt)} tokens, max_tokens {max_tokens}, UCX_TLS {ucx_tls or '(UCX chooses)'}, "
          f"logs in {work}", flush=True)
    with nixl_pair(work, model=model, ucx_tls=ucx_tls) as pair, \
            ProxyThread(pair.prefill.url, pair.decode.url) as proxy:
        print(f"smoke: pair answered /health {pair.started.start_s:.1f} s after both started; worker threads "
              f"moved back to their engine's core (thread: cores before): {pair.started.moved}", flush=True)
        start = time.perf_counter()
        colocated = post(pair.decode.url + "/v1/completions", {**body, "cache_salt": "colocated"})
        colocated_s = time.perf_counter() - start
        before = nixl_counters(pair.decode)
        start = time.perf_counter()
        disagg = post(proxy.url + "/v1/completions", body)
        disagg_s = time.perf_counter() - start
        after = nixl_counters(pair.decode)
        streamed, stream_usage = post_stream(proxy.url + "/v1/completions",
                                             {**body, "cache_salt": "streamed", "stream": True,
                                              "stream_options": {"include_usage": True}})
        handoffs = list(proxy.handoffs)
        strays = {e.name: e.pin_worker() for e in (pair.prefill, pair.decode)}
    texts = {"colocated": colocated["choices"][0]["text"], "disaggregated": disagg["choices"][0]["text"],
             "disaggregated, streamed": streamed}
    for label, text in texts.items():
        print(f"smoke: {label:>23}: {text!r}")
    delta = {k: after[k] - before[k] for k in after}
    moved_tokens = delta["bytes"] / kv_bytes_per_token(model)
    full_blocks = len(prompt) // Shape().block_size * Shape().block_size
    print(f"smoke: decode engine's usage.prompt_tokens_details.cached_tokens: {cached_tokens(disagg['usage'])} "
          f"(streamed: {cached_tokens(stream_usage)}; colocated: {cached_tokens(colocated['usage'])})")
    print(f"smoke: NIXL, from the decode engine's /metrics: {delta['transfers']:.0f} transfer(s), "
          f"{delta['bytes'] / 1e6:.1f} MB ({moved_tokens:.0f} tokens' KV) in {delta['seconds'] * 1e3:.1f} ms, "
          f"{delta['failed']:.0f} failed")
    for label, hop in zip(("disaggregated (NIXL handshake on first use)", "streamed"), handoffs):
        print(f"smoke: {label}: prefill hop {hop.prefill_s * 1e3:.0f} ms, decode hop's first bytes "
              f"{(hop.decode_first_s - hop.prefill_s) * 1e3:.0f} ms after it, its end "
              f"{(hop.decode_done_s - hop.prefill_s) * 1e3:.0f} ms after it")
    print(f"smoke: whole requests: colocated {colocated_s * 1e3:.0f} ms, disaggregated {disagg_s * 1e3:.0f} ms")
    print(f"smoke: worker threads found off their core after the requests: {strays}")
    equal = len(set(texts.values())) == 1
    read = delta["failed"] == 0 and moved_tokens >= full_blocks
    print(f"smoke: texts equal: {equal}; the prompt's full blocks ({full_blocks} tokens) read over NIXL: {read}")
    return equal and read


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one prompt through the pair vs colocated")
    parser.add_argument("--tokens", type=int, default=2000, help="the smoke prompt's document length")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ucx-tls", default="tcp",
                        help="UCX_TLS for both engines (default tcp); 'auto': UCX's own choice (CMA on one host)")
    parser.add_argument("--work", type=Path, default=None, help="where the engines' logs go (default: a temp dir)")
    args = parser.parse_args(argv)
    if not args.smoke:
        parser.error("nothing to do: pass --smoke")
    work = args.work or Path(tempfile.mkdtemp(prefix="pd-nixl-"))
    work.mkdir(parents=True, exist_ok=True)
    ucx_tls = None if args.ucx_tls == "auto" else args.ucx_tls
    return 0 if smoke(work, args.tokens, args.max_tokens, ucx_tls) else 1


if __name__ == "__main__":
    sys.exit(main())
