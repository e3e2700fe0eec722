"""Lookups for the scheduler that never wait on a network.

DRAM, the workers' DRAM (as they report it) and local tiers (a disk's index) answer inline. When a tier across
a network (Redis, S3, Mooncake) could hold more, the whole lookup runs on a background thread and the scheduler
is told to ask again (``None``, vLLM's "cannot tell yet": the request waits, the others are scheduled); the
answer is used on the first call after it arrives. If it has not arrived within ``timeout`` seconds the request
proceeds with the inline answer, so a stalled server delays only the requests that needed it, and by a bound.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from prometheus_client import Counter

from kvtier.keys import Namespace
from kvtier.store import KVStore

log = logging.getLogger("kvtier.integrations.vllm")
_THREADS = 4  # lookups in flight at once; a stalled tier rests after its first failure, so few are enough


@dataclasses.dataclass
class _Pending:
    namespace: Namespace
    tokens: list[int]
    future: Future[int]
    deadline: float  # monotonic
    inline: int  # what DRAM and local tiers hold: the answer if the background one is late


class Lookups:
    """Tokens (whole chunks) the store holds for a request's prefix, answered without waiting on a network."""

    def __init__(self, store: KVStore, kv_heads: int, elsewhere: Callable[[str, str], bool], timeout: float,
                 outcomes: Counter) -> None:
        self._store = store
        self._kv_heads = kv_heads
        self._elsewhere = elsewhere
        self._timeout = timeout
        self._pending: dict[str, _Pending] = {}
        self._pool: ThreadPoolExecutor | None = None  # started on the first lookup that needs it
        self.outcomes = outcomes

    def held(self, request_id: str, ns: Namespace, tokens: list[int]) -> int | None:
        """Leading tokens held, or None while a background lookup for this request is under way."""
        pending = self._pending.get(request_id)
        if pending is not None and (pending.namespace != ns or pending.tokens != tokens):
            self.forget(request_id)  # asked about other tokens (e.g. resumed with output): start again
            pending = None
        if pending is not None:
            if pending.future.done():
                del self._pending[request_id]
                self.outcomes.labels("answered").inc()
                try:
                    return max(pending.future.result(), pending.inline)
                except Exception as exc:  # lookup never raises for a tier's fault; a bug is still a miss
                    log.warning("kvtier: background lookup for request %s failed: %s", request_id, exc)
                    return pending.inline
            if time.monotonic() < pending.deadline:
                return None
            del self._pending[request_id]
            self.outcomes.labels("timed_out").inc()
            self._store.count_lookup(len(tokens), pending.inline)
            return pending.inline
        if not self._store.remote_tiers:
            return self._store.lookup(ns, tokens, kv_heads=self._kv_heads, elsewhere=self._elsewhere)
        inline = self._store.lookup(ns, tokens, kv_heads=self._kv_heads, elsewhere=self._elsewhere, local_only=True)
        if inline == len(tokens) // self._store.chunk_tokens * self._store.chunk_tokens:
            self._store.count_lookup(len(tokens), inline)
            return inline  # nothing more to find
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="kvtier-lookup")
        future = self._pool.submit(self._store.lookup, ns, tokens, kv_heads=self._kv_heads,
                                   elsewhere=self._elsewhere)
        self._pending[request_id] = _Pending(ns, tokens, future, time.monotonic() + self._timeout, inline)
        return None

    def forget(self, request_id: str) -> None:
        """Drop a request's background lookup (it runs to its end; its answer is not used)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.future.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
