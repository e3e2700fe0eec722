"""Every call the store makes to a secondary tier, with its faults contained: the only place a tier's exception
becomes an outcome (a miss, a removal, an outage, a dropped write), counted and logged as :mod:`kvtier.health`
says. Runs in the store's process, on whatever thread calls (the caller's, a reading or a cascade thread)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier import codecs, frame, tracing
from kvtier.health import Fault, FirstOfKind, Outage, classify
from kvtier.keys import HeadRange, ShardKey
from kvtier.metrics import StoreMetrics
from kvtier.recent import RecentMap
from kvtier.tiers.base import Tier

log = logging.getLogger("kvtier.store")
# The cascade's lines (writes, and both outages) keep the logger they have always had: filters name it.
cascade_log = logging.getLogger("kvtier.cascade")
_R = TypeVar("_R")
_UNOPENED_SECONDS = 60.0  # how long a shard under a key this process lacks is taken as absent (then read again)
_UNOPENED_KEPT = 65536  # per tier
_FUTURE_SECONDS = 300.0  # a shard written further ahead than this (a clock gone wrong, a forged time) is expired
Parts = Sequence[memoryview | bytes]


class Expired(Exception):
    """A shard read from a tier is older than the tier's ``ttl_seconds``."""


def valid_range(rng: object) -> bool:
    return isinstance(rng, HeadRange) and 0 <= rng.start < rng.stop <= rng.total


class GuardedTier:
    """One secondary tier as the store calls it. Reads and writes each have an :class:`Outage`: while one rests,
    reads are misses and writes are dropped without a call."""

    def __init__(self, tier: Tier, retry_seconds: float, metrics: StoreMetrics, logged: FirstOfKind,
                 codec: codecs.Codec = codecs.NONE, accepts: frozenset[codecs.Codec] | None = None) -> None:
        self.tier = tier
        self.name = tier.name
        self.codec = codec  # how its writes store KV
        # the codecs its reads take: an object of another is a miss, left in place (RefusedCodec)
        self.accepts = codecs.accepted(codec) if accepts is None else accepts
        self.reads = Outage(tier.name, "reads", retry_seconds, metrics.outage.labels(tier.name, "reads"), cascade_log)
        self.writes = Outage(tier.name, "writes", retry_seconds, metrics.outage.labels(tier.name, "writes"),
                             cascade_log)
        self.ttl: float | None = getattr(tier.options, "ttl_seconds", None)
        self._metrics = metrics
        self._logged = logged
        # Shards under keys this process lacks, read lately: until when reads and lookups plan without them.
        self._unopened: RecentMap[ShardKey, float] = RecentMap(_UNOPENED_KEPT)
        # Until when writes go ahead whatever the tier holds: its reads refused an object for its codec lately (a
        # tier holding lossy KV this store does not take, after a change of codec or beside engines that store
        # another): the KV computed again replaces what is there, not only the chunk that was refused.
        self._refused_until = 0.0
        self._unopened_lock = threading.Lock()

    @property
    def local(self) -> bool:
        return self.tier.local

    @property
    def read_ahead(self) -> bool:
        return self.tier.read_ahead

    @property
    def batch_reads(self) -> bool:
        return self.tier.batch_reads and not self.coded

    @property
    def ranged_reads(self) -> bool:
        """Whether a load by layers reads its shards a layer at a time (a local file stored as it is)."""
        return self.tier.ranged_reads and not self.coded

    @property
    def coded(self) -> bool:
        """Whether it stores with a codec: its shards are read into a buffer and decoded into DRAM from there
        (:meth:`ShardReads.read_into`), never in pieces, by layers or batched."""
        return self.codec is not codecs.NONE

    @property
    def heads_in_one_call(self) -> bool:
        return self.tier.heads_in_one_call

    # -- lookups ---------------------------------------------------------------------------------------------
    def heads(self, namespace: str, chunks: list[str]) -> list[list[HeadRange]]:
        """What the tier holds of each chunk; nothing for a chunk when the tier fails, rests or answers nonsense."""
        none: list[list[HeadRange]] = [[] for _ in chunks]
        if self.reads.resting():
            return none
        try:
            heads = self.tier.heads(namespace, chunks)
        except Exception as exc:  # noqa: BLE001 every fault becomes nothing found, counted (_contain)
            self._contain("lookup", exc)
            return none
        self.reads.succeeded()
        if not isinstance(heads, list) or len(heads) != len(chunks) or not all(
                isinstance(found, list) and all(valid_range(h) for h in found) for found in heads):
            self._unexpected("lookup", ValueError(f"malformed answer for {len(chunks)} chunks: {heads!r:.200}"))
            return none
        return self.openable(namespace, chunks, heads)

    def openable(self, namespace: str, chunks: list[str], heads: list[list[HeadRange]]) -> list[list[HeadRange]]:
        """``heads`` (what each chunk holds) less the objects under keys this process lacks, read lately: as good
        as absent here."""
        if self._unopened:
            now = time.monotonic()
            with self._unopened_lock:
                heads = [[h for h in found if self._unopened.get(ShardKey(namespace, chunk, h), 0) < now]
                         for chunk, found in zip(chunks, heads)]
        return heads

    def _contain(self, what: str, exc: Exception) -> None:
        fault = classify(exc)
        if fault is Fault.PART_OUTAGE:  # the tier rests that part itself; the rest of it serves
            self._metrics.read_errors.labels(self.name).inc()
        elif fault is Fault.OUTAGE:
            self._metrics.read_errors.labels(self.name).inc()
            self.reads.failed(exc)
        else:  # a malformed object named in the answer, a tier's bug: a miss, the tier stays in use
            self._unexpected(what, exc, corrupt=fault in (Fault.CORRUPT, Fault.UNKNOWN_KEY))

    def _unexpected(self, what: str, exc: BaseException, corrupt: bool = False) -> None:
        """Count a fault confined to one call or object (not an outage); log its first kind."""
        (self._metrics.corrupt if corrupt else self._metrics.read_errors).labels(self.name).inc()
        if self._logged.first(self.name, what, type(exc).__name__):
            log.warning("tier %s: %s failed (%s: %s); a miss, the tier stays in use (further such failures are "
                        "counted, not logged)", self.name, what, type(exc).__name__, exc)

    # -- reads -----------------------------------------------------------------------------------------------
    def read(self, key: ShardKey, read: Callable[[], _R | None]) -> _R | None:
        """``read()`` of one shard of this tier, its faults contained: a corrupt or malformed object is counted
        and removed, a tier error counts toward the tier's outage, anything else is a counted miss (the tier stays
        in use). None for any of them, and while the tier rests after an outage."""
        if self.reads.resting():
            return None
        with tracing.span("kvtier.tier.read", tier=self.name, key=key.name) as span:
            outcome, got = self._read(key, read)
            if span is not None:
                span.set_attribute("outcome", outcome)
        return got

    def _read(self, key: ShardKey, read: Callable[[], _R | None]) -> tuple[str, _R | None]:
        try:
            got = read()
        except Expired:  # older than the tier's ttl_seconds: never served, removed like the tier's own expiry
            self.reads.succeeded()
            self._metrics.expired.labels(self.name).inc()
            self.remove(key)
            return "expired", None
        except Exception as exc:  # noqa: BLE001 each fault becomes a miss, as classify says (_read_fault)
            return self._read_fault(key, exc), None
        self.reads.succeeded()
        return ("miss" if got is None else "hit"), got

    def _read_fault(self, key: ShardKey, exc: Exception) -> str:
        fault = classify(exc)
        if fault is Fault.REFUSED_CODEC:  # left in place for the readers that accept it, as an unknown key is
            self.reads.succeeded()
            self._metrics.codec_refused.labels(self.name).inc()
            with self._unopened_lock:
                self._unopened[key] = time.monotonic() + _UNOPENED_SECONDS
            self._refused_until = time.monotonic() + _UNOPENED_SECONDS
            if self._logged.first(self.name, "open", "RefusedCodec"):
                log.warning("tier %s: %s is %s: a miss, left in place (further such objects are counted, not "
                            "logged)", self.name, key.name, exc)
            return "refused_codec"
        if fault is Fault.UNKNOWN_KEY:
            # Left in place: another engine may hold its key (a master key being rolled out, another deployment
            # with its own keyring), and removing what an engine cannot open would let any misconfigured engine
            # empty a shared tier. Remembered for a while instead, so reads plan without it.
            self.reads.succeeded()
            self._metrics.unopened.labels(self.name).inc()
            with self._unopened_lock:
                self._unopened[key] = time.monotonic() + _UNOPENED_SECONDS
            if self._logged.first(self.name, "open", "UnknownKey"):
                log.warning("tier %s: %s is %s: a miss, left in place (further such objects are counted, not "
                            "logged)", self.name, key.name, exc)
            return "unknown_key"
        if fault is Fault.CORRUPT:
            self.reads.succeeded()
            self._metrics.corrupt.labels(self.name).inc()
            log.warning("tier %s: removing corrupt %s: %s", self.name, key.name, exc)
            self.remove(key)
            return "corrupt"
        if fault is Fault.PART_OUTAGE:  # (as in _contain)
            self._metrics.read_errors.labels(self.name).inc()
            return "part_outage"
        if fault is Fault.OUTAGE:
            self._metrics.read_errors.labels(self.name).inc()
            self.reads.failed(exc)
        else:  # a tier's bug or an object no check foresaw: a counted miss
            self._unexpected("get", exc)
        return "error"

    def check_age(self, header: frame.Header) -> None:
        """Raise :class:`Expired` when the shard is older than the tier's ``ttl_seconds`` (any tier type whose
        options have one): whatever the tier does itself, no shard is served past its age."""
        age = time.time() - header.created
        if self.ttl is not None and not -_FUTURE_SECONDS <= age <= self.ttl:  # (a NaN or infinite time too)
            raise Expired(f"written {age:.0f} s ago, ttl_seconds is {self.ttl:.0f}")

    def within_ttl(self, created: float) -> bool:
        """Whether a shard written at ``created`` is still within the tier's ``ttl_seconds`` (none: always)."""
        return self.ttl is None or time.time() - created <= self.ttl

    def remove(self, key: ShardKey) -> None:
        try:
            self.tier.delete(key)
        except Exception as exc:  # noqa: BLE001 removal is best effort (logged): the object stays a miss
            log.warning("tier %s: cannot remove corrupt %s: %s", self.name, key.name, exc)

    # -- writes ----------------------------------------------------------------------------------------------
    def holds(self, key: ShardKey) -> bool:
        """Whether the tier holds the object already. Only advice (a write is cheaper to skip than to make): if
        asking fails, the answer is no and the write goes ahead (and reports any real outage itself). For a while
        after this tier's reads refused an object for its codec, the answer is no: writes replace what it holds."""
        if time.monotonic() < self._refused_until:
            return False
        try:
            return self.tier.exists(key) is True
        except Exception as exc:  # noqa: BLE001 only advice (the docstring), counted and logged once
            # e.g. one malformed object (ObjectError) that the write will replace
            self._metrics.read_errors.labels(self.name).inc()
            if self._logged.first(self.name, "exists", "any"):
                cascade_log.warning("tier %s: asking whether %s is stored failed (%s: %s); writing it anyway (further "
                            "such failures are counted, not logged)", self.name, key.name, type(exc).__name__, exc)
            return False

    def write(self, key: ShardKey, parts: Callable[[], Parts], payload_bytes: int, start: float) -> str:
        """Write one object, made by ``parts()`` (its header, then its payload; encoding it may fail: NaN in KV
        for a lossy codec; sealing it too: its tenant forgotten); what became of it (``written``, ``dropped``,
        ``error``). ``payload_bytes``: the shard's own size, before its codec. ``start``: when the write began
        (``time.perf_counter()``, before :meth:`holds` asked), for ``kvtier_tier_write_seconds``."""
        try:
            made = parts()
            self.tier.put(key, made)
        except Exception as exc:  # noqa: BLE001 each fault becomes an outcome, as classify says (_write_fault)
            return self._write_fault(key, exc)
        self.writes.succeeded()
        if self._unopened:
            with self._unopened_lock:  # (one this process could not take: what it wrote now, it can)
                self._unopened.pop(key, None)
        self._metrics.tier_write_seconds.labels(self.name).observe(time.perf_counter() - start)
        stored = sum(len(part) for part in made[1:])  # (the header first)
        self._metrics.bytes_written.labels(self.name).inc(len(made[0]) + stored)
        self._metrics.codec_bytes.labels(self.name, "raw").inc(payload_bytes)
        self._metrics.codec_bytes.labels(self.name, "stored").inc(stored)
        return "written"

    def _write_fault(self, key: ShardKey, exc: Exception) -> str:
        fault = classify(exc)
        if fault is Fault.NO_TENANT_KEY:  # its tenant was forgotten since the put: nothing may be written under it
            self._metrics.dropped.labels(self.name, "no_tenant_key").inc()
            cascade_log.info("tier %s: not writing %s: %s", self.name, key.name, exc)
            return "dropped"
        if fault is Fault.NOT_ENCODABLE:  # NaN or infinity in KV a lossy codec would store: never written
            self._metrics.dropped.labels(self.name, "not_encodable").inc()
            if self._logged.first(self.name, "encode", "NotEncodable"):
                cascade_log.warning("tier %s: not writing %s: %s (further such KV is counted, not logged)",
                                    self.name, key.name, exc)
            return "dropped"
        if fault is Fault.SHARE_FULL:  # the tenant's share holds only its recent shards (its prompt's first chunks)
            self._metrics.dropped.labels(self.name, "share_full").inc()
            self.writes.succeeded()  # the tier answered
            return "dropped"
        if fault is Fault.PART_OUTAGE:  # its part rests (the tier's own doing); the tier's other parts are written
            self._metrics.dropped.labels(self.name, "part_outage").inc()
            return "dropped"
        self._metrics.write_errors.labels(self.name).inc()
        # A bug in a plugin tier (or a frame that cannot be made) must not kill the worker silently.
        if fault is Fault.UNEXPECTED or isinstance(exc, frame.FrameError):
            cascade_log.exception("tier %s: unexpected error writing %s", self.name, key.name)
        self.writes.failed(exc)
        return "error"
