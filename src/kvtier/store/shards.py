"""Reading one shard from a secondary tier and verifying it: as bytes (:meth:`ShardReads.get`), or straight into
the DRAM entry reserved for it (:meth:`ShardReads.read_into`). Moves and checks bytes; decides nothing. Runs on
the caller's thread or a reading thread of the store's process."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier import codecs, frame
from kvtier.dram import DramEntry, DramPool
from kvtier.errors import WrongSize
from kvtier.keys import ShardKey
from kvtier.metrics import StoreMetrics
from kvtier.store.guard import GuardedTier
from kvtier.store.plan import Fetched
from kvtier.tiers.base import Ranges

log = logging.getLogger("kvtier.store")


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
        self._scratch = threading.local()  # each reading thread's buffer for objects stored with a codec

    def get(self, guard: GuardedTier, key: ShardKey) -> Fetched | None:
        """Read and verify one shard (on any thread), decoded by its codec into a buffer of its own; raises what the
        tier or the check raises."""
        start = time.perf_counter()
        blob = guard.tier.get(key)
        if blob is None:
            return None
        header, payload = frame.decode(blob, expected=key, opener=self._opener, accepts=guard.accepts)
        return Fetched(header, frame.decoded(header, payload), len(blob), time.perf_counter() - start)

    def read_into(self, guard: GuardedTier, key: ShardKey, entry: DramEntry,
                  fetched: Callable[[], bytes | None] | None = None, start: float | None = None) -> float | None:
        """Read one shard into a reserved DRAM entry and verify it there; its creation time, or None (missing,
        corrupt or unreadable: counted by the guard; the entry is not aborted here). ``fetched``: the shard's
        header, read into the entry already (by a batch, or by a sealed read ahead, started at ``start``),
        instead of a read here. A tier with a codec, and an object stored with one (its size not the shard's, or
        by chance the same), are read into a buffer and decoded into the entry from there (:meth:`_coded`)."""
        start = time.perf_counter() if start is None else start

        def read() -> frame.Header | None:
            if guard.coded and fetched is None:
                return self._coded(guard, key, entry, None)
            views = self._dram.views(entry)
            try:
                head = guard.tier.get_into(key, self.header_len, views) if fetched is None else fetched()
            except WrongSize as exc:  # its size is not the shard's: encoded, or malformed
                return self._coded(guard, key, entry, exc.size)
            if head is None:
                return None
            header = frame.verify(head, views, expected=key, opener=self._opener, accepts=guard.accepts)
            if header.codec is not codecs.NONE:  # as long as the shard by chance: its bytes are no KV
                return self._coded(guard, key, entry, header.length + header.payload_len)
            self._check(guard, header, entry)
            return header

        header = guard.read(key, read)
        if header is None:
            return None
        self._metrics.tier_read_seconds.labels(guard.name).observe(time.perf_counter() - start)
        self._metrics.bytes_read.labels(guard.name).inc(header.length + header.payload_len)
        return header.created

    def _coded(self, guard: GuardedTier, key: ShardKey, entry: DramEntry, size: int | None,
               again: bool = True) -> frame.Header | None:
        """Read an object stored with a codec into this thread's buffer, verify it there, and decode it straight into
        ``entry``'s pages (no buffer the shard's size); the entry is marked with a lossy codec it came from. The
        object is ``size`` bytes (as the tier said), else the size the tier's own codec stores the shard in (the
        most, for a codec whose size varies: a tier answering WrongSize is asked ``again`` at the size it gives).
        An object larger than any codec this tier accepts stores the shard in is corrupt, never read."""
        meta = entry.meta
        most = self.header_len + max(c.max_len(meta.shape, meta.dtype) for c in guard.accepts)
        own = guard.codec if guard.codec.applies(meta.dtype) else codecs.NONE  # (what the tier stored it as)
        want = self.header_len + own.max_len(meta.shape, meta.dtype) if size is None else size
        if not self.header_len < want <= most:
            raise frame.FrameError(f"{key.name} is {want} bytes; this tier's codecs store its shard in "
                                   f"{self.header_len + 1} to {most}")
        buf = self._buffer(want - self.header_len)
        try:
            head = guard.tier.get_into(key, self.header_len, [buf])
        except WrongSize as exc:
            if not again or (size is not None and exc.size == size):
                # Replaced between two reads (another writer, another codec): a miss, not a bad object to remove.
                log.debug("tier %s: %s changed size while it was read (%s): a miss", guard.name, key.name, exc)
                return None
            return self._coded(guard, key, entry, exc.size, again=False)
        if head is None:
            return None
        header = frame.verify(head, [buf], expected=key, opener=self._opener, accepts=guard.accepts)
        self._check(guard, header, entry)
        frame.decode_into(header, buf, self._dram.views(entry))
        entry.codec = codecs.NONE if header.codec.exact else header.codec
        return header

    def _buffer(self, nbytes: int) -> memoryview:
        """This thread's read buffer, ``nbytes`` of it (grown, never shrunk: a reading thread reads shards of a few
        shapes)."""
        buf: memoryview | None = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = memoryview(bytearray(nbytes))
            self._scratch.buf = buf
        return buf[:nbytes]

    def open_ranges(self, guard: GuardedTier, key: ShardKey, entry: DramEntry) -> tuple[Ranges, frame.Header] | None:
        """Open one plain shard's file for reads of its payload in pieces, its header checked (for a load by layers,
        into ``entry``); None when it is missing. :class:`WrongSize` when the object is not the shard as it is
        (its size, or its codec: to be read whole), and what the checks raise; the file is closed on any raise."""
        ranges = guard.tier.open_ranges(key, self.header_len, entry.meta.nbytes)
        if ranges is None:
            return None
        try:
            header = frame.decode_header(ranges.header)
            if header.key != key:
                raise frame.FrameError(f"object holds {header.key.name}, expected {key.name}")
            if header.sealing is not None:
                raise frame.UnknownKey("sealed, and this store has no encryption key")
            if header.codec is not codecs.NONE:  # (as long as the shard by chance)
                raise WrongSize(f"{guard.name}: {key.name} is stored with codec {header.codec.name}",
                                header.length + header.payload_len)
            if header.payload_len != entry.meta.nbytes:
                raise frame.FrameError(f"payload length {header.payload_len}, expected {entry.meta.nbytes}")
            self._check(guard, header, entry)
        except BaseException:
            ranges.close()
            raise
        return ranges, header

    @staticmethod
    def _check(guard: GuardedTier, header: frame.Header, entry: DramEntry) -> None:
        if header.meta != entry.meta:
            raise frame.FrameError(f"holds {header.meta.shape} {header.meta.dtype}, expected {entry.meta.shape} "
                                   f"{entry.meta.dtype}")
        guard.check_age(header)
