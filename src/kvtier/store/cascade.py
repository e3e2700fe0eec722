"""Always-cascade: background writes of committed DRAM shards into one secondary tier (through its
:class:`~kvtier.store.guard.GuardedTier`, which turns the tier's faults into outcomes).

Runs worker threads in the store's process. The caller's thread only enqueues: the queue is bounded, and a
full queue drops the write (counted), never blocks. Workers write from zero-copy views of the DRAM pool; the
entry stays pinned (not evictable) from enqueue until its write ends. A handoff (a disaggregated prefill's KV,
which a decode engine waits for) is written before every ordinary write queued, within a budget of bytes of its
own: ordinary writes never crowd it out.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable

from kvtier import codecs, frame, threads, tracing
from kvtier.config import TierSpec
from kvtier.dram import DramEntry, DramPool
from kvtier.keys import ShardKey
from kvtier.metrics import StoreMetrics
from kvtier.store.guard import GuardedTier

_STOP = None
_HANDOFF, _ORDINARY, _LAST = 0, 1, 2  # queue priorities: handoffs first; a stop after every write
# What seals an object (kvtier.sealing.Sealer.seal): its key, shape, payload (as its codec stores it), creation time
# and codec in, the object's parts (header, ciphertext) out.
Seal = Callable[[ShardKey, frame.ShardMeta, list[memoryview], float | None, codecs.Codec], list[memoryview | bytes]]


class CascadeWriter:
    """A bounded queue and worker threads feeding one tier.

    The queue is bounded twice: by entries (``queue_depth``) and by the bytes they pin in DRAM (``queue_bytes``),
    so a slow tier never holds more than that much of the pool; handoffs by their bytes alone
    (``handoff_queue_bytes``).
    """

    def __init__(self, guard: GuardedTier, pool: DramPool, metrics: StoreMetrics, spec: TierSpec,
                 on_stored: Callable[[ShardKey], None] | None = None, seal: Seal | None = None) -> None:
        self.tier = guard.tier
        self.guard = guard  # the tier's calls and their faults (its write outage)
        self._seal = seal  # encryption on: the parts of a sealed object (kvtier.sealing); else a plain header
        self._on_stored = on_stored  # told of every shard the tier holds after a write (or held already)
        self._pool = pool
        self._metrics = metrics
        # (priority, order, write): each write with the trace context that queued it (None when tracing is off: its
        # span joins that trace) and whether it is a handoff; bounded here, by submit
        self._queue: queue.PriorityQueue[tuple[int, int, tuple[DramEntry, object, bool] | None]] = \
            queue.PriorityQueue()
        self._order = itertools.count()
        self._max_depth = spec.queue_depth
        self._max_bytes = spec.queue_bytes
        self._max_handoff = spec.handoff_queue_bytes
        self._depth = 0  # ordinary entries waiting (queued, not yet taken by a worker)
        self._bytes = 0  # payload bytes of the ordinary entries queued or being written
        self._handoff_bytes = 0  # and of the handoffs
        self._bytes_lock = threading.Lock()
        self._present = metrics.present_writes.labels(guard.name)
        self._closed = False
        self._threads = [threads.start(self._run, f"kvtier-{guard.name}-{i}") for i in range(spec.workers)]

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    @property
    def queued_bytes(self) -> int:
        return self._bytes + self._handoff_bytes

    def submit(self, entry: DramEntry, handoff: bool = False) -> bool:
        """Queue ``entry`` (pinned once on this writer's behalf); False when the queue was full (for a handoff:
        its budget spent)."""
        size = entry.meta.nbytes
        if self._closed:  # no worker would ever take it: the pin would never be released
            self._pool.release(entry)
            return False
        with self._bytes_lock:
            if handoff:  # one handoff always fits
                fits = self._handoff_bytes + size <= self._max_handoff or self._handoff_bytes == 0
                if fits:
                    self._handoff_bytes += size
            else:  # one entry always fits
                fits = self._depth < self._max_depth and (self._bytes + size <= self._max_bytes or self._bytes == 0)
                if fits:
                    self._bytes += size
                    self._depth += 1
        if fits:
            self._queue.put_nowait((_HANDOFF if handoff else _ORDINARY, next(self._order),
                                    (entry, tracing.current(), handoff)))
            return True
        self._pool.release(entry)
        self._metrics.dropped.labels(self.tier.name, "handoff_budget" if handoff else "queue_full").inc()
        return False

    def flush(self) -> None:
        """Wait until every queued write has ended."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, then stop the workers; later submits are dropped (and their pin released)."""
        self._closed = True
        self.flush()
        for _ in self._threads:
            self._queue.put((_LAST, next(self._order), _STOP))
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        while True:
            _, _, item = self._queue.get()
            try:
                if item is _STOP:
                    return
                entry, parent, handoff = item
                if not handoff:
                    with self._bytes_lock:
                        self._depth -= 1  # taken: no longer waiting (its bytes stay pinned until written)
                try:
                    with tracing.span("kvtier.tier.write", parent, tier=self.tier.name, key=entry.key.name,
                                      bytes=entry.meta.nbytes) as span:
                        outcome = self._write(entry)
                        if span is not None:
                            span.set_attribute("outcome", outcome)
                finally:
                    with self._bytes_lock:
                        if handoff:
                            self._handoff_bytes -= entry.meta.nbytes
                        else:
                            self._bytes -= entry.meta.nbytes
                    self._pool.release(entry)
            finally:
                self._queue.task_done()

    def _write(self, entry: DramEntry) -> str:
        """Write one entry; what became of it (written, present, dropped, error)."""
        if self.guard.writes.resting():
            self._metrics.dropped.labels(self.tier.name, "tier_unavailable").inc()
            return "dropped"
        start = time.perf_counter()
        # A chunk computed again (evicted from DRAM, recomputed after a failed load) often is in the tier already,
        # and asking costs one small call where writing costs an upload.
        if self.guard.holds(entry.key):
            self._present.inc()
            outcome = "present"
        else:
            outcome = self.guard.write(entry.key, lambda: self._parts(entry), entry.meta.nbytes, start)
        if outcome != "dropped" and outcome != "error" and self._on_stored is not None:
            self._on_stored(entry.key)
        return outcome

    def _parts(self, entry: DramEntry) -> list[memoryview | bytes]:
        """The object for ``entry``: its payload encoded by the tier's codec (here, on this writer's thread; KV of a
        dtype the codec does not take is stored as it is), then sealed or given a plain header."""
        meta = entry.meta
        codec = self.guard.codec if self.guard.codec.applies(meta.dtype) else codecs.NONE
        payload = codec.encode(meta.shape, meta.dtype, self._pool.views(entry))
        if self._seal is None:
            return [frame.encode_header(entry.key, meta, payload, created=entry.created, codec=codec), *payload]
        return self._seal(entry.key, meta, payload, entry.created, codec)
