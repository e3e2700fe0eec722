"""Reads (``get`` and ``load``): plan where each chunk's heads come from (DRAM, else each tier in turn), fetch
what DRAM lacks (verified: a bad shard is a miss, removed, and the chunk planned again), promote it into DRAM
(and the tiers in front of the one it came from), then hand the plans to copy-out. Runs on the caller's
thread, with the shard reads started ahead on :mod:`~kvtier.store.prefetch`'s threads."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import torch
import xxhash

from kvtier import codecs, frame
from kvtier.dram import DramEntry, DramPool
from kvtier.errors import WrongSize
from kvtier.keys import Namespace, ShardKey, chunk_keys, rank_heads
from kvtier.metrics import StoreMetrics
from kvtier.recent import RecentMap
from kvtier.store.guard import GuardedTier
from kvtier.store.lookups import readable
from kvtier.store.plan import Deferred, Fetched, Filling, HeadPlan, Piece, Read, Shape, plan_heads
from kvtier.store.prefetch import Prefetch
from kvtier.store.shards import ShardReads
from kvtier.store.tenancy import Tenancy
from kvtier.store.writes import Tokens, Writes
from kvtier.tiers.base import Ranges

log = logging.getLogger("kvtier.store")
# Shards a load by layers keeps open (a file descriptor each, through the forward pass); the rest of its chunks are
# read whole, as any load's are: a 128K-token prompt (512 chunks) must not run the process out of descriptors.
DEFERRED_MAX = 64
# Re-plans of one chunk after a piece failed; each failure removes a shard, so a few always suffice.
_REPLANS = 8
Use = Callable[[list[list[Piece]], Shape], None]  # what a read does with its plans (copy out, hand to a sink)
Planned = Callable[[int, list[Piece], Shape], None]  # one chunk's pieces, as soon as they are planned (pinned)


class Reads:
    def __init__(self, chunk_tokens: int, dram: DramPool, metrics: StoreMetrics, tenancy: Tenancy,
                 guards: list[GuardedTier], shards: ShardReads, prefetch: Prefetch, writes: Writes,
                 shapes: RecentMap[str, Shape]) -> None:
        self._chunk_tokens = chunk_tokens
        self._dram = dram
        self._metrics = metrics
        self._tenancy = tenancy
        self._guards = guards
        self.shards = shards
        self.prefetch = prefetch
        self._writes = writes
        self._shapes = shapes
        self._hits = {name: metrics.hits.labels(name) for name in ["dram", *(g.name for g in guards)]}

    def read(self, ns: Namespace, tokens: Tokens, tp_rank: int, tp_size: int, offset: int,
             kv_heads: int | None, wanted: Shape | None, use: Use, partial: bool = False, local_only: bool = False,
             tail: bool = False) -> int:
        """Plan the chunks of ``tokens[offset:]`` (pinning DRAM entries, fetching and promoting the rest), hand
        the plans to ``use``, then release what was pinned; returns how many chunks were handed over. On a miss:
        0 (``use`` not called), or with ``partial`` the chunks before it."""
        with self.opened(ns, tokens, tp_rank, tp_size, offset, kv_heads, wanted, partial, local_only,
                         tail) as (plans, shape, _):
            if plans:
                assert shape is not None, "a planned chunk fixes the shape"
                use(plans, shape)
        return len(plans)

    @contextlib.contextmanager
    def opened(self, ns: Namespace, tokens: Tokens, tp_rank: int, tp_size: int, offset: int,
               kv_heads: int | None, wanted: Shape | None, partial: bool, local_only: bool,
               tail: bool, by_layers: bool = False,
               planned: Planned | None = None) -> Iterator[tuple[list[list[Piece]], Shape | None, Read]]:
        """The plans of :meth:`read` (none on a miss), their shape and the read, everything they name pinned until
        the block ends. With ``by_layers``, shards from a tier that reads in pieces (a local file) are only
        opened: the caller reads them a layer at a time (:meth:`fill_layer`), then :meth:`finish` verifies them.
        ``planned(i, pieces, shape)`` is called with each chunk's plan as soon as it is made (the i-th, counted
        from ``offset``), while the next chunks are still being read."""
        start = time.perf_counter()
        t = self._chunk_tokens
        if (len(tokens) % t and not tail) or offset % t or not 0 <= offset < len(tokens):
            raise ValueError(f"get needs a whole number of {t}-token chunks after a whole-chunk offset, got "
                             f"{len(tokens)} tokens and offset {offset}")
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got tp_rank={tp_rank}, tp_size={tp_size}")
        if kv_heads is not None:
            rank_heads(kv_heads, tp_rank, tp_size)  # the caller's own degree must fit its model: raises if not
        ns = self._tenancy.named(ns)
        tenant = self._tenancy.register(ns, create=False)
        decision = self._tenancy.decide(ns)  # what this read promotes into DRAM counts against the tenant's share
        shape = self._shapes.get(ns.id)
        if wanted is not None:
            if shape is not None and wanted != shape:
                raise ValueError(f"the caller expects {wanted}, the KV put in this namespace is {shape}")
            shape = wanted
        chunks = [k.hex() for k in chunk_keys(ns, tokens, t, tail=tail)]
        read = Read(ns.id, tp_rank, tp_size, kv_heads, shape, readable(self._guards, decision, local_only),
                    allowed=decision.allowed, tenant=tenant, owner=None if tenant is None else tenant.key_id,
                    by_layers=by_layers and self.shards.plain)
        try:
            plans = self._plan(read, chunks, offset // t, partial, planned)
            yield plans, read.shape, read
        finally:
            self._end(read)
        if plans:
            self._metrics.get_seconds.observe(time.perf_counter() - start)

    def _plan(self, read: Read, chunks: list[str], first: int, partial: bool,
              planned: Planned | None = None) -> list[list[Piece]]:
        """Each chunk's pieces from ``first`` on; none on a miss, or with ``partial`` those before it (each handed
        to ``planned`` as it is made: only with ``partial``, so none is taken back by a later miss, and never by
        layers, whose shards are verified only once every layer is read)."""
        assert planned is None or (partial and not read.by_layers), "planned chunks are final and verified"
        self.prefetch.plan(read, chunks, first)
        plans: list[list[Piece]] = []
        for i in range(first, len(chunks)):
            read.position = i - first
            pieces = self._plan_chunk(read, chunks[i], chunks[i - 1] if i else None)
            if pieces is None:
                self._metrics.misses.inc()
                return plans if partial else []
            plans.append(pieces)
            if planned is not None:
                assert read.shape is not None, "a planned chunk fixes the shape"
                planned(len(plans) - 1, pieces, read.shape)
        return plans

    def _end(self, read: Read) -> None:
        try:
            while read.deferred:  # not finished (the caller's block ended early): never served
                self._drop(read.deferred.pop())
        finally:
            for started in read.started.values():  # not needed after all (a miss before them)
                self.prefetch.abandon(started)  # one not yet running never starts
            for entry in read.pinned:
                self._dram.release(entry)

    def _drop(self, deferred: Deferred) -> None:
        """A shard opened for reads by layers and not served: its file closed, its entry aborted (both, whatever
        the close raises)."""
        try:
            deferred.ranges.close()
        finally:
            self._dram.abort(deferred.entry)

    def _plan_chunk(self, read: Read, chunk: str, parent: str | None) -> list[Piece] | None:
        """Where this rank's heads of one chunk come from: DRAM alone, else DRAM plus each tier in turn."""
        sources: list[str | GuardedTier] = ["dram", *read.tiers]
        for source in sources:
            # A failed piece is removed from its tier (missing or corrupt) or left out of this read's plans
            # (Read.failed: a shard its tier keeps, e.g. on a stalled node), so each retry plans without it.
            for attempt in range(_REPLANS):
                ranges = self._dram.ranges(read.namespace, chunk)
                if isinstance(source, GuardedTier):
                    answers = read.heads.setdefault(source.name, {})
                    if attempt and chunk in read.guessed.get(source.name, ()):  # not the shard of its own heads
                        self.prefetch.unguess(read, source, chunk)  # this chunk and the rest guessed, at once
                    elif attempt or chunk not in answers:  # a re-plan asks again: the last answer was wrong
                        answers[chunk] = source.heads(read.namespace, [chunk])[0]
                    held = read.heads[source.name][chunk]
                    ranges += [h for h in held if (source.name, ShardKey(read.namespace, chunk, h)) not in
                               read.failed] if read.failed else held
                found = plan_heads(read, ranges)
                if found is None:
                    break
                want, plan = found
                pieces = self._gather(read, chunk, parent, plan, want.start)
                if pieces is not None:
                    self._hits[source if isinstance(source, str) else source.name].inc()
                    return pieces
        return None

    def _gather(self, read: Read, chunk: str, parent: str | None, plan: HeadPlan, lo: int) -> list[Piece] | None:
        """Pin the planned DRAM entries and fetch the rest; None if a piece went missing or does not fit."""
        pieces: list[Piece] = []
        read.one_piece = len(plan) == 1  # (a chunk assembled from pieces is copied at once: read whole)
        for rng, a, b in plan:
            entries = self._dram.acquire(read.namespace, chunk, [rng], read.owner)
            source: DramEntry | torch.Tensor | None
            if entries is not None:
                read.pinned.extend(entries)
                source = entries[0]
                if not read.admit(source.meta, self._chunk_tokens):
                    # Put by a caller with another shape, or promoted by a read that expected nothing: not
                    # what this read needs. Drop it, so the next put of this chunk stores the right one.
                    log.warning("dram: dropping %s: holds %s, this read expects %s", source.key.name,
                                Shape.of(source.meta), read.shape)
                    self._metrics.corrupt.labels("dram").inc()
                    self._dram.discard(source)
                    return None
            else:
                source = self._fetch(read, ShardKey(read.namespace, chunk, rng), parent)
                if source is None:
                    return None
            pieces.append(Piece(source, a - rng.start, a - lo, b - a))
        return pieces

    def _fetch(self, read: Read, key: ShardKey, parent: str | None) -> DramEntry | torch.Tensor | None:
        """Read one shard from the first tier that holds a valid copy and promote it into DRAM.

        Returns the promoted DRAM entry, pinned for the caller (added to ``read.pinned``), so the copy out joins
        the DRAM runs; or, when DRAM has no room, a tensor over the fetched bytes. Once the read knows its shape,
        a tier read inline (not ahead) reads straight into the reserved DRAM pages, verified there: no read
        buffer, no copy after it. A shard promoted from a tier is also queued for the tiers configured in front of
        it (e.g. a local disk before Redis), so a later DRAM miss finds it there: a cascade write like any other,
        skipped when that tier holds it already.
        """
        for guard in read.tiers:
            if key.heads not in read.heads.get(guard.name, {}).get(key.chunk, [key.heads]) or \
                    (guard.name, key) in read.failed:
                continue  # this tier said it lacks the shard, or failed to read it: no round trip for that again
            fetched = self._fetch_from(read, guard, key, parent)
            if fetched is not None:
                return fetched
            read.failed.add((guard.name, key))
        return None

    def _fetch_from(self, read: Read, guard: GuardedTier, key: ShardKey,
                    parent: str | None) -> DramEntry | torch.Tensor | None:
        """:meth:`_fetch` from one tier; None when it failed (missing, corrupt, unreadable, or not servable)."""
        filling = read.started.get((guard.name, key))
        if isinstance(filling, Filling):
            del read.started[(guard.name, key)]
            created = self._filled(guard, filling)
            # promoted before reading on: nothing left in hand
            promoted = created is not None and self._promote(read, guard, filling.entry, created)
            self.prefetch.read_ahead(read)
            return filling.entry if promoted else None
        if read.shape is not None and (not (self.prefetch.reads_ahead(guard) or guard.batch_reads) or
                                       (guard.name, key) not in read.started):
            entry = self._dram.reserve(key, read.shape.meta(self._chunk_tokens, key.heads), parent, read.owner)
            if isinstance(entry, DramEntry):
                if read.by_layers and read.one_piece and guard.ranged_reads and \
                        len(entry.extents) == 1 and len(read.deferred) < DEFERRED_MAX:
                    return entry if self._defer(read, guard, key, entry) else None
                return entry if self._read_into(read, guard, key, entry) else None
            # present (promoted by another read meanwhile) or no room: read the bytes as they are
        got = self._read_verified(guard, key, read)
        return None if got is None else self._keep(read, guard, key, parent, got)

    # -- shards read a layer at a time (a load by layers) ------------------------------------------------------
    def _defer(self, read: Read, guard: GuardedTier, key: ShardKey, entry: DramEntry) -> bool:
        """Open one shard's file and check its header, for its caller to read the payload into ``entry`` a layer
        at a time; False (the entry aborted) when it is missing or its header is not what the read expects. A file
        whose size is not the shard's (stored with a codec, or malformed) is read whole instead (:meth:`_read_into`).
        """
        whole = False

        def opened() -> tuple[Ranges, frame.Header] | None:
            nonlocal whole
            try:
                return self.shards.open_ranges(guard, key, entry)
            except WrongSize:  # (encoded, or malformed)
                whole = True
                return None

        try:
            got = guard.read(key, opened)
        except BaseException:
            self._dram.abort(entry)
            raise
        if whole:
            return self._read_into(read, guard, key, entry)
        if got is None:
            self._dram.abort(entry)
            return False
        payload = self._dram.views(entry)[0]  # (one extent: _fetch defers no other)
        read.deferred.append(Deferred(read.position, guard, key, entry, payload, got[0], got[1], xxhash.xxh3_128()))
        return True

    def fill_layer(self, read: Read, layer: int) -> None:
        """Read layer ``layer`` of every shard :meth:`_defer` opened into its entry, hashing it as it lands; layers
        are read in order, each once. A failed piece fails its shard (reported by :meth:`finish`)."""
        assert read.shape is not None, "a deferred shard fixed the read's shape"
        for deferred in read.deferred:
            if deferred.error is not None:
                continue
            start = time.perf_counter()
            try:
                if layer != deferred.layers:
                    raise ValueError(f"layer {layer} read after {deferred.layers} of {read.shape.layers}")
                per = deferred.entry.meta.nbytes // read.shape.layers
                piece = deferred.payload[layer * per:(layer + 1) * per]
                deferred.ranges.read_into(layer * per, [piece])
                deferred.hasher.update(piece)
                deferred.layers += 1
            except Exception as exc:  # noqa: BLE001 the shard is a miss: counted by its tier's guard at the finish
                deferred.error = exc
            deferred.seconds += time.perf_counter() - start

    def finish(self, read: Read) -> int | None:
        """Verify every shard read a layer at a time and promote the good ones into DRAM; the first chunk whose
        shard is not served (counted from the read's first; KV copied out of it must not be used), or None when
        all are good. A shard whose read or checksum failed counts against its tier as any bad read does (a
        corrupt file is removed); one not read to its last layer (the caller stopped early) is only dropped."""
        assert read.shape is not None, "a deferred shard fixed the read's shape"
        bad: int | None = None
        while read.deferred:  # one at a time: whatever raises, those left are dropped by _end
            deferred = read.deferred.pop(0)
            served = False
            try:
                served = self._finish_one(read, deferred)
            finally:
                if not served:
                    bad = deferred.position if bad is None else min(bad, deferred.position)
        return bad

    def _finish_one(self, read: Read, deferred: Deferred) -> bool:
        assert read.shape is not None, "a deferred shard fixed the read's shape"
        try:
            deferred.ranges.close()
        except BaseException:
            self._dram.abort(deferred.entry)
            raise
        error = deferred.error
        if error is None and deferred.layers != read.shape.layers:
            self._dram.abort(deferred.entry)  # not read whole: nothing known against the file
            return False
        if error is None and deferred.hasher.digest() != deferred.header.payload_checksum:
            error = frame.FrameError("payload checksum mismatch")
        if error is not None:
            def failed(exc: Exception = error) -> None:
                raise exc

            try:
                deferred.guard.read(deferred.key, failed)  # counted (and a corrupt file removed) as a bad read
            finally:
                self._dram.abort(deferred.entry)
            return False
        self._metrics.tier_read_seconds.labels(deferred.guard.name).observe(deferred.seconds)
        self._metrics.bytes_read.labels(deferred.guard.name).inc(self.shards.header_len + deferred.entry.meta.nbytes)
        return self._promote(read, deferred.guard, deferred.entry, deferred.header.created)

    def _read_into(self, read: Read, guard: GuardedTier, key: ShardKey, entry: DramEntry) -> bool:
        """Read a shard straight into its reserved entry and promote it; False (the entry aborted or discarded)
        when it is missing, bad, or may not be served."""
        try:
            created = self.shards.read_into(guard, key, entry)
        except BaseException:
            self._dram.abort(entry)
            raise
        if created is None:
            self._dram.abort(entry)
            return False
        return self._promote(read, guard, entry, created)

    def _keep(self, read: Read, guard: GuardedTier, key: ShardKey, parent: str | None,
              got: Fetched) -> DramEntry | torch.Tensor | None:
        """A shard read as bytes: promoted into DRAM where there is room, else served from the bytes."""
        entry = self._dram.reserve(key, got.header.meta, parent, read.owner)
        if isinstance(entry, DramEntry):
            entry.codec = got.header.codec if not got.header.codec.exact else codecs.NONE
            try:
                self._dram.write_bytes(entry, got.payload)
            except BaseException:
                self._dram.abort(entry)
                raise
            return entry if self._promote(read, guard, entry, got.header.created) else None
        if not self._tenancy.servable(read.tenant):
            return None  # forgotten since the read began (see _promote)
        return frame.payload_tensor(got.payload, got.header.meta)

    def _filled(self, guard: GuardedTier, filling: Filling) -> float | None:
        """The creation time of a shard read ahead into its DRAM entry, or None with the entry aborted: missing,
        corrupt or unreadable, or its tier failed since the read started (not waited on)."""
        if guard.reads.resting():
            self.prefetch.abandon(filling)  # its entry aborted once its read has ended
            return None
        try:
            created = filling.future.result()
        except BaseException:  # (the reader catches what the tier raises: here, e.g. an interrupt of the wait)
            self.prefetch.abandon(filling)  # its entry aborted once its read has ended
            raise
        if created is None:
            self._dram.abort(filling.entry)
        return created

    def _promote(self, read: Read, guard: GuardedTier, entry: DramEntry, created: float) -> bool:
        """Make a shard read from ``guard``'s tier visible in DRAM, pinned for ``read``, and queue it for the tiers
        in front of it. False, the entry discarded, when the read's tenant was found forgotten since the read
        began: the shard was decrypted before this process noticed, and the keyring watch's DRAM purge may have
        run before this commit (checked after it, the watch marking before it purges: one of the two drops it)."""
        front = self._writes.front_of(guard, read.allowed, created, entry.codec)
        entry.created = created  # copied into the front tiers, it keeps its age (and TTL)
        # served as long as the tier it came from would serve it
        entry.expires = None if guard.ttl is None else created + guard.ttl
        self._dram.commit(entry, keep_refs=1 + len(front))
        read.pinned.append(entry)
        if not self._tenancy.servable(read.tenant):
            self._dram.discard(entry)
            for _ in front:  # the references kept for the front tiers' writes, never queued
                self._dram.release(entry)
            return False
        self._metrics.promotions.labels(guard.name).inc()
        for writer in front:
            writer.submit(entry)
        return True

    def _read_verified(self, guard: GuardedTier, key: ShardKey, read: Read) -> Fetched | None:
        """One shard read as bytes (started ahead, or read here) and checked against the read's shape."""
        started = read.started.pop((guard.name, key), None)
        assert not isinstance(started, Filling), "a read ahead into DRAM is taken by _fetch, never read here"
        if guard.reads.resting():  # failed since this read was started: do not wait on it
            if started is not None:
                started.cancel()
            self.prefetch.read_ahead(read)
            return None

        def fetched() -> Fetched | None:
            try:
                got = self.shards.get(guard, key) if started is None else started.result()
            finally:
                self.prefetch.read_ahead(read)
            if got is not None:
                guard.check_age(got.header)
                if not read.admit(got.header.meta, self._chunk_tokens):
                    raise frame.FrameError(f"holds {got.header.meta.shape} {got.header.meta.dtype}, expected "
                                           f"chunks of {read.shape} with {self._chunk_tokens} tokens")
            return got

        got = guard.read(key, fetched)
        if got is None:
            return None
        self._metrics.tier_read_seconds.labels(guard.name).observe(got.seconds)
        self._metrics.bytes_read.labels(guard.name).inc(got.nbytes)
        return got
