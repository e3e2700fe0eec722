"""KVStore: the tiered store users and integrations call.

Runs in the caller's process. ``put`` copies whole chunks into the DRAM pool and returns; cascade workers
(:mod:`kvtier.cascade`) carry them to every secondary tier. ``lookup`` and ``get`` see DRAM first, then each
secondary tier in configured order; a shard read from a secondary tier is verified (:mod:`kvtier.frame`),
promoted into DRAM and copied out. A missing, unreadable or corrupt shard is a miss, never wrong data.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvtier import frame
from kvtier.cascade import CascadeWriter, Outage
from kvtier.config import StoreConfig, TierSpec, load_config
from kvtier.dram import DramEntry, DramPool
from kvtier.errors import TierError
from kvtier.eviction import POLICIES
from kvtier.keys import HeadRange, Namespace, ShardKey, chunk_keys, cover
from kvtier.metrics import StoreMetrics
from kvtier.tiers.base import TIERS, Tier

log = logging.getLogger(__name__)

Tokens = Sequence[int] | np.ndarray | torch.Tensor
# A piece of one chunk's output: `count` heads from `source` (a DRAM entry or a fetched shard) starting at its
# head `src_from`, into the output's heads from `dst_from`.
_Piece = tuple[DramEntry | torch.Tensor, int, int, int]
# Re-plans of one chunk after a piece failed; each failure removes a shard, so a few always suffice.
_REPLANS = 8


def open_tiers(config: StoreConfig) -> list[Tier]:
    """Build the configured secondary tiers (without a DRAM pool), e.g. for the CLI."""
    tiers: list[Tier] = []
    try:
        for i, spec in enumerate(config.tiers):
            cls = TIERS.resolve(spec.type, f"tiers[{i}].type")
            tiers.append(cls.from_config(spec.name, spec.options, f"tiers[{i}]"))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def _full_cover(ranges: list[HeadRange]) -> bool:
    if not ranges:
        return False
    total = ranges[0].total
    return cover([r for r in ranges if r.total == total], 0, total) is not None


class KVStore:
    """KV chunks in a DRAM pool backed by secondary tiers. Thread-safe; use as a context manager."""

    def __init__(self, config: StoreConfig, tiers: list[Tier] | None = None) -> None:
        self.config = config
        self.chunk_tokens = config.chunk_tokens
        self.metrics = StoreMetrics()
        self.tiers = open_tiers(config) if tiers is None else tiers
        try:
            policy = POLICIES.resolve(config.dram.eviction, "dram.eviction")()
            self.dram = DramPool(config.dram.capacity_bytes, config.dram.page_bytes, policy,
                                 pin_memory=config.dram.pin_memory, on_evict=self._evicted)
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        self.metrics.capacity_bytes.labels("dram").set(self.dram.capacity_bytes)
        self.metrics.watch_tiers(self.tiers)
        # Bound once: a labels() lookup per chunk is measurable on the hot path.
        self._dram_written = self.metrics.bytes_written.labels("dram")
        self._dram_full = self.metrics.dropped.labels("dram", "dram_full")
        self._dram_evictions = self.metrics.evictions.labels("dram")
        self._hits = {name: self.metrics.hits.labels(name) for name in ["dram", *(t.name for t in self.tiers)]}
        specs = {spec.name: spec for spec in config.tiers}
        default = TierSpec(type="", name="", options={})  # tiers passed in without a spec
        spec = [specs.get(t.name, default) for t in self.tiers]
        self._writers = [CascadeWriter(t, self.dram, self.metrics, s.queue_depth, s.workers, s.retry_seconds)
                         for t, s in zip(self.tiers, spec)]
        self._read_outage = {t.name: Outage(t.name, "reads", s.retry_seconds) for t, s in zip(self.tiers, spec)}
        self._closed = False
        if config.metrics_port is not None:
            self.metrics.serve(config.metrics_port)

    @classmethod
    def from_config(cls, cfg: Mapping[str, object] | str | os.PathLike[str] | None = None) -> KVStore:
        """Build a store from a mapping, a YAML file path, or ``$KVTIER_CONFIG`` when ``cfg`` is None."""
        return cls(load_config(cfg))

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- put ---------------------------------------------------------------------------------------------------
    def put(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1,
            offset: int = 0) -> int:
        """Store the whole chunks of ``kv`` (``[layers, 2, kv_heads / tp_size, len(tokens) - offset, head_dim]``).

        ``kv`` holds ``tokens[offset:]`` (``offset`` is a whole number of chunks, e.g. what is known to be stored
        already); the earlier tokens only name the chunks. Returns ``offset`` plus the tokens from there on whose
        chunks are now all in DRAM. Secondary tiers are written in the background.
        """
        start = time.perf_counter()
        t = self.chunk_tokens
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"kv must be [layers, 2, kv_heads, tokens, head_dim], got shape {tuple(kv.shape)}")
        if offset % t or not 0 <= offset <= len(tokens):
            raise ValueError(f"offset must be a whole number of {t}-token chunks within the tokens, got {offset}")
        if kv.shape[3] != len(tokens) - offset:
            raise ValueError(f"kv holds {kv.shape[3]} tokens but {len(tokens) - offset} token ids were given "
                             f"after offset {offset}")
        heads = HeadRange.for_rank(kv.shape[2], tp_rank, tp_size)
        meta = frame.ShardMeta(kv.shape[0], t, kv.shape[4], kv.dtype, heads)
        first = offset // t
        held = 0  # leading chunks from `first` on now in DRAM
        parent = None
        namespace = ns.id
        reserved: list[tuple[int, DramEntry]] = []
        try:  # phase 1: reserve every chunk, then copy them all (asynchronously from a CUDA tensor)
            for i, key in enumerate(chunk_keys(ns, tokens, t)):
                skey = ShardKey(namespace, key.hex(), heads)
                if i < first:
                    parent = skey.chunk
                    continue
                i -= first  # the chunk's index in kv
                entry = self.dram.reserve(skey, meta, parent)
                parent = skey.chunk
                if entry == "full":
                    self._dram_full.inc()
                    continue
                if isinstance(entry, DramEntry):
                    reserved.append((i, entry))
                if held == i:
                    held += 1
            self.dram.write_chunks(kv, reserved, t)
            if kv.is_cuda:
                torch.cuda.current_stream(kv.device).synchronize()
        except BaseException:
            for _, entry in reserved:
                self.dram.abort(entry)
            raise
        self._dram_written.inc(meta.nbytes * len(reserved))
        for _, entry in reserved:  # phase 2: the bytes are in DRAM; make them visible and cascade them
            self.dram.commit(entry, keep_refs=len(self._writers))
            for writer in self._writers:
                writer.submit(entry)
        self.metrics.put_seconds.observe(time.perf_counter() - start)
        return offset + held * t

    # -- lookup ------------------------------------------------------------------------------------------------
    def lookup(self, ns: Namespace, tokens: Tokens) -> int:
        """How many leading tokens (whole chunks) are available, every head present, in any tiers."""
        chunks = [k.hex() for k in chunk_keys(ns, tokens, self.chunk_tokens)]
        self.metrics.lookup_tokens.inc(len(tokens))
        found = self._available(ns.id, chunks)
        self.metrics.lookup_hit_tokens.inc(found * self.chunk_tokens)
        return found * self.chunk_tokens

    def _available(self, namespace: str, chunks: list[str]) -> int:
        n = 0
        while n < len(chunks) and _full_cover(self.dram.ranges(namespace, chunks[n])):
            n += 1
        if n == len(chunks) or not self.tiers:
            return n
        rest = chunks[n:]
        per_tier = [self._tier_heads(tier, namespace, rest) for tier in self.tiers]
        for i, chunk in enumerate(rest):
            ranges = self.dram.ranges(namespace, chunk)
            for heads in per_tier:
                ranges.extend(heads[i])
            if not _full_cover(ranges):
                break
            n += 1
        return n

    def _tier_heads(self, tier: Tier, namespace: str, chunks: list[str]) -> list[list[HeadRange]]:
        outage = self._read_outage[tier.name]
        if outage.resting():
            return [[] for _ in chunks]
        try:
            heads = tier.heads(namespace, chunks)
        except TierError as exc:
            self.metrics.read_errors.labels(tier.name).inc()
            outage.failed(exc)
            return [[] for _ in chunks]
        outage.succeeded()
        return heads

    # -- get ---------------------------------------------------------------------------------------------------
    def get(self, ns: Namespace, tokens: Tokens, *, tp_rank: int = 0, tp_size: int = 1,
            out: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor | None:
        """The canonical KV ``[layers, 2, kv_heads / tp_size, len(tokens) - offset, head_dim]`` of
        ``tokens[offset:]`` for this rank's heads, or None if any of those chunks is missing or unreadable.
        ``tokens`` and ``offset`` must be whole chunks; the tokens before ``offset`` only name the chunks.

        ``out``, when given, receives the data (and is returned); it must have the shape above. When the result
        is None, ``out`` may hold part of the data and must not be used.
        """
        start = time.perf_counter()
        t = self.chunk_tokens
        if len(tokens) % t or offset % t or not 0 <= offset < len(tokens):
            raise ValueError(f"get needs a whole number of {t}-token chunks after a whole-chunk offset, got "
                             f"{len(tokens)} tokens and offset {offset}")
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got tp_rank={tp_rank}, tp_size={tp_size}")
        chunks = [k.hex() for k in chunk_keys(ns, tokens, t)]
        pinned: list[DramEntry] = []  # released once every copy out of them has ended
        try:
            plans = []
            for i in range(offset // t, len(chunks)):
                chunk = chunks[i]
                pieces = self._plan_chunk(ns.id, chunk, chunks[i - 1] if i else None, tp_rank, tp_size, pinned)
                if pieces is None:
                    self.metrics.misses.inc()
                    return None
                plans.append(pieces)
            result = self._copy_out(plans, out)
            if result.is_cuda:
                torch.cuda.current_stream(result.device).synchronize()
        finally:
            for entry in pinned:
                self.dram.release(entry)
        self.metrics.get_seconds.observe(time.perf_counter() - start)
        return result

    def _plan_chunk(self, namespace: str, chunk: str, parent: str | None, tp_rank: int, tp_size: int,
                    pinned: list[DramEntry]) -> list[_Piece] | None:
        """Where this rank's heads of one chunk come from: DRAM alone, else DRAM plus each tier in turn."""
        for source in ["dram", *self.tiers]:
            # A failed piece (missing or corrupt) is removed from its tier, so each retry plans without it.
            for _ in range(_REPLANS):
                ranges = self.dram.ranges(namespace, chunk)
                if isinstance(source, Tier):
                    ranges += self._tier_heads(source, namespace, [chunk])[0]
                if not ranges:
                    break
                total = ranges[0].total
                if total % tp_size:
                    raise ValueError(f"tp_size {tp_size} does not divide the stored chunk's {total} KV heads")
                lo, hi = tp_rank * total // tp_size, (tp_rank + 1) * total // tp_size
                plan = cover([r for r in ranges if r.total == total], lo, hi)
                if plan is None:
                    break
                pieces = self._gather(namespace, chunk, parent, plan, lo, pinned)
                if pieces is not None:
                    self._hits[source if isinstance(source, str) else source.name].inc()
                    return pieces
        return None

    def _gather(self, namespace: str, chunk: str, parent: str | None, plan: list[tuple[HeadRange, int, int]],
                lo: int, pinned: list[DramEntry]) -> list[_Piece] | None:
        """Pin the planned DRAM entries and fetch the rest; None if a piece went missing."""
        pieces: list[_Piece] = []
        for rng, a, b in plan:
            entries = self.dram.acquire(namespace, chunk, [rng])
            if entries is not None:
                pinned.extend(entries)
                pieces.append((entries[0], a - rng.start, a - lo, b - a))
                continue
            shard = self._fetch(ShardKey(namespace, chunk, rng), parent, pinned)
            if shard is None:
                return None
            pieces.append((shard, a - rng.start, a - lo, b - a))
        return pieces

    def _copy_out(self, plans: list[list[_Piece]], out: torch.Tensor | None) -> torch.Tensor:
        """Copy every chunk's pieces into ``out`` (allocated when None).

        Consecutive chunks each served whole by one DRAM entry, laid out at a fixed stride, move in one copy.
        """
        t = self.chunk_tokens
        first = plans[0][0][0]
        layers, _, _, _, dim = first.meta.shape if isinstance(first, DramEntry) else first.shape
        dtype = first.meta.dtype if isinstance(first, DramEntry) else first.dtype
        shape = (layers, 2, sum(p[3] for p in plans[0]), len(plans) * t, dim)
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif tuple(out.shape) != shape or out.dtype != dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, the stored KV is {shape} {dtype}")
        whole = [(i, p[0][0]) for i, p in enumerate(plans)
                 if len(p) == 1 and isinstance(p[0][0], DramEntry) and p[0][3] == p[0][0].meta.heads.count]
        for run in self.dram.runs(whole, out.device):
            i0, entry = run[0]
            if len(entry.extents) == 1:
                dst = out[:, :, :, i0 * t:(i0 + len(run)) * t].unflatten(3, (len(run), t)).permute(3, 0, 1, 2, 4, 5)
                dst.copy_(self.dram.run_view(entry, len(run)), non_blocking=out.is_cuda and self.dram.pinned)
                for i, _ in run:
                    plans[i] = []  # done
        for i, pieces in enumerate(plans):
            for source, src_from, dst_from, count in pieces:
                shard = self.dram.tensor(source) if isinstance(source, DramEntry) else source
                out[:, :, dst_from:dst_from + count, i * t:(i + 1) * t].copy_(
                    shard[:, :, src_from:src_from + count], non_blocking=out.is_cuda and shard.is_pinned())
        return out

    def _fetch(self, key: ShardKey, parent: str | None, pinned: list[DramEntry]) -> DramEntry | torch.Tensor | None:
        """Read one shard from the first tier that holds a valid copy and promote it into DRAM.

        Returns the promoted DRAM entry, pinned for the caller (added to ``pinned``), so the copy out joins the
        DRAM runs; or, when DRAM has no room, a tensor over the fetched bytes.
        """
        for tier in self.tiers:
            got = self._read_verified(tier, key)
            if got is None:
                continue
            header, payload = got
            entry = self.dram.reserve(key, header.meta, parent)
            if isinstance(entry, DramEntry):
                self.dram.write_bytes(entry, payload)
                self.dram.commit(entry, keep_refs=1)
                pinned.append(entry)
                self.metrics.promotions.labels(tier.name).inc()
                return entry
            return frame.payload_tensor(payload, header.meta)
        return None

    def _read_verified(self, tier: Tier, key: ShardKey) -> tuple[frame.Header, memoryview] | None:
        outage = self._read_outage[tier.name]
        if outage.resting():
            return None
        start = time.perf_counter()
        try:
            blob = tier.get(key)
        except TierError as exc:
            self.metrics.read_errors.labels(tier.name).inc()
            outage.failed(exc)
            return None
        outage.succeeded()
        if blob is None:
            return None
        try:
            header, payload = frame.decode(blob, expected=key)
        except frame.FrameError as exc:
            self.metrics.corrupt.labels(tier.name).inc()
            log.warning("tier %s: removing corrupt %s: %s", tier.name, key.name, exc)
            try:
                tier.delete(key)
            except TierError as del_exc:
                log.warning("tier %s: cannot remove corrupt %s: %s", tier.name, key.name, del_exc)
            return None
        self.metrics.tier_read_seconds.labels(tier.name).observe(time.perf_counter() - start)
        self.metrics.bytes_read.labels(tier.name).inc(len(blob))
        return header, payload

    # -- housekeeping ------------------------------------------------------------------------------------------
    def _evicted(self, entry: DramEntry) -> None:
        self._dram_evictions.inc()

    def drop_dram(self) -> int:
        """Evict every DRAM entry not in use (later reads come from secondary tiers)."""
        return self.dram.evict_all()

    def flush(self) -> None:
        """Wait until every queued cascade write has ended."""
        for writer in self._writers:
            writer.flush()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Metrics grouped by tier (``dram``, each secondary tier's name, ``_store`` for store-wide ones)."""
        self.metrics.used_bytes.labels("dram").set(self.dram.used_bytes)
        for writer in self._writers:
            self.metrics.queue_depth.labels(writer.tier.name).set(writer.depth)
            used = writer.tier.used_bytes()
            if used is not None:
                self.metrics.used_bytes.labels(writer.tier.name).set(used)
        return self.metrics.snapshot()

    def close(self) -> None:
        """Finish queued cascade writes, stop the workers and close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for writer in self._writers:
            writer.close()
        for tier in self.tiers:
            tier.close()
