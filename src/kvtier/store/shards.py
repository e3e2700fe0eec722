"""Reading one shard from a secondary tier and verifying it: as bytes (:meth:`ShardReads.get`), or straight into
the DRAM entry reserved for it (:meth:`ShardReads.read_into`). Moves and checks bytes; decides nothing. Runs on
the caller's thread or a reading thread of the store's process."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier import frame
from kvtier.dram import DramEntry, DramPool
from kvtier.keys import ShardKey
from kvtier.metrics import StoreMetrics
from kvtier.store.guard import GuardedTier
from kvtier.store.plan import Fetched


def raised(got: bytes | Exception | None) -> bytes | None:
    """One answer of :meth:`Tier.get_into_many`: the exception it holds raised, else itself."""
    if isinstance(got, Exception):
        raise got
    return got


class ShardReads:
    """How shards are read: the frame header's length, and the opener of sealed objects (None: plain)."""

    def __init__(self, dram: DramPool, metrics: StoreMetrics, opener: frame.Opener | None) -> None:
        self._dram = dram
        self._metrics = metrics
        self._opener = opener
        self.header_len = frame.HEADER_LEN if opener is None else frame.SEALED_HEADER_LEN
        self.plain = opener is None  # shards are checked by their checksum (else opened: decrypted whole)

    def get(self, guard: GuardedTier, key: ShardKey) -> Fetched | None:
        """Read and verify one shard (on any thread); raises what the tier or the check raises."""
        start = time.perf_counter()
        blob = guard.tier.get(key)
        if blob is None:
            return None
        header, payload = frame.decode(blob, expected=key, opener=self._opener)
        return Fetched(header, payload, len(blob), time.perf_counter() - start)

    def read_into(self, guard: GuardedTier, key: ShardKey, entry: DramEntry,
                  fetched: Callable[[], bytes | None] | None = None, start: float | None = None) -> float | None:
        """Read one shard into a reserved DRAM entry and verify it there; its creation time, or None (missing,
        corrupt or unreadable: counted by the guard; the entry is not aborted here). ``fetched``: the shard's
        header, read into the entry already (by a batch, or by a sealed read ahead, started at ``start``),
        instead of a read here."""
        start = time.perf_counter() if start is None else start

        def read() -> frame.Header | None:
            views = self._dram.views(entry)
            head = guard.tier.get_into(key, self.header_len, views) if fetched is None else fetched()
            if head is None:
                return None
            header = frame.verify(head, views, expected=key, opener=self._opener)  # decrypts there
            if header.meta != entry.meta:
                raise frame.FrameError(f"holds {header.meta.shape} {header.meta.dtype}, expected {entry.meta.shape} "
                                       f"{entry.meta.dtype}")
            guard.check_age(header)
            return header

        header = guard.read(key, read)
        if header is None:
            return None
        self._metrics.tier_read_seconds.labels(guard.name).observe(time.perf_counter() - start)
        self._metrics.bytes_read.labels(guard.name).inc(self.header_len + entry.meta.nbytes)
        return header.created
