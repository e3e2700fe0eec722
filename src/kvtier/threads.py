"""Daemon threads for work that may wait on a network (background lookups, asynchronous loads, read-ahead).

Daemon threads, because a call stuck on a stalled server must never hold up the engine's exit; a bounded queue,
because a stalled server must not grow memory without end: a full queue refuses (``queue.Full``) and the caller
decides what that means (an inline answer, counted).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvtier import tracing


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

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        """Queue ``job``; raises ``queue.Full`` when the queue is bounded and full. A future cancelled before a
        thread takes it never runs."""
        future: Future[Any] = Future()
        with self._lock:  # one section with close's: a job queued here comes before close's end marks
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after close (no thread would run it)")
            self._queue.put_nowait((future, tracing.carried(job)))  # its spans join the submitter's trace
            if not self._threads:
                self._threads = [threading.Thread(target=self._run, name=f"{self._name}-{i}", daemon=True)
                                 for i in range(self._size)]
                for thread in self._threads:
                    thread.start()
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, job = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:  # handed to whoever holds the future
                    future.set_exception(exc)

    def close(self, wait: float = 0.0) -> bool:
        """Let the threads end once the queue is drained, waiting up to ``wait`` seconds for them (a thread stuck
        in a call ends with the process); whether they all ended."""
        with self._lock:
            self._closed = True
        for _ in self._threads:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                break
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)
