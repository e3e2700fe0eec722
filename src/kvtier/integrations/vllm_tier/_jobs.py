"""The tier's transfer jobs, run on kvtier's threads (scheduler process): vLLM's scheduler submits them and polls
for their results, never waiting on one.

Loads go before stores (a load is a request waiting for its prefix; a store only copies rows out of vLLM's
primary tier into kvtier's DRAM, from where kvtier's own cascade writes the tiers). A job's run never raises out
of here: an exception is its failure (logged once per kind; vLLM counts failed jobs), reported like any other.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from kvtier import threads
from kvtier.health import FirstOfKind

log = logging.getLogger("kvtier.integrations.vllm_tier")

LOAD, STORE = 0, 1  # queue priorities
_STOP = 2
J = TypeVar("J")  # a submitted job
R = TypeVar("R")  # its result


class Jobs(Generic[J, R]):
    """A queue of jobs, ``workers`` threads running them, and the results not yet taken.

    ``run(job)`` does a job and returns its result; ``failed(job, exc)`` is the result of a job whose run raised.
    """

    def __init__(self, run: Callable[[J], R], failed: Callable[[J, BaseException], R], workers: int,
                 name: str) -> None:
        self._run = run
        self._failed = failed
        self._queue: queue.PriorityQueue[tuple[int, int, J | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._results: list[R] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._open = 0  # jobs submitted whose result is not yet in _results
        self._logged = FirstOfKind()
        self._closed = False
        self._threads = [threads.start(self._work, f"{name}-{i}") for i in range(workers)]

    def submit(self, job: J, priority: int) -> None:
        """Queue ``job``; after :meth:`close`, it fails at once (its result is still reported)."""
        with self._lock:
            self._open += 1
            closed = self._closed
        if closed:
            self._finish(self._failed(job, RuntimeError("the tier is shut down")))
            return
        self._queue.put((priority, next(self._order), job))

    def take(self) -> list[R]:
        """The results of the jobs ended since the last call."""
        with self._lock:
            out, self._results = self._results, []
        return out

    @property
    def pending(self) -> bool:
        """Whether a job is queued or running, or its result not yet taken."""
        with self._lock:
            return self._open > 0 or bool(self._results)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted has ended (results are kept for :meth:`take`); False on a timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Run what is queued, then stop the threads; later submits fail at once."""
        with self._lock:
            self._closed = True
        for _ in self._threads:
            self._queue.put((_STOP, next(self._order), None))
        for thread in self._threads:
            thread.join()

    def _work(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            try:
                result = self._run(job)
            except Exception as exc:  # the job's failure, reported to vLLM (logged once per kind)
                if self._logged.first(type(exc).__name__):
                    log.warning("kvtier tier: a transfer job failed (%s: %s); later failures of this kind are only "
                                "counted", type(exc).__name__, exc, exc_info=exc)
                result = self._failed(job, exc)
            self._finish(result)

    def _finish(self, result: R) -> None:
        with self._idle:
            self._results.append(result)
            self._open -= 1
            self._idle.notify_all()
