"""Puts: whole chunks reserved in the DRAM pool, filled (from a tensor or a caller's source), committed, then
queued for the cascade to every secondary tier the namespace's placement allows. Two phases: a chunk is visible
only once all its bytes are in DRAM; a failed copy aborts every reservation. Runs on the caller's thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier import codecs, frame
from kvtier.config import TierSpec
from kvtier.dram import DramEntry, DramPool, Refused
from kvtier.feed import ChangeFeed
from kvtier.keys import NamedChunks, Namespace, ShardKey, chunk_keys, rank_heads
from kvtier.metrics import StoreMetrics
from kvtier.recent import RecentMap
from kvtier.store.admission import Admission
from kvtier.store.cascade import CascadeWriter
from kvtier.store.guard import GuardedTier
from kvtier.store.plan import Shape
from kvtier.store.tenancy import Tenancy

Tokens = Sequence[int] | np.ndarray | torch.Tensor | NamedChunks
CONFIRMED_KEPT = 65536  # (shard, tier) pairs remembered as held by the tier: ~10 MB
Source = Callable[[int, torch.Tensor], None]  # (first chunk, destination [count, layers, 2, heads, T, head_dim])


def padded(source: Source, last: int, tokens: int) -> Source:
    """``source`` for a put whose chunk ``last`` (counted as ``source`` counts) is a tail of ``tokens`` tokens: the
    rest of that chunk is zeroed, so its pages never carry bytes of the KV they held before (another tenant's)."""
    def fill(first: int, dst: torch.Tensor) -> None:
        source(first, dst)
        if first <= last < first + dst.shape[0]:
            dst[last - first, :, :, :, tokens:].zero_()
    return fill


class Writes:
    """The store's puts and its cascade writers (one per secondary tier, in configured order)."""

    def __init__(self, chunk_tokens: int, dram: DramPool, metrics: StoreMetrics, tenancy: Tenancy,
                 guards: list[GuardedTier], specs: list[TierSpec], shapes: RecentMap[str, Shape],
                 admission: Admission) -> None:
        self._chunk_tokens = chunk_tokens
        self._admission = admission
        self._dram = dram
        self._metrics = metrics
        self._tenancy = tenancy
        self._shapes = shapes  # namespace id -> its shards' shape, bounded (one per tenant salt: the recent ones)
        self._shapes_lock = threading.Lock()
        self.tier_writes: ChangeFeed[tuple[ShardKey, str]] = ChangeFeed()  # (shard, tier) of each cascade write
        # (shard, tier) a cascade write found or left in the tier, the most recent ones: a handoff does not queue
        # them again (a tier's own evictions since are not seen)
        self._confirmed: RecentMap[tuple[ShardKey, str], bool] = RecentMap(CONFIRMED_KEPT)
        self._confirmed_lock = threading.Lock()
        seal = None if tenancy.sealer is None else tenancy.sealer.seal
        self.writers = [CascadeWriter(g, dram, metrics, spec, on_stored=self._stored_hook(g.name), seal=seal)
                        for g, spec in zip(guards, specs)]
        # Bound once: a labels() lookup per chunk is measurable on the hot path.
        self._dram_written = metrics.bytes_written.labels("dram")
        self._dram_full = metrics.dropped.labels("dram", "dram_full")
        self._admission_deferred = metrics.admission_deferred

    def put_tensor(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor, tp_rank: int, tp_size: int, offset: int,
                   kv_heads: int | None) -> int:
        """:meth:`KVStore.put`: ``kv`` checked against the tokens, then its chunks copied into DRAM."""
        start = time.perf_counter()
        t = self._chunk_tokens
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"kv must be [layers, 2, kv_heads, tokens, head_dim], got shape {tuple(kv.shape)}")
        self._check_offset(tokens, offset)
        if kv.shape[3] != len(tokens) - offset:
            raise ValueError(f"kv holds {kv.shape[3]} tokens but {len(tokens) - offset} token ids were given "
                             f"after offset {offset}")
        heads = rank_heads(kv.shape[2] * tp_size if kv_heads is None else kv_heads, tp_rank, tp_size)
        if heads.count != kv.shape[2]:
            raise ValueError(f"kv holds {kv.shape[2]} KV heads, rank {tp_rank} of {tp_size} holds {heads}")

        def copy(first: int, dst: torch.Tensor) -> None:
            # Asynchronous only into pinned pages (waited for before commit), never into a buffer read at once.
            src = kv[:, :, :, first * t:(first + dst.shape[0]) * t]
            src = src.unflatten(3, (dst.shape[0], t))  # type: ignore[no-untyped-call]  # torch: unflatten untyped
            dst.copy_(src.permute(3, 0, 1, 2, 4, 5), non_blocking=kv.is_cuda and dst.is_pinned())

        meta = frame.ShardMeta(kv.shape[0], t, kv.shape[4], kv.dtype, heads)
        return self.put(ns, tokens, meta, copy, offset, kv.device, start)

    def _check_offset(self, tokens: Tokens, offset: int) -> None:
        t = self._chunk_tokens
        if offset % t or not 0 <= offset <= len(tokens):
            raise ValueError(f"offset must be a whole number of {t}-token chunks within the tokens, got {offset}")

    def put_source(self, ns: Namespace, tokens: Tokens, source: Source, layers: int, head_dim: int,
                   dtype: torch.dtype, tp_rank: int, tp_size: int, offset: int, kv_heads: int,
                   device: torch.device | str, tail: bool, handoff: bool = False) -> int:
        """:meth:`KVStore.put_from`."""
        start = time.perf_counter()
        self._check_offset(tokens, offset)
        meta = frame.ShardMeta(layers, self._chunk_tokens, head_dim, dtype, rank_heads(kv_heads, tp_rank, tp_size))
        return self.put(ns, tokens, meta, source, offset, torch.device(device), start, tail, handoff)

    def put(self, ns: Namespace, tokens: Tokens, meta: frame.ShardMeta, source: Source, offset: int,
            device: torch.device, start: float, tail: bool = False, handoff: bool = False) -> int:
        """Reserve every chunk from ``offset`` on, have ``source`` fill them, commit and cascade them; the tokens
        now held from ``offset`` on (what :meth:`KVStore.put` returns). A ``handoff``'s chunks skip admission (another
        engine waits for them) and are cascaded as handoffs (:meth:`CascadeWriter.submit`)."""
        t = self._chunk_tokens
        ns = self._tenancy.named(ns)
        tenant = self._tenancy.register(ns, create=True)
        if self._tenancy.sealer is not None and tenant is None:
            return offset  # no tenant key (counted): nothing a forget could not end is kept, in DRAM either
        owner = None if tenant is None else tenant.key_id
        decision = self._tenancy.decide(ns)
        with self._shapes_lock:
            self._shapes[ns.id] = Shape.of(meta)  # the caller's own KV: it defines the shape
        first = offset // t
        chunks = [key.hex() for key in chunk_keys(ns, tokens, t, tail=tail)]
        if tail and len(tokens) % t:
            source = padded(source, len(chunks) - 1 - first, len(tokens) % t)
        wanted = [(ShardKey(ns.id, chunk, meta.heads), chunks[i - 1] if i else None)
                  for i, chunk in enumerate(chunks) if i >= first]
        admitted = len(wanted) if handoff else self._admission.admit([key for key, _ in wanted])
        if admitted < len(wanted):  # not seen often enough yet: counted, and not stored this time
            self._admission_deferred.inc(len(wanted) - admitted)
            wanted = wanted[:admitted]
        prefix = [ShardKey(ns.id, chunk, meta.heads) for chunk in chunks[:first]]
        held, reserved = self._fill(wanted, prefix, meta, owner, source, device)
        self._dram_written.inc(meta.nbytes * len(reserved))
        writers = self.writers_for(decision.allowed, self.writers, len(reserved))
        expires = self._expiry(decision.allowed, time.time())
        for entry in reserved:  # phase 2: the bytes are in DRAM; make them visible and cascade them
            entry.expires = expires
            self._dram.commit(entry, keep_refs=len(writers))
            for writer in writers:
                writer.submit(entry, handoff=handoff)
        if handoff:
            fresh = {entry.key for entry in reserved}
            self._cascade_again([key for key, _ in wanted[:held] if key not in fresh], writers, owner)
        if tenant is not None and reserved and not self._tenancy.current(tenant):
            self._dram.discard_owned({tenant.key_id})  # forgotten while this put ran: what it committed goes too
            held = 0  # and the caller is told nothing was stored
        self._metrics.put_seconds.observe(time.perf_counter() - start)
        return min(offset + held * t, len(tokens))

    def _cascade_again(self, keys: list[ShardKey], writers: list[CascadeWriter], owner: bytes | None) -> None:
        """Queue for the shared tiers again, as handoffs, the chunks of a handoff that DRAM held already and that a
        tier has not confirmed holding lately (a write found or left it there): it may have lost them (a write
        dropped, never made) while DRAM kept them, and another engine waits for them there. A writer finding one in
        its tier only asks (``present``). Lossy KV (decoded from a tier's codec) goes to none, nor KV past a tier's
        TTL."""
        shared = [w for w in writers if not w.tier.local]
        for key in keys:
            for writer in shared:
                with self._confirmed_lock:
                    if self._confirmed.get((key, writer.tier.name)):
                        continue
                entries = self._dram.acquire(key.namespace, key.chunk, [key.heads], owner)  # one pin per writer
                if not entries:
                    break  # gone since, or being written by another put (which cascades it)
                created = entries[0].created  # None: put here, its age starts when written
                if not entries[0].codec.exact or (created is not None and not writer.guard.within_ttl(created)):
                    self._dram.release(entries[0])
                    continue
                writer.submit(entries[0], handoff=True)

    def _fill(self, wanted: list[tuple[ShardKey, str | None]], prefix: list[ShardKey], meta: frame.ShardMeta,
              owner: bytes | None, source: Source, device: torch.device) -> tuple[int, list[DramEntry]]:
        """Phase 1: reserve every chunk (evicting none of ``prefix``, the chunks before them, nor of them), then
        copy them all (asynchronously from a CUDA tensor). The leading chunks now in DRAM (reserved here or held
        already), and the entries reserved (all aborted if the copy fails)."""
        held = 0
        reserved: list[tuple[int, DramEntry]] = []  # (the chunk's index from the first wanted, its entry)
        try:
            for i, entry in enumerate(self._dram.reserve_chunks(wanted, meta, owner, prefix)):
                if entry == Refused.FULL:
                    # Chunks after a missing one could never be reached by a prefix lookup: not reserved.
                    self._dram_full.inc()
                    break
                if isinstance(entry, DramEntry):
                    reserved.append((i, entry))
                held += 1
            self._dram.fill_chunks(source, reserved, device)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        except BaseException:
            if device.type == "cuda":  # copies already started must land before their pages are handed out again
                torch.cuda.current_stream(device).synchronize()
            for _, entry in reserved:
                self._dram.abort(entry)
            raise
        return held, [entry for _, entry in reserved]

    def writers_for(self, allowed: frozenset[str] | None, writers: list[CascadeWriter],
                    shards: int) -> list[CascadeWriter]:
        """The cascade writers a namespace's shards may go to (placement rules); those withheld are counted."""
        if allowed is None:
            return writers
        for writer in writers:
            if writer.tier.name not in allowed and shards:
                self._metrics.placement_withheld.labels(writer.tier.name).inc(shards)
        return [w for w in writers if w.tier.name in allowed]

    def front_of(self, guard: GuardedTier, allowed: frozenset[str] | None, created: float,
                 codec: codecs.Codec = codecs.NONE) -> list[CascadeWriter]:
        """The writers of the tiers in front of ``guard``'s that a shard read from it is copied to (promoted): those
        its namespace may reach, and whose TTL its age (written at ``created``) is still within; a front tier past
        it would refuse it on the next read. KV decoded from a lossy ``codec`` goes to none: written as exact KV, a
        reader wanting exact KV would take it, and encoded again, its error would grow past the codec's bound."""
        if not codec.exact:
            return []
        front = self.writers_for(allowed, self.writers[:[w.guard for w in self.writers].index(guard)], 1)
        return [w for w in front if w.guard.within_ttl(created)]

    def _expiry(self, allowed: frozenset[str] | None, created: float) -> float | None:
        """When a DRAM entry put at ``created`` stops being served: after the longest ``ttl_seconds`` of the tiers
        its KV may reach (``allowed``, None: all), as its KV is lawfully kept on one of them until then; never
        when one of them has no TTL, or when it reaches no secondary tier (DRAM only: nothing else keeps it)."""
        ttls = [w.guard.ttl for w in self.writers if allowed is None or w.guard.name in allowed]
        finite = [ttl for ttl in ttls if ttl is not None]
        return None if not ttls or len(finite) < len(ttls) else created + max(finite)

    def _stored_hook(self, tier: str) -> Callable[[ShardKey], None]:
        """What a cascade writer calls for each shard its tier came to hold (or held already): published to the
        tier-write feed, and remembered as confirmed."""
        def stored(key: ShardKey) -> None:
            with self._confirmed_lock:
                self._confirmed[(key, tier)] = True
            self.tier_writes.publish((key, tier))
        return stored

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
