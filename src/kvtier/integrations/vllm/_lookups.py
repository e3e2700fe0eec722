"""Lookups for the scheduler that never wait on a network.

DRAM, the workers' DRAM (as they report it) and local tiers (a disk's index) answer inline. When a tier across
a network (Redis, S3, Mooncake) could hold more, the whole lookup runs on a background thread and the scheduler
is told to ask again (``None``, vLLM's "cannot tell yet": the request waits, the others are scheduled). The
answer is kept for the request until vLLM allocates its blocks (it may ask several times before it can), the
request ends or asks about other tokens. If the answer has not come within ``timeout`` seconds, the request goes
on with the inline answer, so a stalled server delays only the requests that needed it, and by a bound. At most
:data:`MAX_QUEUED` lookups wait for a thread; beyond that a request gets the inline answer at once (counted).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from prometheus_client import Counter

from kvtier.keys import Namespace
from kvtier.store import KVStore
from kvtier.threads import DaemonPool

log = logging.getLogger("kvtier.integrations.vllm")
THREADS = 4  # lookups in flight at once; a stalled tier rests after its first failure, so few are enough
MAX_QUEUED = 64


@dataclasses.dataclass(frozen=True)
class Held:
    """Leading tokens (whole chunks, then perhaps a tail) the store holds for a prefix; ``local`` of them load
    without waiting on a network (DRAM, the workers' DRAM, local tiers): a load of more than those may wait on a
    server."""

    tokens: int
    local: int


@dataclasses.dataclass
class _Pending:
    namespace: Namespace
    tokens: list[int]
    future: Future[int]
    deadline: float  # monotonic
    inline: int  # what DRAM and local tiers hold: the answer if the background one is late
    answer: Held | None = None  # kept once known, until the request's blocks are allocated


class Lookups:
    """Tokens the store holds for a request's prefix, answered without waiting on a network: whole chunks, and
    with ``tail_block`` (the engine's block size) a tail of whole blocks after them."""

    def __init__(self, store: KVStore, kv_heads: int, elsewhere: Callable[[str, str], bool], timeout: float,
                 outcomes: Counter, tail_block: int | None = None) -> None:
        self._store = store
        self._tail_block = tail_block
        self._kv_heads = kv_heads
        self._elsewhere = elsewhere
        self._timeout = timeout
        self._outcomes = outcomes
        self._pending: dict[str, _Pending] = {}
        self._pool = DaemonPool("kvtier-lookup", THREADS, MAX_QUEUED)

    def _reported(self) -> Callable[[str, str], bool] | None:
        # A worker in this process fills this store's DRAM, which is then exact; the workers' reports are a step
        # old and would promise chunks evicted since (vLLM's API server has no worker here: reports are all).
        return None if self._store.dram.allocated else self._elsewhere

    def held(self, request_id: str, ns: Namespace, tokens: list[int]) -> Held | None:
        """Leading tokens held, or None while a background lookup for this request is under way."""
        pending = self._pending.get(request_id)
        if pending is not None and (pending.namespace != ns or pending.tokens != tokens):
            self.forget(request_id)  # asked about other tokens (e.g. resumed with output): start again
            pending = None
        if pending is not None:
            if pending.answer is not None:
                return pending.answer
            if pending.future.done():
                try:
                    pending.answer = Held(max(pending.future.result(), pending.inline), pending.inline)
                    self._outcomes.labels("answered").inc()
                except Exception as exc:  # noqa: BLE001 lookup never raises for a tier's fault; a bug is still a miss (logged)
                    log.warning("kvtier: background lookup for request %s failed: %s", request_id, exc)
                    pending.answer = Held(pending.inline, pending.inline)
            elif time.monotonic() >= pending.deadline:
                pending.future.cancel()  # if it has not started, it never reaches the tier
                pending.answer = Held(pending.inline, pending.inline)
                self._outcomes.labels("timed_out").inc()
            else:
                return None
            self._store.count_lookup(len(tokens), pending.answer.tokens)
            return pending.answer
        kv_heads, elsewhere, tail_block = self._kv_heads, self._reported(), self._tail_block
        if not self._store.remote_tiers:
            local = self._store.lookup(ns, tokens, kv_heads=kv_heads, elsewhere=elsewhere, tail_block=tail_block)
            return Held(local, local)
        inline = self._store.lookup(ns, tokens, kv_heads=kv_heads, elsewhere=elsewhere, local_only=True,
                                    tail_block=tail_block)
        if inline >= len(tokens) // self._store.chunk_tokens * self._store.chunk_tokens:
            # Nothing more to find, or at most a tail (stored with its chunks, so where they are: not worth a
            # step's wait for a prompt that merely ends past them)
            self._store.count_lookup(len(tokens), inline)
            return Held(inline, inline)
        try:
            future = self._pool.submit(lambda: self._store.lookup(ns, tokens, kv_heads=kv_heads, elsewhere=elsewhere,
                                                                  count=False, tail_block=tail_block))
        except queue.Full:
            self._outcomes.labels("dropped").inc()
            self._store.count_lookup(len(tokens), inline)
            return Held(inline, inline)
        self._pending[request_id] = _Pending(ns, tokens, future, time.monotonic() + self._timeout, inline)
        return None

    @property
    def running(self) -> bool:
        """Whether a background lookup is under way."""
        return bool(self._under_way())

    def _under_way(self) -> list[Future[int]]:
        return [p.future for p in self._pending.values() if p.answer is None and not p.future.done()]

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` for any background lookup still under way to end (the GIL is free meanwhile)."""
        running = self._under_way()
        if running:
            wait(running, timeout, FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        """Drop a request's lookup and answer (its blocks are allocated, it ended, or it asks anew)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.future.cancel()

    def close(self) -> None:
        for pending in self._pending.values():
            pending.future.cancel()
        self._pending.clear()
        self._pool.close()
