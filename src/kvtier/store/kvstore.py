"""KVStore: the tiered store users and integrations call, a facade over the store's parts.

Runs in the caller's process. ``put`` copies whole chunks into the DRAM pool and returns; cascade workers
(:mod:`kvtier.store.cascade`) carry them to every secondary tier. ``lookup`` and ``get`` see DRAM first, then each
secondary tier in configured order; a shard read from a secondary tier is verified (:mod:`kvtier.frame`),
promoted into DRAM and copied out. A missing, unreadable or corrupt shard is a miss, never wrong data.

Retention in DRAM (``ttl_seconds`` of the tiers): a DRAM entry is served until its KV would expire where it is
lawfully kept. A put's entry expires at its write time plus the longest TTL of the tiers the namespace may reach
(never when one of them has none, or when it reaches none: DRAM only). A promoted entry expires at the shard's
write time plus the TTL of the tier it was read from (never if that tier has none), and is cascaded only to the
front tiers whose TTL its age is still within.

The parts, each a module of this package: :mod:`~kvtier.store.writes` (puts, the cascade writers),
:mod:`~kvtier.store.lookups`, :mod:`~kvtier.store.reads` (plan, fetch, promote) with
:mod:`~kvtier.store.prefetch` (read-ahead, batches, decryption threads) and :mod:`~kvtier.store.views`
(copy-out), :mod:`~kvtier.store.tenancy` (names, placement, shares, tenant keys), and
:mod:`~kvtier.store.guard`, through which every call to a tier goes.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from kvtier.config import StoreConfig, TierSpec, load_config
from kvtier.dram import DramPool
from kvtier.eviction import POLICIES
from kvtier.health import FirstOfKind
from kvtier.keys import HeadRange, NamedChunks, Namespace, ShardKey
from kvtier.metrics import StoreMetrics
from kvtier.recent import RecentMap
from kvtier.store.admission import Admission
from kvtier.store.guard import GuardedTier
from kvtier.store.lookups import Elsewhere, Lookups
from kvtier.store.plan import Piece, Shape
from kvtier.store.prefetch import Prefetch
from kvtier.store.reads import Reads
from kvtier.store.shards import ShardReads
from kvtier.store.tenancy import Tenancy
from kvtier.store.views import chunk_views, copy_out
from kvtier.store.writes import Source, Tokens, Writes
from kvtier.tiers.base import TIERS, Tier

_SHAPES_KEPT = 4096  # namespaces whose shards' shape a store remembers (one per tenant salt: the recent ones)


class Loaded:
    """What :meth:`KVStore.loading` found: ``views`` as :meth:`KVStore.load` hands them to its sink, in chunk order
    (``(first chunk, [count, layers, 2, heads, chunk_tokens, head_dim])``), and the ``tokens`` they hold from
    the offset on. In a load ``by_layers``, shards from a local disk are only opened at first: their views fill
    as :meth:`read_layer` reads each layer, and :meth:`verified` checks them."""

    def __init__(self, views: list[tuple[int, torch.Tensor]], tokens: int,
                 read_layer: Callable[[int], None] | None = None,
                 finish: Callable[[], int | None] | None = None, chunk_tokens: int = 0) -> None:
        self.views = views
        self.tokens = tokens
        self._read_layer = read_layer
        self._finish = finish
        self._chunk_tokens = chunk_tokens
        self._verified: int | None = None if finish is not None else tokens
        self.open = True  # until the block ends (the views are cleared then)

    def read_layer(self, layer: int) -> None:
        """Read layer ``layer`` of the shards opened for it, into their views (call for every layer, in order,
        before copying that layer out; a no-op where nothing was left to read)."""
        if self._read_layer is not None:
            self._read_layer(layer)

    def verified(self) -> int:
        """Once every layer is read: the tokens from the offset on whose KV is good (:attr:`tokens`, or less from
        the first chunk whose shard failed its checksum or its read: KV copied out of it must not be used)."""
        if self._verified is None:
            if not self.open:
                raise RuntimeError("Loaded.verified after its block: the shards it read were dropped unverified")
            assert self._finish is not None
            bad = self._finish()
            self._verified = self.tokens if bad is None else min(self.tokens, bad * self._chunk_tokens)
            if bad is not None:  # those views' pages are no longer held: no use of them after this
                self.views[:] = [(first, kv) for first, kv in self.views if first + kv.shape[0] <= bad]
        return self._verified


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


class KVStore:
    """KV chunks in a DRAM pool backed by secondary tiers. Thread-safe; use as a context manager."""

    def __init__(self, config: StoreConfig, tiers: list[Tier] | None = None, *, allocate_dram: bool = True) -> None:
        """``allocate_dram=False`` defers the DRAM pool's allocation to its first put or promotion (or
        ``store.dram.allocate()``): for a process that only looks up."""
        self.config = config
        self.chunk_tokens = config.chunk_tokens
        self.metrics = StoreMetrics()
        logged = FirstOfKind()  # kinds of contained faults (of tiers, of the keyring) logged already
        # Tenancy first (tracing, then keys): a key source that fails refuses the store before a tier opens.
        self._tenancy = Tenancy(config, self.metrics, logged)
        try:
            self.tiers = open_tiers(config) if tiers is None else tiers
        except BaseException:
            self._tenancy.close()
            raise
        try:
            Tenancy.check_quotas(config, self.tiers)
            policy = POLICIES.resolve(config.dram.eviction, "dram.eviction")()
            self.dram = DramPool(config.dram.capacity_bytes, config.dram.page_bytes, policy,
                                 pin_memory=config.dram.pin_memory, on_evict=self._evicted, allocate=allocate_dram,
                                 headroom_bytes=config.dram.start_headroom_bytes)
        except BaseException:
            for tier in self.tiers:
                tier.close()
            self._tenancy.close()
            raise
        self._tenancy.bind(self.dram, self.tiers)
        self.metrics.capacity_bytes.labels("dram").set(self.dram.capacity_bytes)
        self.metrics.watch_tiers(self.tiers)
        self.metrics.declare([t.name for t in self.tiers])
        self._dram_evictions = self.metrics.evictions.labels("dram")
        specs = {spec.name: spec for spec in config.tiers}
        default = TierSpec(type="", name="", options={})  # tiers passed in without a spec
        spec = [specs.get(t.name, default) for t in self.tiers]
        guards = [GuardedTier(t, s.retry_seconds, self.metrics, logged, s.codec, s.accepts)
                  for t, s in zip(self.tiers, spec)]
        shapes: RecentMap[str, Shape] = RecentMap(_SHAPES_KEPT)  # namespace id -> its shards' shape
        self._writes = Writes(self.chunk_tokens, self.dram, self.metrics, self._tenancy, guards, spec, shapes,
                              Admission(config.admission))
        self._lookups = Lookups(self.chunk_tokens, self.dram, self.metrics, self._tenancy, guards)
        sealer = self._tenancy.sealer
        shards = ShardReads(self.dram, self.metrics, sealer)
        self._prefetch = Prefetch(self.dram, guards, shards, self.chunk_tokens, sealed=sealer is not None)
        self._reads = Reads(self.chunk_tokens, self.dram, self.metrics, self._tenancy, guards, shards,
                            self._prefetch, self._writes, shapes)
        self._guards = guards
        self._watch_levels()
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
        return self._writes.put_tensor(ns, tokens, kv, tp_rank, tp_size, offset, kv_heads)

    def put_from(self, ns: Namespace, tokens: Tokens, source: Source, *, layers: int,
                 head_dim: int, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, offset: int = 0,
                 kv_heads: int, device: torch.device | str = "cpu", tail: bool = False,
                 handoff: bool = False) -> int:
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

        ``handoff``: another engine waits for these chunks in a secondary tier (a disaggregated prefill,
        docs/pd.md): they skip admission, and the cascade writes them first, within a budget of their own
        (``handoff_queue_bytes``), never dropping them for a full queue.
        """
        if self._closed:
            raise RuntimeError("KVStore.put_from after close: its cascade writers have stopped")
        return self._writes.put_source(ns, tokens, source, layers, head_dim, dtype, tp_rank, tp_size, offset,
                                       kv_heads, device, tail, handoff)

    def held(self, ns: Namespace, tokens: Tokens, *, tp_rank: int = 0, tp_size: int = 1,
             kv_heads: int, tail: bool = False) -> int:
        """Leading tokens (whole chunks, and with ``tail`` the tail of ``tokens``) whose shard for this rank's
        heads is in DRAM: what a put would skip.

        Asks DRAM only (no tier I/O), so a caller can decide cheaply what to gather before a put.
        """
        return self._lookups.held(ns, tokens, tp_rank, tp_size, kv_heads, tail)

    def watch_tier_writes(self) -> int:
        """Start recording, for one reader, every shard a secondary tier came to hold through the cascade;
        returns the reader's handle for :meth:`take_tier_writes` (nothing is recorded without a reader)."""
        return self._writes.tier_writes.watch()

    def take_tier_writes(self, watcher: int) -> list[tuple[ShardKey, str]]:
        """(shard, tier name) for each cascade write that landed since this reader's last call, in order."""
        return self._writes.tier_writes.take(watcher)

    def named(self, ns: Namespace) -> Namespace:
        """``ns`` as this store names it in DRAM and the tiers: with encryption, its names keyed by the keyring's
        naming key (:attr:`~kvtier.keys.Namespace.name_key`), the same in every process sharing the keyring; without,
        ``ns`` itself. Its :attr:`~kvtier.keys.Namespace.id` is what ``kvtier cache ls`` shows and what a placement
        rule's ``namespace`` names."""
        return self._tenancy.named(ns)

    def in_dram(self, namespace: str, chunk: str, heads: HeadRange) -> bool:
        """Whether DRAM holds ``heads`` of one chunk (namespace id and chunk key in hex)."""
        return self._lookups.in_dram(namespace, chunk, heads)

    # -- lookup ------------------------------------------------------------------------------------------------
    @property
    def remote_tiers(self) -> bool:
        """Whether a lookup may wait on a network (a tier that is not :attr:`Tier.local`)."""
        return any(not tier.local for tier in self.tiers)

    @property
    def tiers_down(self) -> bool:
        """Whether every tier other processes write to (one that is not :attr:`~kvtier.tiers.base.Tier.local`) is in
        a read outage (resting after failures), or there is none: waiting for another process's writes to appear
        is then in vain (until one is back)."""
        return all(guard.reads.resting() for guard in self._guards if not guard.tier.local)

    def reads_failing(self) -> frozenset[str]:
        """The tiers whose reads are in an outage (failed since their last success): their lookups' answers say
        nothing of what they hold."""
        return frozenset(guard.name for guard in self._guards if guard.reads.failing)

    def reaches_shared(self, ns: Namespace) -> bool:
        """Whether KV put under ``ns`` goes to a tier other processes read (one that is not local, which its
        placement allows), with its tenant's key when encryption is on: where a disaggregated prefill's KV must
        go for a decode engine to load it."""
        named = self._tenancy.named(ns)
        decision = self._tenancy.placement.decide(named)
        if not any(not guard.tier.local and decision.admits(guard.name) for guard in self._guards):
            return False
        return self._tenancy.sealer is None or self._tenancy.register(named, create=False) is not None

    def lookup(self, ns: Namespace, tokens: Tokens, *, kv_heads: int | None = None,
               elsewhere: Elsewhere | None = None, local_only: bool = False,
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
        return self._lookups.lookup(ns, tokens, kv_heads, elsewhere, local_only, count, tail_block)

    def lookup_each(self, ns: Namespace, chunks: NamedChunks, *, kv_heads: int | None = None,
                    count: bool = True) -> list[bool]:
        """For each of ``chunks`` (named by their engine, each standing alone: no prefix joins them), whether it is
        available, every head present, in DRAM or a tier the namespace may read. Each tier is asked once, about
        the chunks DRAM and the tiers before it lack. ``count=False`` leaves the lookup metrics to the caller.
        Never raises for a tier's fault: an unreachable or misbehaving tier holds nothing."""
        return self._lookups.each(ns, chunks, kv_heads, count)

    def count_lookup(self, tokens: int, found: int) -> None:
        """Count one lookup in the metrics (a caller whose final answer came from a ``local_only`` lookup)."""
        self._lookups.count(tokens, found)

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
            got = copy_out(self.dram, self.chunk_tokens, plans, shape, out)
            if got.is_cuda:  # copies from pinned pages run asynchronously: end them before the pins are released
                torch.cuda.current_stream(got.device).synchronize()
            result.append(got)

        if not self._reads.read(ns, tokens, tp_rank, tp_size, offset, kv_heads, wanted, copy):
            return None
        return result[0]

    def load(self, ns: Namespace, tokens: Tokens, sink: Callable[[int, torch.Tensor], None], *, layers: int,
             head_dim: int, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, offset: int = 0,
             kv_heads: int | None = None, device: torch.device | str = "cpu", local_only: bool = False,
             tail: bool = False, streamed: bool = False) -> int:
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
        ``streamed`` hands each chunk over as soon as it is read (one chunk a call), while the tiers that read
        ahead read the next ones: the caller's copies overlap the reads (a load from a shared tier), where
        otherwise every read ends before the first copy, and consecutive chunks in DRAM are handed over together.
        """
        if streamed:
            def handed(index: int, pieces: list[Piece], shape: Shape) -> None:
                for first, kv in chunk_views(self.dram, self.chunk_tokens, [pieces], shape, torch.device(device)):
                    sink(index + first, kv)

            with self._reads.opened(ns, tokens, tp_rank, tp_size, offset, kv_heads, Shape(layers, head_dim, dtype),
                                    partial=True, local_only=local_only, tail=tail, planned=handed) as (plans, _, _):
                return min(len(plans) * self.chunk_tokens, len(tokens) - offset)
        with self.loading(ns, tokens, layers=layers, head_dim=head_dim, dtype=dtype, tp_rank=tp_rank,
                          tp_size=tp_size, offset=offset, kv_heads=kv_heads, device=device, local_only=local_only,
                          tail=tail) as loaded:
            for first, kv in loaded.views:
                sink(first, kv)
        return loaded.tokens

    @contextlib.contextmanager
    def loading(self, ns: Namespace, tokens: Tokens, *, layers: int, head_dim: int, dtype: torch.dtype,
                tp_rank: int = 0, tp_size: int = 1, offset: int = 0, kv_heads: int | None = None,
                device: torch.device | str = "cpu", local_only: bool = False, tail: bool = False,
                by_layers: bool = False) -> Iterator[Loaded]:
        """:meth:`load`'s views all at once, for a ``with`` block: valid, and pinned in DRAM, until it ends. For a
        caller that copies them in another order than chunk by chunk (the vLLM connector copies a load layer by
        layer, as the engine's forward pass reaches each layer). Same arguments and checks as :meth:`load`;
        on a miss the block gets no views and 0 tokens.

        With ``by_layers`` (plain shards only), a shard read from a local disk is not read whole before the block:
        the caller reads it a layer at a time (:meth:`Loaded.read_layer`, every layer in order, each before it
        copies that layer out) and then asks :meth:`Loaded.verified` which tokens are good: each shard's checksum
        (hashed as its layers land) is checked then, and a good shard promoted into DRAM only then. KV copied out of
        a shard that fails is the caller's to discard (the connector reports those blocks to vLLM)."""
        with self._reads.opened(ns, tokens, tp_rank, tp_size, offset, kv_heads, Shape(layers, head_dim, dtype),
                                partial=True, local_only=local_only, tail=tail,
                                by_layers=by_layers) as (plans, shape, read):
            views: list[tuple[int, torch.Tensor]] = []
            if plans:
                assert shape is not None, "a planned chunk fixes the shape"
                views = chunk_views(self.dram, self.chunk_tokens, plans, shape, torch.device(device))
            deferred = bool(read.deferred)
            loaded = Loaded(views, min(len(plans) * self.chunk_tokens, len(tokens) - offset),
                            functools.partial(self._reads.fill_layer, read) if deferred else None,
                            functools.partial(self._reads.finish, read) if deferred else None, self.chunk_tokens)
            try:
                yield loaded
            finally:
                views.clear()  # their pages are released next: a view kept past the block would see others' KV
                loaded.open = False

    # -- housekeeping ------------------------------------------------------------------------------------------
    def _evicted(self, entry: object) -> None:
        self._dram_evictions.inc()

    def drop_dram(self) -> int:
        """Evict every DRAM entry not in use (later reads come from secondary tiers)."""
        return self.dram.evict_all()

    def flush(self) -> None:
        """Wait until every queued cascade write has ended."""
        self._writes.flush()

    def _watch_levels(self) -> None:
        """Gauges read at each scrape (and by :meth:`stats`): bytes held, and writes queued per tier."""
        self.metrics.used_bytes.labels("dram").set_function(lambda: self.dram.used_bytes)
        for writer in self._writes.writers:
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
        self._writes.close()
        self._prefetch.close(self._guards)
        self._tenancy.close()
        self.metrics.stop_serving()
