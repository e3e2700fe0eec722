"""The plan of one read from the store (:class:`~kvtier.store.KVStore`'s ``get`` and ``load``): what it expects,
what each tier said it holds, the shard reads started ahead, and where each chunk's heads come from. Plain named
types and pure functions over them (no I/O), used by the store's parts in the caller's process."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvtier import frame
from kvtier.dram import DramEntry
from kvtier.keys import HeadRange, ShardKey, cover, rank_heads
from kvtier.store.guard import GuardedTier

if TYPE_CHECKING:
    from kvtier.sealing import Tenant
    from kvtier.tiers.base import Ranges


def full_cover(ranges: list[HeadRange], kv_heads: int | None = None) -> bool:
    """Whether ``ranges`` hold every head (of ``kv_heads``, else of any head count they record)."""
    totals = {kv_heads} if kv_heads is not None else {r.total for r in ranges}
    return any(cover([r for r in ranges if r.total == total], 0, total) is not None for total in totals)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What every shard of one namespace has in common (its heads and tokens are fixed by its key)."""

    layers: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, meta: frame.ShardMeta) -> Shape:
        return cls(meta.num_layers, meta.head_dim, meta.dtype)

    def meta(self, chunk_tokens: int, heads: HeadRange) -> frame.ShardMeta:
        """The metadata of this namespace's shard of ``heads`` (what a DRAM entry is reserved for)."""
        return frame.ShardMeta(self.layers, chunk_tokens, self.head_dim, self.dtype, heads)


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A shard read from a tier and verified against its key and checksum (not yet against the read's shape)."""

    header: frame.Header
    payload: memoryview
    nbytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Piece:
    """Heads ``[dst, dst + count)`` of one chunk's output come from heads ``[src, src + count)`` of ``source``
    (a pinned DRAM entry or a fetched shard)."""

    source: DramEntry | torch.Tensor
    src: int
    dst: int
    count: int


@dataclasses.dataclass(frozen=True)
class Filling:
    """A shard read ahead straight into its reserved DRAM entry; the future gives its creation time once verified
    there, or None (missing, corrupt, unreadable: counted by the reader). The entry is the read's to promote or
    abort, once the future is done."""

    entry: DramEntry
    future: Future[float | None]


@dataclasses.dataclass
class Read:
    """One get in progress: what it reads and expects, and the DRAM entries it pinned (released at its end)."""

    namespace: str
    tp_rank: int
    tp_size: int
    kv_heads: int | None
    shape: Shape | None  # None until the first shard read fixes it
    tiers: list[GuardedTier]  # the secondary tiers it may read (e.g. only the local ones)
    allowed: frozenset[str] | None = None  # the tiers its namespace's KV may reach (placement); None: all
    tenant: Tenant | None = None  # encrypted stores: its tenant when it began (what it promotes after a forget goes)
    owner: bytes | None = None  # the owner its DRAM entries must have (kvtier.dram): that tenant's key id
    pinned: list[DramEntry] = dataclasses.field(default_factory=list)
    # What each tier said it holds of the chunks DRAM lacks (one batched question per tier and read; a re-plan
    # after a failed piece asks again), and the shard reads planned from it, in order, started READ_AHEAD ahead.
    heads: dict[str, dict[str, list[HeadRange]]] = dataclasses.field(default_factory=dict)
    ahead: list[tuple[GuardedTier, ShardKey, str | None]] = dataclasses.field(default_factory=list)  # + parent
    # Tiers not asked what they hold (a listing per chunk): the chunks planned from the reader's own heads, in order
    # (asked about at once from the first whose shard is not there: Prefetch.unguess), and each chunk's parent.
    guessed: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    parents: dict[str, str | None] = dataclasses.field(default_factory=dict)
    started: dict[tuple[str, ShardKey], Future[Fetched] | Filling] = dataclasses.field(default_factory=dict)
    # (tier, shard) reads that failed in this read: not planned nor read again by it (a shard a tier keeps after a
    # failed read, e.g. on a stalled Mooncake node, would cost each re-plan the same wait)
    failed: set[tuple[str, ShardKey]] = dataclasses.field(default_factory=set)
    # A load that reads a local file's payload a layer at a time (KVStore.loading's by_layers): its shards so
    # read, each in a reserved DRAM entry, verified and promoted once every layer is read (Reads.finish).
    by_layers: bool = False
    deferred: list[Deferred] = dataclasses.field(default_factory=list)
    position: int = 0  # the chunk being planned, counted from the read's first
    one_piece: bool = False  # that chunk's heads come from one shard (only such a shard is read by layers)

    def admit(self, meta: frame.ShardMeta, chunk_tokens: int) -> bool:
        """Whether a shard of this shape belongs in this read (the first one fixes the shape when none was)."""
        if meta.chunk_tokens != chunk_tokens:
            return False
        if self.shape is None:
            self.shape = Shape.of(meta)
        return Shape.of(meta) == self.shape


@dataclasses.dataclass
class Deferred:
    """A shard whose payload its read's caller reads layer by layer into its reserved DRAM entry, hashing each
    piece as it lands (the payload is layer-major: layer after layer is payload order); verified at the end."""

    position: int  # its chunk, counted from the read's first
    guard: GuardedTier
    key: ShardKey
    entry: DramEntry
    payload: memoryview  # the entry's pages (one extent), where each layer is read into
    ranges: Ranges
    header: frame.Header
    hasher: Any  # an xxh3_128 over the payload read so far
    layers: int = 0  # read so far
    seconds: float = 0.0  # spent reading and hashing
    error: Exception | None = None  # a failed piece: the shard is not served


HeadPlan = list[tuple[HeadRange, int, int]]  # each range used, and the heads [a, b) taken from it (keys.cover)


def plan_heads(read: Read, ranges: list[HeadRange]) -> tuple[HeadRange, HeadPlan] | None:
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
