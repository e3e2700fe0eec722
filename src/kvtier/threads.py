"""kvtier's own threads: where they run, and daemon pools for work that may wait on a network (background
lookups, asynchronous loads, read-ahead).

Every thread kvtier starts goes through :func:`start` (or an executor's ``initializer=``:func:`entered`), and
libraries' threads it starts (the metrics server's, the span exporter's) through :func:`call`: each is named in
the OS (``top -H``, ``/proc/PID/task/*/comm``) and runs on the CPUs :func:`run_on` set, if any. An
engine that pins its computing threads to cores (vLLM on CPU pins each worker's OpenMP threads) also pins every
thread started from them, kvtier's included, so that reading, decrypting and writing KV would share the
engine's compute cores; the vLLM connector therefore moves kvtier's threads off them (:func:`spare_cpus`).

Daemon threads, because a call stuck on a stalled server must never hold up the engine's exit; a bounded queue,
because a stalled server must not grow memory without end: a full queue refuses (``queue.Full``) and the caller
decides what that means (an inline answer, counted).
"""

from __future__ import annotations

import glob
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from kvtier import tracing
from kvtier._threadstart import call, cpu_list, entered, placed_on, run_on, start

__all__ = ["IDLE_WAIT_SECONDS", "DaemonPool", "call", "cpu_list", "entered", "placed_on", "run_on", "spare_cpus",
           "start", "topology"]


def spare_cpus(environ: Mapping[str, str], allowed: set[int], current: set[int], *,
               siblings: Mapping[int, set[int]] | None = None,
               nodes: list[set[int]] | None = None) -> frozenset[int] | None:
    """The CPUs of ``allowed`` that an engine binding its OpenMP threads leaves free: None where this process is
    not bound that way, or none are left.

    ``environ`` is the process's environment: the cores its OpenMP threads are bound to come from ``OMP_PLACES``
    (unless ``OMP_PROC_BIND`` is false), ``GOMP_CPU_AFFINITY`` or ``KMP_AFFINITY``'s ``proclist``, as vLLM sets
    them for each CPU worker. Only where vLLM chose them itself (``VLLM_CPU_OMP_THREADS_BIND`` unset or
    ``auto``): cores a user listed may be one of several engines' on the host, and the others' cores would look
    free from here. ``allowed`` is where the process may run (the engine process that started it: the worker's
    own threads are bound already); ``current`` the calling thread's CPUs, which must be the bound cores: the
    binding took effect. Of the rest, a CPU that shares a physical core with a bound one (``siblings``: SMT
    threads by CPU) is not free, and only CPUs of the NUMA ``nodes`` the bound cores are on are taken (near the
    memory they use)."""
    if environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") not in ("auto", ""):
        return None
    bound = _omp_cpus(environ)
    if bound is None or not current or not current <= bound or not bound <= allowed:
        return None
    busy = bound | {sibling for cpu in bound for sibling in (siblings or {}).get(cpu, ())}
    spare = allowed - busy
    near = [node for node in nodes or [] if node & bound]
    if near:
        spare &= set().union(*near)
    return frozenset(spare) or None


def topology() -> tuple[dict[int, set[int]], list[set[int]]]:
    """This machine's SMT siblings by CPU and its NUMA nodes' CPUs, from ``/sys`` (empty where not readable)."""
    siblings: dict[int, set[int]] = {}
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list"):
        try:
            cpu = int(path.split("/")[5].removeprefix("cpu"))
            with open(path) as f:
                siblings[cpu] = set(_id_list(f.read().strip()))
        except (OSError, ValueError):
            continue
    nodes = []
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                nodes.append(set(_id_list(text)))
        except (OSError, ValueError):
            continue
    return siblings, nodes


def _omp_cpus(environ: Mapping[str, str]) -> set[int] | None:
    try:
        places = environ.get("OMP_PLACES", "").replace(" ", "")
        if places:
            # libgomp binds by default once places are given; a list (spread,close) begins with the outer level
            if environ.get("OMP_PROC_BIND", "true").split(",")[0].strip().lower() == "false":
                return None
            if not re.fullmatch(r"\{[^{}]*\}(,\{[^{}]*\})*", places):  # abstract names, replicated places
                return None
            cpus: set[int] = set()
            for place in re.findall(r"\{([^}]*)\}", places):
                for item in place.split(","):
                    start, _, rest = item.partition(":")
                    count, _, stride = rest.partition(":")
                    step = int(stride or 1)
                    cpus.update(range(int(start), int(start) + int(count or 1) * step, step))
            return cpus or None
        gomp = environ.get("GOMP_CPU_AFFINITY", "")
        if gomp:
            cpus = set()
            for item in gomp.replace(",", " ").split():
                span, _, stride = item.partition(":")
                first, _, last = span.partition("-")
                cpus.update(range(int(first), int(last or first) + 1, int(stride or 1)))
            return cpus or None
        kmp = re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))
        if kmp:
            return set(_id_list(kmp.group(1))) or None
    except ValueError:  # a form not parsed here (OMP_PLACES=cores, ...): not knowing, kvtier leaves it
        return None
    return None


def _id_list(text: str) -> list[int]:
    """``5,2-4`` -> [5, 2, 3, 4]; raises ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


# In an engine step that runs no model, how long the connector waits for its background work (a lookup, an
# asynchronous load) to end. vLLM steps again at once, in a loop that holds the GIL; a background thread, which
# takes the GIL back after every socket read, then waited up to the switch interval each time (measured: a
# 16-chunk Redis load took 3.7 s instead of 0.1 s).
IDLE_WAIT_SECONDS = 0.01


class DaemonPool:
    """``threads`` daemon threads started on the first submit, over a queue of at most ``max_queued`` jobs (0:
    unbounded)."""

    def __init__(self, name: str, threads: int, max_queued: int = 0) -> None:
        self._name = name
        self._size = threads
        self._queue: queue.Queue[tuple[Future[Any], Callable[[], Any]] | None] = queue.Queue(maxsize=max_queued)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pending = 0  # jobs queued or under way
        self._idle = threading.Condition(self._lock)

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        """Queue ``job``; raises ``queue.Full`` when the queue is bounded and full. A future cancelled before a
        thread takes it never runs."""
        future: Future[Any] = Future()
        with self._lock:  # one section with close's: a job queued here comes before close's end marks
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after close (no thread would run it)")
            if not self._threads:  # started before the job is queued: a failed start leaves nothing to run later
                self._threads = [start(self._run, f"{self._name}-{i}") for i in range(self._size)]
            self._queue.put_nowait((future, tracing.carried(job)))  # its spans join the submitter's trace
            self._pending += 1
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, job = item
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(job())
                    except BaseException as exc:  # noqa: BLE001 handed to whoever holds the future
                        future.set_exception(exc)
            finally:
                self._ended()

    def _ended(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def close(self, wait: float = 0.0, cancel: bool = False) -> bool:
        """:meth:`stop`, then wait up to ``wait`` seconds for the jobs under way (a thread stuck in a call ends with
        the process); whether none is under way any more (every job queued has been run or cancelled)."""
        self.stop(cancel)
        return self.wait_idle(wait)

    def wait_idle(self, wait: float) -> bool:
        """Wait up to ``wait`` seconds until the queue is drained and no job is under way; whether that came."""
        deadline = time.monotonic() + wait
        with self._idle:
            while self._pending and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            return not self._pending

    def stop(self, cancel: bool = False) -> None:
        """Take no more jobs and let the threads end once the queue is drained; with ``cancel``, the jobs still
        queued are cancelled instead of run (their futures' callbacks run now). Never waits."""
        with self._lock:
            self._closed = True
        while cancel:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
                self._ended()
        for _ in self._threads:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                break
