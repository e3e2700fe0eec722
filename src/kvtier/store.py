"""KVStore: the tiered store users and integrations call.

Runs in the caller's process. ``put`` copies whole chunks into the DRAM pool and returns; cascade workers
(:mod:`kvtier.cascade`) carry them to every secondary tier. ``lookup`` and ``get`` see DRAM first, then each
secondary tier in configured order; a shard read from a secondary tier is verified (:mod:`kvtier.frame`),
promoted into DRAM and copied out. A missing, unreadable or corrupt shard is a miss, never wrong data.

Retention in DRAM (``ttl_seconds`` of the tiers): a DRAM entry is served until its KV would expire where it is
lawfully kept. A put's entry expires at its write time plus the longest TTL of the tiers the namespace may reach
(never when one of them has none, or when it reaches none: DRAM only). A promoted entry expires at the shard's
write time plus the TTL of the tier it was read from (never if that tier has none), and is cascaded only to the
front tiers whose TTL its age is still within.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from kvtier import frame, tracing
from kvtier._reads import Fetched, Filling, Piece, Read, Shape, full_cover, valid_range
from kvtier.cascade import CascadeWriter
from kvtier.health import Outage
from kvtier.config import StoreConfig, TierSpec, load_config
from kvtier.dram import DramEntry, DramPool
from kvtier.errors import ConfigError, ObjectError, TierError
from kvtier.eviction import POLICIES
from kvtier.keys import HeadRange, Namespace, ShardKey, chunk_keys, cover, rank_heads, tail_keys
from kvtier.metrics import StoreMetrics
from kvtier.placement import Decision, Placement
from kvtier.threads import DaemonPool
from kvtier.tiers.base import TIERS, Tier

if TYPE_CHECKING:
    from kvtier.sealing import Tenant

log = logging.getLogger(__name__)

Tokens = Sequence[int] | np.ndarray | torch.Tensor
_R = TypeVar("_R")
# Re-plans of one chunk after a piece failed; each failure removes a shard, so a few always suffice.
_REPLANS = 8
_UNOPENED_SECONDS = 60.0  # how long a shard under a key this process lacks is taken as absent (then read again)
_UNOPENED_KEPT = 65536
_SHARED_KEPT = 16384  # below DRAM's and the tiers' own memory of shares: a namespace forgotten here is told again
_FUTURE_SECONDS = 300.0  # a shard written further ahead than this (a clock gone wrong, a forged time) is expired
_SHAPES_KEPT = 4096
# Shard reads a get keeps in flight ahead of the one it copies, from tiers that read ahead (Tier.read_ahead):
# the next read's round trips overlap promoting this one, and the read buffers held stay bounded (a 128K-token
# prompt does not hold all its chunks' bytes at once). Measured on loopback (16 chunks of 5.9 MB): S3
# 0.17 -> 0.15 s; Redis 0.083 -> 0.090 s and a local disk 0.034 -> 0.043 s (those read inline), and reading
# threads kept ~10 chunks' worth of freed buffers where inline reads peak at ~2.
READ_AHEAD = 2
# From a tier that batches its reads (Tier.batch_reads), each reading thread reads up to _BATCH shards in one call,
# straight into their reserved DRAM entries, with up to _BATCH_AHEAD shards in flight: the transfers of later
# batches overlap the verification of the first (into DRAM pages; a shard whose entry cannot be reserved is read
# as bytes, so up to _BATCH_AHEAD shards' bytes may be held when DRAM is full).
_BATCH = 4
_BATCH_AHEAD = 16
_READ_THREADS = 4  # per tier, shared by the store's concurrent gets
# Threads that decrypt sealed shards read ahead (KVStore._fill_sealed), shared by all tiers and gets: one beside
# the reading threads on two cores, more where there are more cores for concurrent loads.
_DECRYPT_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))
# Seconds close waits for batched reads under way (native code writing into DRAM pages: Mooncake's batch get);
# one stuck on a stalled server ends with the process.
_CLOSE_WAIT = 5.0


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


class _Expired(Exception):
    """A shard read from a tier is older than the tier's ``ttl_seconds``."""


def _raised(got: bytes | Exception | None) -> bytes | None:
    """One answer of :meth:`Tier.get_into_many`: the exception it holds raised, else itself."""
    if isinstance(got, Exception):
        raise got
    return got


def _padded(source: Callable[[int, torch.Tensor], None], last: int, tokens: int) -> Callable[[int, torch.Tensor], None]:
    """``source`` for a put whose chunk ``last`` (counted as ``source`` counts) is a tail of ``tokens`` tokens: the
    rest of that chunk is zeroed, so its pages never carry bytes of the KV they held before (another tenant's)."""
    def fill(first: int, dst: torch.Tensor) -> None:
        source(first, dst)
        if first <= last < first + dst.shape[0]:
            dst[last - first, :, :, :, tokens:].zero_()
    return fill


class KVStore:
    """KV chunks in a DRAM pool backed by secondary tiers. Thread-safe; use as a context manager."""

    def __init__(self, config: StoreConfig, tiers: list[Tier] | None = None, *, allocate_dram: bool = True) -> None:
        """``allocate_dram=False`` defers the DRAM pool's allocation to its first put or promotion (or
        ``store.dram.allocate()``): for a process that only looks up."""
        self.config = config
        self.chunk_tokens = config.chunk_tokens
        self.metrics = StoreMetrics()
        if config.otlp_traces_endpoint is not None:  # first: a missing SDK refuses the store before a tier opens
            tracing.configure(config.otlp_traces_endpoint, "kvtier")
        # Keys next: a key source that fails refuses the store before a tier opens.
        self._sealer = None
        if config.encryption is not None:
            try:
                from kvtier.sealing import Sealer  # the cryptography package, only where encryption is on
            except ImportError as exc:
                raise ConfigError(f"encryption: needs the cryptography package (pip install "
                                  f"'kvtier[encryption]'): {exc}") from exc

            self._sealer = Sealer(config.encryption, self._forgotten,
                                  on_unreadable=lambda exc: self._keyring_failed(exc, "read a secret of"))
        # With encryption, object names are keyed too (kvtier.keys): what a tier shows confirms no guessed prompt.
        self._name_key = b"" if self._sealer is None else self._sealer.keyring.naming_key()
        try:
            self.tiers = open_tiers(config) if tiers is None else tiers
        except BaseException:
            if self._sealer is not None:
                self._sealer.close()
            raise
        self._header_len = frame.HEADER_LEN if self._sealer is None else frame.SEALED_HEADER_LEN
        try:
            self._check_quotas()
            policy = POLICIES.resolve(config.dram.eviction, "dram.eviction")()
            self.dram = DramPool(config.dram.capacity_bytes, config.dram.page_bytes, policy,
                                 pin_memory=config.dram.pin_memory, on_evict=self._evicted, allocate=allocate_dram)
        except BaseException:
            for tier in self.tiers:
                tier.close()
            if self._sealer is not None:
                self._sealer.close()
            raise
        self.metrics.capacity_bytes.labels("dram").set(self.dram.capacity_bytes)
        self.metrics.watch_tiers(self.tiers)
        self.metrics.declare([t.name for t in self.tiers])
        # Bound once: a labels() lookup per chunk is measurable on the hot path.
        self._dram_written = self.metrics.bytes_written.labels("dram")
        self._dram_full = self.metrics.dropped.labels("dram", "dram_full")
        self._dram_evictions = self.metrics.evictions.labels("dram")
        self._hits = {name: self.metrics.hits.labels(name) for name in ["dram", *(t.name for t in self.tiers)]}
        specs = {spec.name: spec for spec in config.tiers}
        default = TierSpec(type="", name="", options={})  # tiers passed in without a spec
        spec = [specs.get(t.name, default) for t in self.tiers]
        self._tier_watchers: list[list[tuple[ShardKey, str]]] = []
        self._tier_watch_lock = threading.Lock()
        seal = None if self._sealer is None else self._sealer.seal
        self._writers = [CascadeWriter(t, self.dram, self.metrics, s, on_stored=self._tier_stored_hook(t.name),
                                       seal=seal) for t, s in zip(self.tiers, spec)]
        self._placement = Placement(config.placement)
        self._tier_named = {t.name: t for t in self.tiers}
        self._shared: OrderedDict[str, str] = OrderedDict()  # namespace -> the tenant share DRAM and tiers were told
        self._shared_lock = threading.Lock()
        self._read_outage = {t.name: Outage(t.name, "reads", s.retry_seconds, self.metrics)
                             for t, s in zip(self.tiers, spec)}
        self._watch_levels()
        self._shapes: OrderedDict[str, Shape] = OrderedDict()  # namespace id -> its shards' shape, bounded
        self._logged: set[tuple[str, str, str]] = set()  # kinds of contained tier faults already logged
        # Shards under keys this process lacks, read lately: until when reads and lookups plan without them.
        self._unopened: OrderedDict[tuple[str, ShardKey], float] = OrderedDict()
        self._unopened_lock = threading.Lock()
        self._ttl = {t.name: getattr(t.options, "ttl_seconds", None) for t in self.tiers}
        # Read-ahead from secondary tiers, a pool per tier: reads stuck in a stalled server hold up no other tier's.
        self._readers = {t.name: DaemonPool(f"kvtier-read-{t.name}", _READ_THREADS) for t in self.tiers}
        # Sealed shards read ahead are decrypted here, while the reading threads read the next ones.
        self._decrypting = None if self._sealer is None else DaemonPool("kvtier-decrypt", _DECRYPT_THREADS)
        self._closed = False
        if config.metrics_port is not None:
            self.metrics.serve(config.metrics_port, config.metrics_host)

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
            offset: int = 0, kv_heads: int | None = None) -> int:
        """Store the whole chunks of ``kv`` (``[layers, 2, rank's kv_heads, len(tokens) - offset, head_dim]``).

        ``kv`` holds ``tokens[offset:]`` (``offset`` is a whole number of chunks, e.g. what is known to be stored
        already); the earlier tokens only name the chunks. ``kv_heads`` is the model's number of KV heads
        (default: this rank's heads times ``tp_size``; give it when ranks replicate heads, see
        :func:`~kvtier.keys.rank_heads`). Returns ``offset`` plus the tokens from there on whose chunks are now
        all in DRAM; it stops at the first chunk that does not fit. Secondary tiers are written in the background.
        """
        if self._closed:
            raise RuntimeError("KVStore.put after close: its cascade writers have stopped")
        start = time.perf_counter()
        t = self.chunk_tokens
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"kv must be [layers, 2, kv_heads, tokens, head_dim], got shape {tuple(kv.shape)}")
        if offset % t or not 0 <= offset <= len(tokens):
            raise ValueError(f"offset must be a whole number of {t}-token chunks within the tokens, got {offset}")
        if kv.shape[3] != len(tokens) - offset:
            raise ValueError(f"kv holds {kv.shape[3]} tokens but {len(tokens) - offset} token ids were given "
                             f"after offset {offset}")
        heads = rank_heads(kv.shape[2] * tp_size if kv_heads is None else kv_heads, tp_rank, tp_size)
        if heads.count != kv.shape[2]:
            raise ValueError(f"kv holds {kv.shape[2]} KV heads, rank {tp_rank} of {tp_size} holds {heads}")

        def copy(first: int, dst: torch.Tensor) -> None:
            # Asynchronous only into pinned pages (waited for before commit), never into a buffer read at once.
            src = kv[:, :, :, first * t:(first + dst.shape[0]) * t]
            dst.copy_(src.unflatten(3, (dst.shape[0], t)).permute(3, 0, 1, 2, 4, 5),
                      non_blocking=kv.is_cuda and dst.is_pinned())

        return self._put(ns, tokens, frame.ShardMeta(kv.shape[0], t, kv.shape[4], kv.dtype, heads), copy, offset,
                         kv.device, start)

    def put_from(self, ns: Namespace, tokens: Tokens, source: Callable[[int, torch.Tensor], None], *, layers: int,
                 head_dim: int, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, offset: int = 0,
                 kv_heads: int, device: torch.device | str = "cpu", tail: bool = False) -> int:
        """Store the whole chunks of ``tokens[offset:]``, having ``source`` write their KV straight into DRAM: the
        mirror of :meth:`load`, with no staging copy of the prompt. With ``tail``, the tokens after the last whole
        chunk are stored too, as a tail (:func:`~kvtier.keys.tail_keys`): a chunk whose first ``len(tokens) %
        chunk_tokens`` tokens are those, ``source`` asked for it like any chunk (only those tokens are read from
        it; the store zeroes the rest).

        ``source(first, dst)`` fills ``dst`` ``[count, layers, 2, rank's heads, chunk_tokens, head_dim]`` (any
        strides: a view of DRAM pages, or a one-chunk buffer) with ``count`` consecutive chunks from chunk
        ``first`` (counted from ``offset``'s chunk); only chunks DRAM lacks are asked for. ``device`` is where
        ``source`` copies from (a CUDA source's asynchronous copies are waited for before the chunks become
        visible). Returns what :meth:`put` returns; a source that raises stores none of this call's chunks.
        """
        if self._closed:
            raise RuntimeError("KVStore.put_from after close: its cascade writers have stopped")
        start = time.perf_counter()
        t = self.chunk_tokens
        if offset % t or not 0 <= offset <= len(tokens):
            raise ValueError(f"offset must be a whole number of {t}-token chunks within the tokens, got {offset}")
        meta = frame.ShardMeta(layers, t, head_dim, dtype, rank_heads(kv_heads, tp_rank, tp_size))
        return self._put(ns, tokens, meta, source, offset, torch.device(device), start, tail)

    def _put(self, ns: Namespace, tokens: Tokens, meta: frame.ShardMeta, source: Callable[[int, torch.Tensor], None],
             offset: int, device: torch.device, start: float, tail: bool = False) -> int:
        t = self.chunk_tokens
        ns = self.named(ns)
        tenant = self._register(ns, create=True)
        if self._sealer is not None and tenant is None:
            return offset  # no tenant key (counted): nothing a forget could not end is kept, in DRAM either
        owner = None if tenant is None else tenant.key_id
        decision = self._placement.decide(ns)
        self._apply_share(ns, decision)
        self._remember_shape(ns.id, Shape.of(meta))  # the caller's own KV: it defines the shape
        first = offset // t
        held = 0  # leading chunks from `first` on now in DRAM
        namespace = ns.id
        reserved: list[tuple[int, DramEntry]] = []
        chunks = [key.hex() for key in chunk_keys(ns, tokens, t, tail=tail)]
        if tail and len(tokens) % t:
            source = _padded(source, len(chunks) - 1 - first, len(tokens) % t)
        wanted = [(ShardKey(namespace, chunk, meta.heads), chunks[i - 1] if i else None)
                  for i, chunk in enumerate(chunks) if i >= first]
        try:  # phase 1: reserve every chunk, then copy them all (asynchronously from a CUDA tensor)
            # i: the chunk's index from offset's
            for i, entry in enumerate(self.dram.reserve_chunks(wanted, meta, owner)):
                if entry == "full":
                    # Chunks after a missing one could never be reached by a prefix lookup: not reserved.
                    self._dram_full.inc()
                    break
                if isinstance(entry, DramEntry):
                    reserved.append((i, entry))
                held += 1
            self.dram.fill_chunks(source, reserved, device)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        except BaseException:
            if device.type == "cuda":  # copies already started must land before their pages are handed out again
                torch.cuda.current_stream(device).synchronize()
            for _, entry in reserved:
                self.dram.abort(entry)
            raise
        self._dram_written.inc(meta.nbytes * len(reserved))
        writers = self._writers_for(decision.allowed, self._writers, len(reserved))
        expires = self._put_expiry(decision.allowed, time.time())
        for _, entry in reserved:  # phase 2: the bytes are in DRAM; make them visible and cascade them
            entry.expires = expires
            self.dram.commit(entry, keep_refs=len(writers))
            for writer in writers:
                writer.submit(entry)
        if tenant is not None and reserved and not self._sealer.current(tenant):  # type: ignore[union-attr]
            self.dram.discard_owned({tenant.key_id})  # forgotten while this put ran: what it committed goes too
            held = 0  # and the caller is told nothing was stored
        self.metrics.put_seconds.observe(time.perf_counter() - start)
        return min(offset + held * t, len(tokens))

    def held(self, ns: Namespace, tokens: Tokens, *, tp_rank: int = 0, tp_size: int = 1,
             kv_heads: int, tail: bool = False) -> int:
        """Leading tokens (whole chunks, and with ``tail`` the tail of ``tokens``) whose shard for this rank's
        heads is in DRAM: what a put would skip.

        Asks DRAM only (no tier I/O), so a caller can decide cheaply what to gather before a put.
        """
        heads = rank_heads(kv_heads, tp_rank, tp_size)
        ns = self.named(ns)
        n = 0
        for key in chunk_keys(ns, tokens, self.chunk_tokens, tail=tail):
            if not self.in_dram(ns.id, key.hex(), heads):
                break
            n += 1
        return min(n * self.chunk_tokens, len(tokens))

    def watch_tier_writes(self) -> int:
        """Start recording, for one reader, every shard a secondary tier came to hold through the cascade;
        returns the reader's handle for :meth:`take_tier_writes` (nothing is recorded without a reader)."""
        with self._tier_watch_lock:
            self._tier_watchers.append([])
            return len(self._tier_watchers) - 1

    def take_tier_writes(self, watcher: int) -> list[tuple[ShardKey, str]]:
        """(shard, tier name) for each cascade write that landed since this reader's last call, in order."""
        with self._tier_watch_lock:
            landed, self._tier_watchers[watcher] = self._tier_watchers[watcher], []
        return landed

    def _tier_stored_hook(self, tier: str) -> Callable[[ShardKey], None]:
        def stored(key: ShardKey) -> None:
            if self._tier_watchers:
                with self._tier_watch_lock:
                    for landed in self._tier_watchers:
                        landed.append((key, tier))
        return stored

    def named(self, ns: Namespace) -> Namespace:
        """``ns`` as this store names it in DRAM and the tiers: with encryption, its names keyed by the keyring's
        naming key (:attr:`~kvtier.keys.Namespace.name_key`), the same in every process sharing the keyring; without,
        ``ns`` itself. Its :attr:`~kvtier.keys.Namespace.id` is what ``kvtier cache ls`` shows and what a placement
        rule's ``namespace`` names."""
        return ns.keyed(self._name_key)

    def in_dram(self, namespace: str, chunk: str, heads: HeadRange) -> bool:
        """Whether DRAM holds ``heads`` of one chunk (namespace id and chunk key in hex)."""
        ranges = [r for r in self.dram.ranges(namespace, chunk) if r.total == heads.total]
        return cover(ranges, heads.start, heads.stop) is not None

    def _readable(self, decision: Decision, local_only: bool) -> list[Tier]:
        """The secondary tiers a lookup or read of a namespace asks: those its placement lets its KV reach (a tenant
        kept in DRAM sends its keys to none), only the local ones with ``local_only``."""
        return [t for t in self.tiers if decision.admits(t.name) and (t.local or not local_only)]

    def _writers_for(self, allowed: frozenset[str] | None, writers: list[CascadeWriter],
                     shards: int) -> list[CascadeWriter]:
        """The cascade writers a namespace's shards may go to (placement rules); those withheld are counted."""
        if allowed is None:
            return writers
        for writer in writers:
            if writer.tier.name not in allowed and shards:
                self.metrics.placement_withheld.labels(writer.tier.name).inc(shards)
        return [w for w in writers if w.tier.name in allowed]

    def _remember_shape(self, namespace: str, shape: Shape) -> None:
        self._shapes[namespace] = shape
        self._shapes.move_to_end(namespace)
        if len(self._shapes) > _SHAPES_KEPT:  # one per tenant salt: keep the recent ones
            self._shapes.popitem(last=False)

    # -- lookup ------------------------------------------------------------------------------------------------
    @property
    def remote_tiers(self) -> bool:
        """Whether a lookup may wait on a network (a tier that is not :attr:`Tier.local`)."""
        return any(not tier.local for tier in self.tiers)

    def lookup(self, ns: Namespace, tokens: Tokens, *, kv_heads: int | None = None,
               elsewhere: Callable[[str, str], bool] | None = None, local_only: bool = False,
               count: bool = True, tail_block: int | None = None) -> int:
        """How many leading tokens (whole chunks, and perhaps a tail) are available, every head present, in any
        tiers.

        With ``tail_block`` (the engine's block size, a divisor of the chunk size), a tail (see :meth:`put_from`)
        of whole ``tail_block``-token blocks right after the whole chunks found counts too: the longest one held
        whose tokens are all in ``tokens``. A tier across a network is asked about tails only once a whole chunk
        was found (a miss costs no more than without tails); one that answers any number of keys in one round trip
        (:attr:`~kvtier.tiers.base.Tier.heads_in_one_call`) is asked about the tails after the last whole chunk
        of ``tokens`` with the chunks. A local tier is asked about each tail in turn, longest first (its
        ``heads`` looks on disk only up to the first key its index lacks).

        ``kv_heads``, when given, is the model's KV head count: shards recorded with another count are ignored.
        ``elsewhere(namespace id, chunk key)`` says whether a chunk is held whole outside this store, e.g. in
        the DRAM of the engine's worker processes: such chunks count as found, and no tier is asked for them.
        ``local_only`` asks only DRAM and the :attr:`~kvtier.tiers.base.Tier.local` tiers: an answer that never
        waits on a network. ``count=False`` (implied by ``local_only``) leaves the lookup metrics to the caller
        (:meth:`count_lookup`), e.g. when one answer takes several calls. Never raises for a tier's fault: an
        unreachable or misbehaving tier holds nothing.
        """
        t = self.chunk_tokens
        if tail_block is not None and not (0 < tail_block <= t and t % tail_block == 0):
            raise ValueError(f"tail_block must divide the chunk size {t}, got {tail_block}")
        ns = self.named(ns)
        keys = chunk_keys(ns, tokens, t)
        tiers = self._readable(self._placement.decide(ns), local_only)

        def tails_after(n: int) -> tuple[list[str], list[int]]:
            """The tails to try after ``n`` whole chunks, longest first (none without ``tail_block``)."""
            if not tail_block or tail_block == t or n * t + tail_block > len(tokens):
                return [], []
            lengths = list(range(min(t - 1, len(tokens) - n * t) // tail_block * tail_block, 0, -tail_block))
            found = tail_keys(ns, keys[n - 1] if n else ns.digest, tokens[n * t:n * t + lengths[0]], n * t, lengths)
            return [k.hex() for k in found], lengths

        last, last_lengths = tails_after(len(keys))
        n, asked = self._available(ns.id, [k.hex() for k in keys], kv_heads, elsewhere, tiers, last)
        found = n * t
        tails, lengths = (last, last_lengths) if n == len(keys) else tails_after(n)
        if tails:
            found += self._longest(ns.id, tails, lengths, kv_heads, elsewhere,
                                   tiers if n else [tier for tier in tiers if tier.local],
                                   asked if n == len(keys) else {})
        if count and not local_only:
            self.count_lookup(len(tokens), found)
        return found

    def count_lookup(self, tokens: int, found: int) -> None:
        """Count one lookup in the metrics (a caller whose final answer came from a ``local_only`` lookup)."""
        self.metrics.lookup_tokens.inc(tokens)
        self.metrics.lookup_hit_tokens.inc(found)

    def _available(self, namespace: str, chunks: list[str], kv_heads: int | None,
                   elsewhere: Callable[[str, str], bool] | None, tiers: list[Tier],
                   extra: list[str]) -> tuple[int, dict[str, list[list[HeadRange]]]]:
        """The leading chunks available, and what each tier asked said of the objects ``extra``: asked with the
        chunks DRAM lacks, of the tiers across a network that answer in one round trip."""
        def in_memory(chunk: str) -> bool:
            return full_cover(self.dram.ranges(namespace, chunk), kv_heads) or \
                (elsewhere is not None and elsewhere(namespace, chunk))

        n = 0
        while n < len(chunks) and in_memory(chunks[n]):
            n += 1
        if n == len(chunks) or not tiers:
            return n, {}
        rest = chunks[n:]
        asked: dict[str, list[list[HeadRange]]] = {}
        per_tier = []
        for tier in tiers:
            ride = extra if extra and not tier.local and tier.heads_in_one_call else []
            heads = self._tier_heads(tier, namespace, rest + ride)
            if ride:
                asked[tier.name] = heads[len(rest):]
            per_tier.append(heads)
        for i, chunk in enumerate(rest):
            ranges = self.dram.ranges(namespace, chunk)
            for heads in per_tier:
                ranges.extend(heads[i])
            if not (full_cover(ranges, kv_heads) or in_memory(chunk)):
                break
            n += 1
        return n, asked

    def _longest(self, namespace: str, tails: list[str], lengths: list[int], kv_heads: int | None,
                 elsewhere: Callable[[str, str], bool] | None, tiers: list[Tier],
                 asked: dict[str, list[list[HeadRange]]]) -> int:
        """The longest of ``lengths`` whose tail (of ``tails``, longest first) is available, or 0. ``asked``:
        answers some tiers gave already. Each other tier is asked about the tails longer than the longest DRAM,
        ``elsewhere`` or the answers hold: a tier across a network once, a local one tail by tail until one is
        whole."""
        ranges = [self.dram.ranges(namespace, tail) for tail in tails]
        for answers in asked.values():
            for found, more in zip(ranges, answers):
                found.extend(more)

        def whole(i: int) -> bool:
            return full_cover(ranges[i], kv_heads) or (elsewhere is not None and elsewhere(namespace, tails[i]))

        held = next((i for i in range(len(tails)) if whole(i)), len(tails))
        for tier in tiers:
            if not held or tier.name in asked:
                continue
            if not tier.local:
                for found, heads in zip(ranges, self._tier_heads(tier, namespace, tails[:held])):
                    found.extend(heads)
                continue
            for i in range(held):
                ranges[i].extend(self._tier_heads(tier, namespace, [tails[i]])[0])
                if whole(i):
                    break
        return next((lengths[i] for i in range(len(tails)) if whole(i)), 0)

    def _tier_heads(self, tier: Tier, namespace: str, chunks: list[str]) -> list[list[HeadRange]]:
        outage = self._read_outage[tier.name]
        if outage.resting():
            return [[] for _ in chunks]
        try:
            heads = tier.heads(namespace, chunks)
        except ObjectError as exc:
            self._unexpected(tier, "lookup", exc, "corrupt")
            return [[] for _ in chunks]
        except TierError as exc:
            self.metrics.read_errors.labels(tier.name).inc()
            outage.failed(exc)
            return [[] for _ in chunks]
        except Exception as exc:  # noqa: BLE001 a tier's bug or a malformed reply: nothing found, counted
            self._unexpected(tier, "lookup", exc)
            return [[] for _ in chunks]
        outage.succeeded()
        if not isinstance(heads, list) or len(heads) != len(chunks) or not all(
                isinstance(found, list) and all(valid_range(h) for h in found) for found in heads):
            self._unexpected(tier, "lookup", ValueError(f"malformed answer for {len(chunks)} chunks: {heads!r:.200}"))
            return [[] for _ in chunks]
        if self._unopened:  # objects under keys this process lacks were read lately: as good as absent here
            now = time.monotonic()
            with self._unopened_lock:
                heads = [[h for h in found if self._unopened.get((tier.name, ShardKey(namespace, chunk, h)), 0) < now]
                         for chunk, found in zip(chunks, heads)]
        return heads

    def _unexpected(self, tier: Tier, what: str, exc: BaseException, counter: str = "read_errors") -> None:
        """Count a fault confined to one call or object (not an outage); log its first kind per tier."""
        getattr(self.metrics, "corrupt" if counter == "corrupt" else "read_errors").labels(tier.name).inc()
        kind = (tier.name, what, type(exc).__name__)
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("tier %s: %s failed (%s: %s); a miss, the tier stays in use (further such failures are "
                        "counted, not logged)", tier.name, what, type(exc).__name__, exc)

    # -- get ---------------------------------------------------------------------------------------------------
    def get(self, ns: Namespace, tokens: Tokens, *, tp_rank: int = 0, tp_size: int = 1,
            out: torch.Tensor | None = None, offset: int = 0, kv_heads: int | None = None) -> torch.Tensor | None:
        """The canonical KV ``[layers, 2, rank's kv_heads, len(tokens) - offset, head_dim]`` of
        ``tokens[offset:]`` for this rank's heads, or None if any of those chunks is missing or unreadable.
        ``tokens`` and ``offset`` must be whole chunks; the tokens before ``offset`` only name the chunks.

        ``out``, when given, receives the data (and is returned); it must have the shape above. When the result
        is None, ``out`` may hold part of the data and must not be used. Every shard must match what is expected
        of it (its key, head range, chunk size, and the layers, head size and dtype of ``out``, else of an earlier
        put in this namespace by this process, else of the first shard read); one that does not is a miss,
        counted and removed (from DRAM too).
        """
        wanted = None
        if out is not None:
            if out.dim() != 5:
                raise ValueError(f"out must be [layers, 2, heads, tokens, head_dim], got shape {tuple(out.shape)}")
            wanted = Shape(out.shape[0], out.shape[4], out.dtype)
        result: list[torch.Tensor] = []

        def copy(plans: list[list[Piece]], shape: Shape) -> None:
            got = self._copy_out(plans, shape, out)
            if got.is_cuda:  # copies from pinned pages run asynchronously: end them before the pins are released
                torch.cuda.current_stream(got.device).synchronize()
            result.append(got)

        if not self._read(ns, tokens, tp_rank, tp_size, offset, kv_heads, wanted, copy):
            return None
        return result[0]

    def load(self, ns: Namespace, tokens: Tokens, sink: Callable[[int, torch.Tensor], None], *, layers: int,
             head_dim: int, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, offset: int = 0,
             kv_heads: int | None = None, device: torch.device | str = "cpu", local_only: bool = False,
             tail: bool = False) -> int:
        """Hand the canonical KV of ``tokens[offset:]`` (this rank's heads) to ``sink`` without copying it first.

        ``sink(first, kv)`` gets ``kv`` ``[count, layers, 2, heads, chunk_tokens, head_dim]`` for ``count``
        consecutive chunks from chunk ``first`` (counted from ``offset``'s chunk): a view of DRAM pages where
        they lie at one stride, else of one chunk's bytes as read; valid only during the call, never written.
        Returns how many tokens from ``offset`` on were handed over: all of them, or the chunks before the first
        one missing or unreadable (the caller recomputes the rest; 0: ``sink`` was never called). The checks are
        :meth:`get`'s, against ``layers``, ``head_dim`` and ``dtype``. ``device`` is where ``sink`` copies
        to: for another device than the CPU only gap-free runs are grouped, so each view is dense (a copy of a
        view with gaps to a GPU is staged through a temporary). ``local_only`` reads DRAM and the
        :attr:`~kvtier.tiers.base.Tier.local` tiers only: a load that must never wait on a network. With
        ``tail``, ``tokens`` may end inside a chunk: the tail after the last whole chunk (see :meth:`put_from`) is
        handed over as a chunk of which only those tokens count (the count returned ends with them).
        """
        def feed(plans: list[list[Piece]], shape: Shape) -> None:
            for first, kv in self._chunk_views(plans, shape, torch.device(device)):
                sink(first, kv)

        chunks = self._read(ns, tokens, tp_rank, tp_size, offset, kv_heads, Shape(layers, head_dim, dtype), feed,
                            partial=True, local_only=local_only, tail=tail)
        return min(chunks * self.chunk_tokens, len(tokens) - offset)

    def _read(self, ns: Namespace, tokens: Tokens, tp_rank: int, tp_size: int, offset: int,
              kv_heads: int | None, wanted: Shape | None, use: Callable[[list[list[Piece]], Shape], None],
              partial: bool = False, local_only: bool = False, tail: bool = False) -> int:
        """Plan the chunks of ``tokens[offset:]`` (pinning DRAM entries, fetching and promoting the rest), hand
        the plans to ``use``, then release what was pinned; returns how many chunks were handed over. On a miss:
        0 (``use`` not called), or with ``partial`` the chunks before it."""
        start = time.perf_counter()
        t = self.chunk_tokens
        if (len(tokens) % t and not tail) or offset % t or not 0 <= offset < len(tokens):
            raise ValueError(f"get needs a whole number of {t}-token chunks after a whole-chunk offset, got "
                             f"{len(tokens)} tokens and offset {offset}")
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got tp_rank={tp_rank}, tp_size={tp_size}")
        if kv_heads is not None:
            rank_heads(kv_heads, tp_rank, tp_size)  # the caller's own degree must fit its model: raises if not
        ns = self.named(ns)
        tenant = self._register(ns, create=False)
        decision = self._placement.decide(ns)
        self._apply_share(ns, decision)  # what this read promotes into DRAM counts against the tenant's share
        shape = self._shapes.get(ns.id)
        if wanted is not None:
            if shape is not None and wanted != shape:
                raise ValueError(f"the caller expects {wanted}, the KV put in this namespace is {shape}")
            shape = wanted
        chunks = [k.hex() for k in chunk_keys(ns, tokens, t, tail=tail)]
        read = Read(ns.id, tp_rank, tp_size, kv_heads, shape, self._readable(decision, local_only),
                     allowed=decision.allowed, tenant=tenant, owner=None if tenant is None else tenant.key_id)
        try:
            self._plan_reads(read, chunks, offset // t)
            plans = []
            for i in range(offset // t, len(chunks)):
                pieces = self._plan_chunk(read, chunks[i], chunks[i - 1] if i else None)
                if pieces is None:
                    self.metrics.misses.inc()
                    if not partial:
                        return 0
                    break
                plans.append(pieces)
            if not plans:
                return 0
            assert read.shape is not None, "a planned chunk fixes the shape"
            use(plans, read.shape)
        finally:
            for started in read.started.values():  # not needed after all (a miss before them)
                if isinstance(started, Filling):
                    self._abort_when_done(started)
                else:
                    started.cancel()  # one not yet running never starts
            for entry in read.pinned:
                self.dram.release(entry)
        self.metrics.get_seconds.observe(time.perf_counter() - start)
        return len(plans)

    def _plan_reads(self, read: Read, chunks: list[str], first: int) -> None:
        """Ask each tier once which of ``chunks[first:]`` it holds, for the chunks DRAM and the tiers before it
        lack, and line up the shard reads that would fill them, to be started :data:`READ_AHEAD` ahead of their
        use."""
        if not read.tiers:
            return
        parents = {c: chunks[i - 1] if i else None for i, c in enumerate(chunks)}
        in_dram = {c: self._plan_heads(read, self.dram.ranges(read.namespace, c)) for c in chunks[first:]}
        missing = [c for c, plan in in_dram.items() if plan is None]
        if missing:  # what this read fetches reserves DRAM, evicting idle entries: first pin the read's own
            for chunk, plan in in_dram.items():
                for rng, _, _ in [] if plan is None else plan[1]:
                    read.pinned.extend(self.dram.acquire(read.namespace, chunk, [rng], read.owner) or [])
        for tier in read.tiers:
            if not missing:
                break
            answer = dict(zip(missing, self._tier_heads(tier, read.namespace, missing)))
            read.heads[tier.name] = answer
            still = []
            for chunk in missing:
                dram = self.dram.ranges(read.namespace, chunk)
                found = self._plan_heads(read, dram + answer[chunk])
                if found is None:
                    still.append(chunk)
                    continue
                if self._reads_ahead(tier) or tier.batch_reads:
                    read.ahead.extend((tier, ShardKey(read.namespace, chunk, rng), parents[chunk])
                                      for rng, _, _ in found[1] if rng not in dram)
            missing = still
        if missing:  # no source holds this chunk: the read stops there, so nothing beyond it is read ahead
            order = {c: i for i, c in enumerate(chunks)}
            stop = min(order[c] for c in missing)
            read.ahead = [item for item in read.ahead if order[item[1].chunk] < stop]
        read.ahead.reverse()  # popped from the end, in chunk order
        self._read_ahead(read)

    def _reads_ahead(self, tier: Tier) -> bool:
        """Whether a get reads ``tier``'s shards ahead: where the tier asks for it (on reading threads), and for
        every tier when objects are sealed (a local disk's shard is read on the caller's thread and decrypted on
        another while the next one is read: :meth:`_fill_sealed`)."""
        return tier.read_ahead or self._decrypting is not None

    def _read_ahead(self, read: Read) -> None:
        """Start the next lined-up shard reads, keeping at most :data:`READ_AHEAD` of them started and not yet
        taken (running or done: a done one holds its bytes). Once the read knows its shape, each reads straight
        into a DRAM entry reserved for it (:class:`Filling`), verified there by the reading thread (a sealed shard
        from a local disk: read here, decrypted on a decrypting thread, :meth:`_fill_sealed`): no read buffer, and
        the check overlaps the next read. A tier that batches its reads gets them :data:`_BATCH` at a time,
        up to :data:`_BATCH_AHEAD` started (:meth:`_read_batch`)."""
        while read.ahead:
            tier, key, parent = read.ahead[-1]
            batch = tier.batch_reads and read.shape is not None
            if (_BATCH_AHEAD - len(read.started) < min(_BATCH, len(read.ahead))) if batch else \
                    len(read.started) >= READ_AHEAD:
                break  # (a batch waits for room for a whole one)
            read.ahead.pop()
            if self._read_outage[tier.name].resting():
                continue
            if batch:
                keys = [(key, parent)]
                while read.ahead and read.ahead[-1][0] is tier and len(keys) < _BATCH:
                    keys.append(read.ahead.pop()[1:])
                self._read_batch(read, tier, keys)
                continue
            readers = self._readers[tier.name]
            entry = None if read.shape is None else self.dram.reserve(
                key, read.shape.meta(self.chunk_tokens, key.heads), parent, read.owner)
            if not isinstance(entry, DramEntry):
                # the shape not known yet, the shard being written by another read, or no room: its bytes
                read.started[(tier.name, key)] = readers.submit(functools.partial(self._get, tier, key))
                continue
            try:
                if self._decrypting is not None and tier.local and not tier.read_ahead:
                    future = self._fill_sealed(tier, key, entry)
                else:
                    future = readers.submit(functools.partial(self._read_into, tier, key, entry))
            except BaseException:
                self.dram.abort(entry)  # e.g. the store closed meanwhile
                raise
            read.started[(tier.name, key)] = Filling(entry, future)

    def _read_batch(self, read: Read, tier: Tier, keys: list[tuple[ShardKey, str | None]]) -> None:
        """Start one batched read of ``keys`` from ``tier`` into DRAM entries reserved for them (a shard whose entry
        cannot be reserved is read as bytes, alone). Each shard's future is marked running from the start: a
        read that no longer needs it cannot cancel it, and aborts its entry only once the batch has ended."""
        assert read.shape is not None
        readers = self._readers[tier.name]
        batch: list[tuple[ShardKey, DramEntry, Future[float | None]]] = []
        try:
            for key, parent in keys:
                entry = self.dram.reserve(key, read.shape.meta(self.chunk_tokens, key.heads), parent, read.owner)
                if not isinstance(entry, DramEntry):
                    read.started[(tier.name, key)] = readers.submit(functools.partial(self._get, tier, key))
                    continue
                future: Future[float | None] = Future()
                future.set_running_or_notify_cancel()
                batch.append((key, entry, future))
            if batch:
                readers.submit(lambda: self._fill_batch(tier, batch))
        except BaseException:
            for _, entry, _ in batch:
                self.dram.abort(entry)  # e.g. the store closed meanwhile
            raise
        for key, entry, future in batch:
            read.started[(tier.name, key)] = Filling(entry, future)

    def _fill_batch(self, tier: Tier, batch: list[tuple[ShardKey, DramEntry, Future[float | None]]]) -> None:
        """On a reading thread: one :meth:`Tier.get_into_many` of the batch, then each shard verified in its
        entry, its future given the outcome (what :meth:`_read_into` returns). Every future ends, whatever
        happens (a load waits on them)."""
        start = time.perf_counter()
        try:
            got: list[bytes | Exception | None] = tier.get_into_many(
                [(key, self._header_len, self.dram.views(entry)) for key, entry, _ in batch])
            if not isinstance(got, list) or len(got) != len(batch):
                raise ValueError(f"get_into_many returned {len(got) if isinstance(got, list) else got!r:.100} "
                                 f"answers for {len(batch)} reads")
        except Exception as exc:  # noqa: BLE001 each read's outcome, counted as its fault (_read_into)
            got = [exc] * len(batch)
        except BaseException as exc:  # e.g. an interrupt: the reads fail, the loads waiting on them go on
            for _, _, future in batch:
                future.set_exception(exc)
            raise
        for (key, entry, future), head in zip(batch, got):
            try:
                future.set_result(self._read_into(tier, key, entry, functools.partial(_raised, head), start))
            except BaseException as exc:  # noqa: BLE001 handed to the load waiting on it
                future.set_exception(exc)

    def _fill_sealed(self, tier: Tier, key: ShardKey, entry: DramEntry) -> Future[float | None]:
        """Read ahead a sealed shard from a local tier read inline (a disk): read here and now into its DRAM entry
        as stored (the payload still encrypted), its decryption there and the checks (:meth:`_read_into`) handed
        to the decrypting threads; the future gives their outcome. The caller reads the next shard while this one
        is decrypted: reading and decrypting run on two cores, a whole shard per call, so neither thread waits on
        the other for the GIL between pieces (``benchmarks/bench_sealing.py``). A shard missing or unreadable is
        counted here (:meth:`_read_into`, as any read's fault) and its future ends at once."""
        start = time.perf_counter()
        future: Future[float | None] = Future()
        future.set_running_or_notify_cancel()  # read already: cancelling it would not spare the work
        head: bytes | Exception | None
        try:
            head = tier.get_into(key, self._header_len, self.dram.views(entry))
        except Exception as exc:  # noqa: BLE001 the read's outcome, counted as its fault (_read_into)
            head = exc
        if not isinstance(head, bytes):  # nothing to decrypt; an interrupt here reaches the caller
            future.set_result(self._read_into(tier, key, entry, lambda: _raised(head), start))
            return future

        def verify() -> None:
            try:
                future.set_result(self._read_into(tier, key, entry, lambda: head, start))
            except BaseException as exc:  # noqa: BLE001 handed to the load waiting on it
                future.set_exception(exc)

        assert self._decrypting is not None
        self._decrypting.submit(verify)  # raises once the store is closed: the caller aborts the entry
        return future

    def _get(self, tier: Tier, key: ShardKey) -> Fetched | None:
        """Read and verify one shard (on any thread); raises what the tier or the check raises."""
        start = time.perf_counter()
        blob = tier.get(key)
        if blob is None:
            return None
        header, payload = frame.decode(blob, expected=key, opener=self._sealer)
        return Fetched(header, payload, len(blob), time.perf_counter() - start)

    def _plan_chunk(self, read: Read, chunk: str, parent: str | None) -> list[Piece] | None:
        """Where this rank's heads of one chunk come from: DRAM alone, else DRAM plus each tier in turn."""
        sources: list[str | Tier] = ["dram", *read.tiers]
        for source in sources:
            # A failed piece (missing or corrupt) is removed from its tier, so each retry plans without it.
            for attempt in range(_REPLANS):
                ranges = self.dram.ranges(read.namespace, chunk)
                if isinstance(source, Tier):
                    answers = read.heads.setdefault(source.name, {})
                    if attempt or chunk not in answers:  # a re-plan asks again: the last answer was wrong
                        answers[chunk] = self._tier_heads(source, read.namespace, [chunk])[0]
                    ranges += answers[chunk]
                found = self._plan_heads(read, ranges)
                if found is None:
                    break
                want, plan = found
                pieces = self._gather(read, chunk, parent, plan, want.start)
                if pieces is not None:
                    self._hits[source if isinstance(source, str) else source.name].inc()
                    return pieces
        return None

    @staticmethod
    def _plan_heads(read: Read, ranges: list[HeadRange]) -> tuple[HeadRange, list[tuple[HeadRange, int, int]]] \
            | None:
        """This rank's heads and the ranges that cover them. Without ``kv_heads``, each head count recorded for
        the chunk is tried in turn (a tier may hold shards that claim another count)."""
        totals = [read.kv_heads] if read.kv_heads is not None else sorted({r.total for r in ranges})
        for total in totals:
            try:
                want = rank_heads(total, read.tp_rank, read.tp_size)
            except ValueError:
                continue
            plan = cover([r for r in ranges if r.total == total], want.start, want.stop)
            if plan is not None:
                return want, plan
        return None

    def _gather(self, read: Read, chunk: str, parent: str | None, plan: list[tuple[HeadRange, int, int]],
                lo: int) -> list[Piece] | None:
        """Pin the planned DRAM entries and fetch the rest; None if a piece went missing or does not fit."""
        pieces: list[Piece] = []
        for rng, a, b in plan:
            entries = self.dram.acquire(read.namespace, chunk, [rng], read.owner)
            source: DramEntry | torch.Tensor | None
            if entries is not None:
                read.pinned.extend(entries)
                source = entries[0]
                if not read.admit(source.meta, self.chunk_tokens):
                    # Put by a caller with another shape, or promoted by a read that expected nothing: not
                    # what this read needs. Drop it, so the next put of this chunk stores the right one.
                    log.warning("dram: dropping %s: holds %s, this read expects %s", source.key.name,
                                Shape.of(source.meta), read.shape)
                    self.metrics.corrupt.labels("dram").inc()
                    self.dram.discard(source)
                    return None
            else:
                source = self._fetch(read, ShardKey(read.namespace, chunk, rng), parent)
                if source is None:
                    return None
            pieces.append(Piece(source, a - rng.start, a - lo, b - a))
        return pieces

    def _copy_out(self, plans: list[list[Piece]], shape: Shape, out: torch.Tensor | None) -> torch.Tensor:
        """Copy every chunk into ``out`` (allocated when None), from :meth:`_chunk_views`: consecutive chunks each
        served whole by one DRAM entry, laid out at a fixed stride, move in one copy."""
        t = self.chunk_tokens
        full = (shape.layers, 2, sum(p.count for p in plans[0]), len(plans) * t, shape.head_dim)
        if out is None:
            out = torch.empty(full, dtype=shape.dtype)
        elif tuple(out.shape) != full or out.dtype != shape.dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, the stored KV is {full} {shape.dtype}")
        for first, kv in self._chunk_views(plans, shape, out.device):
            count = kv.shape[0]
            dst = out[:, :, :, first * t:(first + count) * t].unflatten(3, (count, t)).permute(3, 0, 1, 2, 4, 5)
            dst.copy_(kv, non_blocking=out.is_cuda and kv.is_pinned())
        return out

    def _chunk_views(self, plans: list[list[Piece]], shape: Shape,
                     device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """Each planned chunk as ``[count, layers, 2, heads, T, head_dim]`` views, consecutive DRAM chunks at one
        stride together; a chunk assembled from several head ranges is copied into a buffer of its own."""
        t = self.chunk_tokens
        views: list[tuple[int, torch.Tensor]] = []
        whole = [(i, p[0].source) for i, p in enumerate(plans)
                 if len(p) == 1 and isinstance(p[0].source, DramEntry) and p[0].count == p[0].source.meta.heads.count]
        done: set[int] = set()
        for run in self.dram.runs(whole, device):
            i0, entry = run[0]
            if len(entry.extents) == 1:
                views.append((i0, self.dram.run_view(entry, len(run))))
                done.update(i for i, _ in run)
        for i, pieces in enumerate(plans):
            if i in done:
                continue
            if len(pieces) == 1:
                piece = pieces[0]
                src = self.dram.tensor(piece.source) if isinstance(piece.source, DramEntry) else piece.source
                views.append((i, src[:, :, piece.src:piece.src + piece.count].unsqueeze(0)))
                continue
            heads = sum(p.count for p in pieces)
            buf = torch.empty((1, shape.layers, 2, heads, t, shape.head_dim), dtype=shape.dtype)
            for piece in pieces:
                src = self.dram.tensor(piece.source) if isinstance(piece.source, DramEntry) else piece.source
                buf[0, :, :, piece.dst:piece.dst + piece.count].copy_(src[:, :, piece.src:piece.src + piece.count])
            views.append((i, buf))
        return sorted(views, key=lambda v: v[0])

    def _fetch(self, read: Read, key: ShardKey, parent: str | None) -> DramEntry | torch.Tensor | None:
        """Read one shard from the first tier that holds a valid copy and promote it into DRAM.

        Returns the promoted DRAM entry, pinned for the caller (added to ``read.pinned``), so the copy out joins
        the DRAM runs; or, when DRAM has no room, a tensor over the fetched bytes. Once the read knows its shape,
        a tier read inline (not ahead) reads straight into the reserved DRAM pages, verified there: no read
        buffer, no copy after it. A shard promoted from a tier is also queued for the tiers configured in front of
        it (e.g. a local disk before Redis), so a later DRAM miss finds it there: a cascade write like any other,
        skipped when that tier holds it already.
        """
        for tier in read.tiers:
            if key.heads not in read.heads.get(tier.name, {}).get(key.chunk, [key.heads]):
                continue  # this tier said it lacks the shard: no round trip to hear it again
            filling = read.started.get((tier.name, key))
            if isinstance(filling, Filling):
                del read.started[(tier.name, key)]
                created = self._filled(tier, filling)
                # promoted before reading on: nothing left in hand
                promoted = created is not None and self._promote(read, tier, filling.entry, created)
                self._read_ahead(read)
                if promoted:
                    return filling.entry
                continue
            if read.shape is not None and (not (self._reads_ahead(tier) or tier.batch_reads) or
                                           (tier.name, key) not in read.started):
                entry = self.dram.reserve(key, read.shape.meta(self.chunk_tokens, key.heads), parent, read.owner)
                if isinstance(entry, DramEntry):
                    try:
                        created = self._read_into(tier, key, entry)
                    except BaseException:
                        self.dram.abort(entry)
                        raise
                    if created is None:
                        self.dram.abort(entry)
                        continue
                    if self._promote(read, tier, entry, created):
                        return entry
                    continue
                # present (promoted by another read meanwhile) or no room: read the bytes as they are
            got = self._read_verified(tier, key, read)
            if got is None:
                continue
            header, payload = got
            entry = self.dram.reserve(key, header.meta, parent, read.owner)
            if isinstance(entry, DramEntry):
                try:
                    self.dram.write_bytes(entry, payload)
                except BaseException:
                    self.dram.abort(entry)
                    raise
                if self._promote(read, tier, entry, header.created):
                    return entry
                continue
            if not self._servable(read):
                continue  # forgotten since the read began (see _promote)
            return frame.payload_tensor(payload, header.meta)
        return None

    def _filled(self, tier: Tier, filling: Filling) -> float | None:
        """The creation time of a shard read ahead into its DRAM entry, or None with the entry aborted: missing,
        corrupt or unreadable, or its tier failed since the read started (not waited on)."""
        if self._read_outage[tier.name].resting():
            self._abort_when_done(filling)
            return None
        try:
            created = filling.future.result()
        except BaseException:  # (the reader catches what the tier raises: here, e.g. an interrupt of the wait)
            self._abort_when_done(filling)
            raise
        if created is None:
            self.dram.abort(filling.entry)
        return created

    def _abort_when_done(self, filling: Filling) -> None:
        """Abort a read-ahead's entry once its read has ended (at once if it never started or has ended): until
        then its pages are being written. Never waits."""
        filling.future.cancel()
        filling.future.add_done_callback(lambda _: self.dram.abort(filling.entry))

    def _promote(self, read: Read, tier: Tier, entry: DramEntry, created: float) -> bool:
        """Make a shard read from ``tier`` visible in DRAM, pinned for ``read``, and queue it for the tiers in
        front of ``tier``. False, the entry discarded, when the read's tenant was found forgotten since the read
        began: the shard was decrypted before this process noticed, and the keyring watch's DRAM purge may have
        run before this commit (checked after it, the watch marking before it purges: one of the two drops it)."""
        # Not to a front tier the shard's age already puts past its TTL: it would refuse it on the next read.
        front = [w for w in self._writers_for(read.allowed, self._writers[:self.tiers.index(tier)], 1)
                 if self._within_ttl(w.tier.name, created)]
        entry.created = created  # copied into the front tiers, it keeps its age (and TTL)
        ttl = self._ttl[tier.name]  # served as long as the tier it came from would serve it
        entry.expires = None if ttl is None else created + ttl
        self.dram.commit(entry, keep_refs=1 + len(front))
        read.pinned.append(entry)
        if not self._servable(read):
            self.dram.discard(entry)
            for _ in front:  # the references kept for the front tiers' writes, never queued
                self.dram.release(entry)
            return False
        self.metrics.promotions.labels(tier.name).inc()
        for writer in front:
            writer.submit(entry)
        return True

    def _servable(self, read: Read) -> bool:
        """Whether what ``read`` decrypted may be handed out: no encryption, or its tenant not found forgotten
        since it began."""
        return self._sealer is None or (read.tenant is not None and self._sealer.current(read.tenant))

    def _read_into(self, tier: Tier, key: ShardKey, entry: DramEntry,
                   fetched: Callable[[], bytes | None] | None = None, start: float | None = None) -> float | None:
        """Read one shard from ``tier`` into a reserved DRAM entry and verify it there; its creation time, or None
        (missing, corrupt or unreadable: counted as :meth:`_read_verified` counts them; the entry is not
        aborted here). ``fetched``: the shard's header, read into the entry already (by a batch, or by
        :meth:`_fill_sealed`, started at ``start``), instead of a read here."""
        start = time.perf_counter() if start is None else start

        def read() -> frame.Header | None:
            head = tier.get_into(key, self._header_len, self.dram.views(entry)) if fetched is None else fetched()
            if head is None:
                return None
            header = frame.verify(head, self.dram.views(entry), expected=key, opener=self._sealer)  # decrypts there
            if header.meta != entry.meta:
                raise frame.FrameError(f"holds {header.meta.shape} {header.meta.dtype}, expected {entry.meta.shape} "
                                       f"{entry.meta.dtype}")
            self._check_age(tier, header)
            return header

        header = self._guarded(tier, key, read)
        if header is None:
            return None
        self.metrics.tier_read_seconds.labels(tier.name).observe(time.perf_counter() - start)
        self.metrics.bytes_read.labels(tier.name).inc(self._header_len + entry.meta.nbytes)
        return header.created

    def _read_verified(self, tier: Tier, key: ShardKey, read: Read) -> tuple[frame.Header, memoryview] | None:
        started = read.started.pop((tier.name, key), None)
        assert not isinstance(started, Filling), "a read ahead into DRAM is taken by _fetch, never read here"
        if self._read_outage[tier.name].resting():  # failed since this read was started: do not wait on it
            if started is not None:
                started.cancel()
            self._read_ahead(read)
            return None

        def fetched() -> Fetched | None:
            try:
                got = self._get(tier, key) if started is None else started.result()
            finally:
                self._read_ahead(read)
            if got is not None:
                self._check_age(tier, got.header)
                if not read.admit(got.header.meta, self.chunk_tokens):
                    raise frame.FrameError(f"holds {got.header.meta.shape} {got.header.meta.dtype}, expected "
                                           f"chunks of {read.shape} with {self.chunk_tokens} tokens")
            return got

        got = self._guarded(tier, key, fetched)
        if got is None:
            return None
        self.metrics.tier_read_seconds.labels(tier.name).observe(got.seconds)
        self.metrics.bytes_read.labels(tier.name).inc(got.nbytes)
        return got.header, got.payload

    def _guarded(self, tier: Tier, key: ShardKey, read: Callable[[], _R | None]) -> _R | None:
        """``read()`` of one shard from ``tier``, its faults contained: a corrupt or malformed object is counted
        and removed, a tier error counts toward the tier's outage, anything else is a counted miss (the tier stays
        in use). None for any of them, and for a tier resting after an outage."""
        outage = self._read_outage[tier.name]
        if outage.resting():
            return None
        with tracing.span("kvtier.tier.read", tier=tier.name, key=key.name) as span:
            outcome, got = self._guarded_read(tier, key, read, outage)
            if span is not None:
                span.set_attribute("outcome", outcome)
        return got

    def _guarded_read(self, tier: Tier, key: ShardKey, read: Callable[[], _R | None],
                      outage: Outage) -> tuple[str, _R | None]:
        try:
            got = read()
        except _Expired:  # older than the tier's ttl_seconds: never served, removed like the tier's own expiry
            outage.succeeded()
            self.metrics.expired.labels(tier.name).inc()
            self._remove(tier, key)
            return "expired", None
        except frame.UnknownKey as exc:
            # Left in place: another engine may hold its key (a master key being rolled out, another deployment
            # with its own keyring), and removing what an engine cannot open would let any misconfigured engine
            # empty a shared tier. Remembered for a while instead, so reads plan without it.
            outage.succeeded()
            self.metrics.unopened.labels(tier.name).inc()
            with self._unopened_lock:
                self._unopened[(tier.name, key)] = time.monotonic() + _UNOPENED_SECONDS
                self._unopened.move_to_end((tier.name, key))
                while len(self._unopened) > _UNOPENED_KEPT:
                    self._unopened.popitem(last=False)
            if (tier.name, "open", "UnknownKey") not in self._logged:
                self._logged.add((tier.name, "open", "UnknownKey"))
                log.warning("tier %s: %s is %s: a miss, left in place (further such objects are counted, not "
                            "logged)", tier.name, key.name, exc)
            return "unknown_key", None
        except (frame.FrameError, ObjectError) as exc:
            outage.succeeded()
            self.metrics.corrupt.labels(tier.name).inc()
            log.warning("tier %s: removing corrupt %s: %s", tier.name, key.name, exc)
            self._remove(tier, key)
            return "corrupt", None
        except TierError as exc:
            self.metrics.read_errors.labels(tier.name).inc()
            outage.failed(exc)
            return "error", None
        except Exception as exc:  # noqa: BLE001 a tier's bug or an object no check foresaw: a counted miss
            self._unexpected(tier, "get", exc)
            return "error", None
        outage.succeeded()
        return ("miss" if got is None else "hit"), got

    def _remove(self, tier: Tier, key: ShardKey) -> None:
        try:
            tier.delete(key)
        except Exception as exc:  # noqa: BLE001 removal is best effort (logged): the object stays a miss
            log.warning("tier %s: cannot remove corrupt %s: %s", tier.name, key.name, exc)

    # -- housekeeping ------------------------------------------------------------------------------------------
    def _evicted(self, entry: DramEntry) -> None:
        self._dram_evictions.inc()

    def _check_quotas(self) -> None:
        """A quota may name DRAM and the tiers that can keep one (:meth:`Tier.quota_refusal`)."""
        by_name = {t.name: (i, t) for i, t in enumerate(self.tiers)}
        dram = self.config.dram
        for i, rule in enumerate(self.config.placement):
            for name, quota in rule.quota:
                if name == "dram" and not dram.page_bytes <= quota <= dram.capacity_bytes:
                    raise ConfigError(f"placement[{i}].quota.dram: must be from dram.page_bytes ({dram.page_bytes}) "
                                      f"to dram.capacity_bytes ({dram.capacity_bytes}), got {quota}; every put goes "
                                      "through DRAM, so a tenant whose share holds no chunk stores nothing anywhere")
                found = by_name.get(name)
                refusal = None if found is None else found[1].quota_refusal(f"tiers[{found[0]}]")
                if refusal is not None:
                    raise ConfigError(f"placement[{i}].quota.{name}: {refusal}")

    def _apply_share(self, ns: Namespace, decision: Decision) -> None:
        """Tell DRAM and each tier with a quota for ``ns``'s tenant which share its KV counts against."""
        if decision.share is None or self._shared.get(ns.id) == decision.share:
            return  # (set once per namespace: setting takes the tier's lock, which its writers hold)
        with self._shared_lock:
            self._shared[ns.id] = decision.share
            while len(self._shared) > _SHARED_KEPT:
                self._shared.popitem(last=False)
        for name, quota in decision.quota:
            if name == "dram":
                self.dram.set_share(ns.id, decision.share, quota)
            else:
                self._tier_named[name].set_share(ns.id, decision.share, quota)

    def _check_age(self, tier: Tier, header: frame.Header) -> None:
        """Raise :class:`_Expired` when the shard is older than ``tier``'s ``ttl_seconds`` (any tier type whose
        options have one): whatever the tier does itself, no shard is served past its age."""
        ttl = self._ttl.get(tier.name)
        age = time.time() - header.created
        if ttl is not None and not -_FUTURE_SECONDS <= age <= ttl:  # (a NaN or infinite time is expired too)
            raise _Expired(f"written {age:.0f} s ago, ttl_seconds is {ttl:.0f}")

    def _register(self, ns: Namespace, create: bool) -> Tenant | None:
        """With encryption: make ``ns``'s tenant key available (see :meth:`Sealer.register`). A keyring that cannot
        be read or written never fails the caller: counted and logged once, it costs the call its secondary tiers
        (its writes are dropped, its reads miss there), and DRAM too unless the tenant's secret was read (a
        namespace it failed to record: DRAM serves it under the tenant's key, which a forget ends)."""
        if self._sealer is None:
            return None
        try:
            return self._sealer.register(ns, create)
        except Exception as exc:  # noqa: BLE001 a keyring fault never fails the caller: counted and logged
            from kvtier.sealing import UnrecordedNamespace  # (imported with encryption on only: cryptography)

            if isinstance(exc, UnrecordedNamespace):
                self._keyring_failed(exc.__cause__ or exc, "record a namespace of")
                return exc.tenant
            self._keyring_failed(exc, "make or read" if create else "read")
            return None

    def _keyring_failed(self, exc: BaseException, doing: str) -> None:
        self.metrics.keyring_errors.inc()
        kind = ("keyring", doing, type(exc).__name__)
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("keyring %s: cannot %s a tenant (%s: %s); its secondary tiers are skipped, and its DRAM "
                        "entries while its secret cannot be read (further such failures are counted, not logged)",
                        self._sealer.keyring.path, doing, type(exc).__name__, exc)  # type: ignore[union-attr]

    def _forgotten(self, owners: set[bytes]) -> None:
        """Tenants were forgotten (``kvtier tenant forget``; ``owners``: their key ids): their KV leaves DRAM too
        (an entry being read goes when its reader is done)."""
        dropped = self.dram.discard_owned(owners)
        log.info("dropped %d DRAM entries of %d forgotten tenants", dropped, len(owners))

    def _put_expiry(self, allowed: frozenset[str] | None, created: float) -> float | None:
        """When a DRAM entry put at ``created`` stops being served: after the longest ``ttl_seconds`` of the tiers
        its KV may reach (``allowed``, None: all), as its KV is lawfully kept on one of them until then; never
        when one of them has no TTL, or when it reaches no secondary tier (DRAM only: nothing else keeps it)."""
        ttls = [ttl for name, ttl in self._ttl.items() if allowed is None or name in allowed]
        finite = [ttl for ttl in ttls if ttl is not None]
        return None if not ttls or len(finite) < len(ttls) else created + max(finite)

    def _within_ttl(self, tier: str, created: float) -> bool:
        """Whether a shard written at ``created`` is still within ``tier``'s ``ttl_seconds`` (none: always)."""
        ttl = self._ttl[tier]
        return ttl is None or time.time() - created <= ttl

    def drop_dram(self) -> int:
        """Evict every DRAM entry not in use (later reads come from secondary tiers)."""
        return self.dram.evict_all()

    def flush(self) -> None:
        """Wait until every queued cascade write has ended."""
        for writer in self._writers:
            writer.flush()

    def _watch_levels(self) -> None:
        """Gauges read at each scrape (and by :meth:`stats`): bytes held, and writes queued per tier."""
        self.metrics.used_bytes.labels("dram").set_function(lambda: self.dram.used_bytes)
        for writer in self._writers:
            self.metrics.queue_depth.labels(writer.tier.name).set_function(
                lambda w=writer: w.depth)  # type: ignore[misc]  # mypy: a default-bound lambda
            if writer.tier.used_bytes() is not None:  # a tier that knows it cheaply
                self.metrics.used_bytes.labels(writer.tier.name).set_function(
                    lambda t=writer.tier: t.used_bytes() or 0)  # type: ignore[misc]  # mypy: a default-bound lambda

    def stats(self) -> dict[str, dict[str, Any]]:
        """Metrics grouped by tier (``dram``, each secondary tier's name, ``_store`` for store-wide ones)."""
        return self.metrics.snapshot()

    def close(self) -> None:
        """Finish queued cascade writes, stop the workers and close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for writer in self._writers:
            writer.close()
        deadline = time.monotonic() + _CLOSE_WAIT
        if self._decrypting is not None:  # they write into DRAM pages and remove what fails from its tier
            self._decrypting.close(wait=_CLOSE_WAIT)
        for tier in self.tiers:  # a tier's native batch read into DRAM pages ends before the tier closes
            ended = self._readers[tier.name].close(
                wait=max(0.0, deadline - time.monotonic()) if tier.batch_reads else 0.0)
            if tier.batch_reads and not ended:
                log.warning("tier %s: left open at close: a batched read is still under way (it ends with the "
                            "process)", tier.name)
                continue
            tier.close()
        if self._sealer is not None:
            self._sealer.close()
        self.metrics.stop_serving()
