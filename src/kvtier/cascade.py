"""Always-cascade: background writes of committed DRAM shards into one secondary tier.

Runs worker threads in the store's process. The caller's thread only enqueues: the queue is bounded, and a
full queue drops the write (counted), never blocks. Workers write from zero-copy views of the DRAM pool; the
entry stays pinned (not evictable) from enqueue until its write ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from kvtier import frame, threads, tracing
from kvtier.config import TierSpec
from kvtier.dram import DramEntry, DramPool
from kvtier.errors import QuotaFull, SealError, TierError
from kvtier.health import Outage
from kvtier.keys import ShardKey
from kvtier.metrics import StoreMetrics
from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)
_STOP = None
# What seals an object (kvtier.sealing.Sealer.seal): its key, shape, payload views and creation time in, the
# object's parts (header, ciphertext) out.
Seal = Callable[[ShardKey, frame.ShardMeta, list[memoryview], float | None], list[memoryview | bytes]]


class CascadeWriter:
    """A bounded queue and worker threads feeding one tier.

    The queue is bounded twice: by entries (``queue_depth``) and by the bytes they pin in DRAM (``queue_bytes``),
    so a slow tier never holds more than that much of the pool.
    """

    def __init__(self, tier: Tier, pool: DramPool, metrics: StoreMetrics, spec: TierSpec,
                 on_stored: Callable[[ShardKey], None] | None = None, seal: Seal | None = None) -> None:
        self.tier = tier
        self._seal = seal  # encryption on: the parts of a sealed object (kvtier.sealing); else a plain header
        self._on_stored = on_stored  # told of every shard the tier holds after a write (or held already)
        self._pool = pool
        self._metrics = metrics
        # Each write with the trace context that queued it (None when tracing is off): its span joins that trace.
        self._queue: queue.Queue[tuple[DramEntry, object] | None] = queue.Queue(maxsize=spec.queue_depth)
        self._max_bytes = spec.queue_bytes
        self._bytes = 0  # payload bytes of the entries queued or being written
        self._bytes_lock = threading.Lock()
        self._outage = Outage(tier.name, "writes", spec.retry_seconds, metrics)
        self._present = metrics.present_writes.labels(tier.name)
        self._exists_failed = False  # logged once
        self._closed = False
        self._threads = [threads.start(self._run, f"kvtier-{tier.name}-{i}") for i in range(spec.workers)]

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def submit(self, entry: DramEntry) -> bool:
        """Queue ``entry`` (pinned once on this writer's behalf); False when the queue was full."""
        size = entry.meta.nbytes
        if self._closed:  # no worker would ever take it: the pin would never be released
            self._pool.release(entry)
            return False
        with self._bytes_lock:
            fits = self._bytes + size <= self._max_bytes or self._bytes == 0  # one entry always fits
            if fits:
                self._bytes += size
        if fits:
            try:
                self._queue.put_nowait((entry, tracing.current()))
                return True
            except queue.Full:
                with self._bytes_lock:
                    self._bytes -= size
        self._pool.release(entry)
        self._metrics.dropped.labels(self.tier.name, "queue_full").inc()
        return False

    def flush(self) -> None:
        """Wait until every queued write has ended."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, then stop the workers; later submits are dropped (and their pin released)."""
        self._closed = True
        self.flush()
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                entry, parent = item
                try:
                    with tracing.span("kvtier.tier.write", parent, tier=self.tier.name, key=entry.key.name,
                                      bytes=entry.meta.nbytes) as span:
                        outcome = self._write(entry)
                        if span is not None:
                            span.set_attribute("outcome", outcome)
                finally:
                    with self._bytes_lock:
                        self._bytes -= entry.meta.nbytes
                    self._pool.release(entry)
            finally:
                self._queue.task_done()

    def _present_in_tier(self, entry: DramEntry) -> bool:
        """Whether the tier holds the object already: a chunk computed again (evicted from DRAM, recomputed after
        a failed load) often is, and asking costs one small call where writing costs an upload. Only advice: if
        asking fails, the write goes ahead (and reports any real outage itself)."""
        try:
            return self.tier.exists(entry.key) is True
        except Exception as exc:  # noqa: BLE001 only advice (the docstring), counted and logged once
            # e.g. one malformed object (ObjectError) that the write will replace
            self._metrics.read_errors.labels(self.tier.name).inc()
            if not self._exists_failed:
                self._exists_failed = True
                log.warning("tier %s: asking whether %s is stored failed (%s: %s); writing it anyway (further "
                            "such failures are counted, not logged)", self.tier.name, entry.key.name,
                            type(exc).__name__, exc)
            return False

    def _write(self, entry: DramEntry) -> str:
        """Write one entry; what became of it (written, present, dropped, error)."""
        if self._outage.resting():
            self._metrics.dropped.labels(self.tier.name, "tier_unavailable").inc()
            return "dropped"
        start = time.perf_counter()
        if self._present_in_tier(entry):
            self._present.inc()
            if self._on_stored is not None:
                self._on_stored(entry.key)
            return "present"
        try:
            views = self._pool.views(entry)
            parts: list[memoryview | bytes]
            if self._seal is None:
                parts = [frame.encode_header(entry.key, entry.meta, views, created=entry.created), *views]
            else:
                parts = self._seal(entry.key, entry.meta, views, entry.created)
            self.tier.put(entry.key, parts)
        except SealError as exc:  # its tenant was forgotten since the put: nothing may be written under it
            self._metrics.dropped.labels(self.tier.name, "no_tenant_key").inc()
            log.info("tier %s: not writing %s: %s", self.tier.name, entry.key.name, exc)
            return "dropped"
        except QuotaFull:  # the tenant's share holds only its recent shards (its own prompt's leading chunks)
            self._metrics.dropped.labels(self.tier.name, "share_full").inc()
            self._outage.succeeded()  # the tier answered
            return "dropped"
        except TierError as exc:
            self._metrics.write_errors.labels(self.tier.name).inc()
            self._outage.failed(exc)
            return "error"
        except Exception as exc:  # a bug in a plugin tier must not kill the worker silently
            self._metrics.write_errors.labels(self.tier.name).inc()
            log.exception("tier %s: unexpected error writing %s", self.tier.name, entry.key.name)
            self._outage.failed(exc)
            return "error"
        self._outage.succeeded()
        self._metrics.tier_write_seconds.labels(self.tier.name).observe(time.perf_counter() - start)
        self._metrics.bytes_written.labels(self.tier.name).inc(len(parts[0]) + entry.meta.nbytes)
        if self._on_stored is not None:
            self._on_stored(entry.key)
        return "written"
