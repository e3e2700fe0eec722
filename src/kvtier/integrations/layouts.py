"""Conversions between engines' paged KV-cache layouts and kvtier's canonical layout.

Canonical: ``[num_layers, 2 (K, V), kv_heads, tokens, head_dim]``. Engines keep one tensor per layer, cut into
blocks of ``block_size`` tokens; a request's tokens live in the blocks its block table lists, in order. Layouts
are converted here, at the engine's edge, and never stored.

- ``cpu``: vLLM's CPU backend, ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (K then V in the last axis).
- ``flash``: vLLM's GPU flash-attention backend, ``[2, num_blocks, block_size, kv_heads, head_dim]``.

Every function works on any device: gathers and scatters run where the caches are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch

Layout = Literal["cpu", "flash"]
LAYOUTS: tuple[Layout, ...] = ("cpu", "flash")


def _check(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV layout {layout!r}; known: {', '.join(LAYOUTS)}")


def _block_list(block_ids: Sequence[int] | torch.Tensor) -> list[int]:
    return block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)


def kv_shape(caches: Sequence[torch.Tensor], layout: Layout, tokens: int) -> tuple[int, int, int, int, int]:
    """The canonical shape ``[layers, 2, kv_heads, tokens, head_dim]`` of ``tokens`` tokens of these caches."""
    _check(layout)
    cache = caches[0]
    heads, dim = (cache.shape[1], cache.shape[3] // 2) if layout == "cpu" else (cache.shape[3], cache.shape[4])
    return (len(caches), 2, heads, tokens, dim)


def block_size_of(cache: torch.Tensor, layout: Layout) -> int:
    """Tokens per block of one layer's cache."""
    _check(layout)
    return cache.shape[2]


def _as_canonical_blocks(cache: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A view of one layer's cache as ``[blocks, 2, kv_heads, block_size, head_dim]`` (no copy)."""
    if layout == "cpu":
        blocks, heads, bs, two_d = cache.shape
        return cache.view(blocks, heads, bs, 2, two_d // 2).permute(0, 3, 1, 2, 4)
    return cache.permute(1, 0, 3, 2, 4)


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive block ids: (position of the run's first id in ``block_ids``, its block, length).

    On CPU a run is one slice of a layer's cache, copied by one strided copy, where an indexed copy
    (``index_put``) of the same bytes measured 3x slower (SmolLM2, 32 blocks: 36 ms against 12 ms; one copy per
    block, the worst case of a table with no two consecutive ids, took 18 ms)."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((pos, block, 1))
    return runs


def _by_runs(device: torch.device) -> bool:
    """Whether copies on ``device`` go run by run (CPU) or as one indexed copy per layer (a GPU, where many small
    copies would each pay a kernel launch)."""
    return device.type == "cpu"


def _checked_ids(block_ids: Sequence[int] | torch.Tensor, blocks: torch.Tensor) -> list[int]:
    ids = _block_list(block_ids)
    if ids and not (min(ids) >= 0 and max(ids) < blocks.shape[0]):
        raise ValueError(f"block ids must be in [0, {blocks.shape[0]}), got {min(ids)}..{max(ids)}")
    return ids


def _check_kv(kv: torch.Tensor, blocks: torch.Tensor, what: str) -> None:
    """``kv`` (``[count, layers, 2, H, tokens, D]``) holds the heads and head size of ``blocks``' cache (a copy
    would broadcast one head into all of them without a word)."""
    _, _, heads, _, dim = blocks.shape
    if kv.dim() != 6 or kv.shape[2] != 2 or kv.shape[3] != heads or kv.shape[5] != dim:
        raise ValueError(f"{what} is {tuple(kv.shape)}; the engine's cache holds chunks of [layers, 2, {heads} "
                         f"KV heads, tokens, {dim}]")


def _checked_caches(kv: torch.Tensor, caches: Sequence[torch.Tensor], layout: Layout, what: str) -> torch.Tensor:
    """The first cache as canonical blocks, once ``kv`` (chunks to copy to or from ``caches``) is checked against
    the caches' layer count, heads and head size."""
    _check(layout)
    if kv.dim() == 6 and kv.shape[1] != len(caches):
        raise ValueError(f"{what} holds {kv.shape[1]} layers, the engine has {len(caches)}")
    first = _as_canonical_blocks(caches[0], layout)
    _check_kv(kv, first, what)
    return first


def gather(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, layout: Layout,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The canonical KV of the tokens in ``block_ids`` (whole blocks, in order), one layer per cache.

    ``out`` (``[layers, 2, kv_heads, len(block_ids) * block_size, head_dim]``), when given, receives it.
    """
    _check(layout)
    first = _as_canonical_blocks(caches[0], layout)
    ids = _checked_ids(block_ids, first)
    _, _, heads, bs, dim = first.shape
    if out is None:
        out = torch.empty((len(caches), 2, heads, len(ids) * bs, dim), dtype=first.dtype, device=first.device)
    if ids:
        gather_chunks(caches, ids, layout, out.unsqueeze(0))  # one chunk of all the blocks
    return out


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Blocks ``[block, block + blocks)`` of chunk ``chunk`` (``chunks`` > 0: that many whole chunks from
    ``chunk`` on) hold the consecutive cache blocks from ``dest`` on: one strided copy per layer."""

    chunk: int
    chunks: int
    block: int
    blocks: int
    dest: int


def _pieces(ids: list[int], per: int, first: int) -> list[_Piece]:
    """The copies that move chunks of ``per`` blocks, from block ``first`` of the first chunk on, to or from the
    cache blocks ``ids``: one per run of consecutive ids within a chunk, or per run of whole chunks."""
    pieces: list[_Piece] = []
    for pos, dest, length in block_runs(ids):
        q, end = first + pos, first + pos + length  # blocks counted from the first chunk's start
        while q < end:
            c, a = divmod(q, per)
            whole = (end - q) // per if a == 0 else 0
            piece = _Piece(c, whole, a, whole * per or min(per - a, end - q), dest)
            pieces.append(piece)
            dest += piece.blocks
            q += piece.blocks
    return pieces


def _chunk_blocks(kv: torch.Tensor, layer: int, per: int, bs: int) -> torch.Tensor:
    """One layer of ``[count, layers, 2, H, chunk, D]`` chunks as ``[count, per, 2, H, bs, D]`` blocks (a view)."""
    return torch.unflatten(kv[:, layer], 3, (per, bs)).permute(0, 3, 1, 2, 4, 5)


def _cache_span(blocks: torch.Tensor, piece: _Piece, per: int) -> torch.Tensor:
    span = blocks[piece.dest:piece.dest + piece.blocks]
    return torch.unflatten(span, 0, (piece.chunks, per)) if piece.chunks else span


def _chunk_span(chunks: torch.Tensor, piece: _Piece) -> torch.Tensor:
    if piece.chunks:
        return chunks[piece.chunk:piece.chunk + piece.chunks]
    return chunks[piece.chunk, piece.block:piece.block + piece.blocks]


def gather_chunks(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, layout: Layout,
                  out: torch.Tensor) -> None:
    """Read the blocks ``block_ids`` into ``out``, ``[count, layers, 2, H, chunk_tokens, D]`` with any strides
    (e.g. a view of the store's DRAM pages): ``chunk_tokens / block_size`` blocks a chunk, in order. Fewer block
    ids than the chunks hold end inside the last chunk (a tail), whose other tokens are left undefined. The
    mirror of :func:`scatter_chunks`; a copy to another device or dtype goes a chunk at a time through a buffer on
    the caches' device (torch would stage a strided cross-device copy of the whole run)."""
    first = _checked_caches(out, caches, layout, "out")
    count, _, _, _, chunk, _ = out.shape
    ids = _checked_ids(block_ids, first)
    bs = first.shape[3]
    if chunk % bs or not max(count - 1, 0) * (chunk // bs) < len(ids) <= count * (chunk // bs):
        raise ValueError(f"{count} chunks of {chunk} tokens hold {count * chunk // bs} whole {bs}-token blocks "
                         f"(at most one chunk's worth fewer, ending inside the last chunk); got {len(ids)} block ids")
    per = chunk // bs
    if out.device != first.device or out.dtype != first.dtype:
        for c in range(count):
            buf = torch.empty((1, *out.shape[1:]), dtype=first.dtype, device=first.device)
            gather_chunks(caches, ids[c * per:(c + 1) * per], layout, buf)
            out[c:c + 1].copy_(buf)
        return
    runs = _by_runs(first.device)
    pieces = _pieces(ids, per, 0) if runs else []
    idx = None if runs else torch.as_tensor(ids, dtype=torch.long, device=first.device)
    whole, rest = divmod(len(ids), per)
    for layer, cache in enumerate(caches):
        blocks = _as_canonical_blocks(cache, layout)  # [blocks, 2, H, bs, D]
        dst = _chunk_blocks(out, layer, per, bs)  # [count, per, 2, H, bs, D]
        if idx is not None:
            dst[:whole].copy_(torch.unflatten(blocks.index_select(0, idx[:whole * per]), 0, (whole, per)))
            if rest:
                dst[whole, :rest].copy_(blocks.index_select(0, idx[whole * per:]))
        for piece in pieces:
            _chunk_span(dst, piece).copy_(_cache_span(blocks, piece, per))


def scatter_chunks(kv: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                   layout: Layout, skip: int = 0) -> None:
    """Write ``count`` chunks of canonical KV (``[count, layers, 2, H, chunk_tokens, D]``, any strides, e.g. a
    view of the store's DRAM pages) into the caches' blocks ``block_ids``, in order, skipping the first ``skip``
    tokens (whole blocks: the engine computed them itself). Fewer block ids than the chunks fill end the write
    inside the last chunk (a hit that stops a block before the prompt's last token). :class:`Scatter`, every
    layer."""
    Scatter(kv, caches, block_ids, layout, skip).layers(slice(0, len(caches)))


class Scatter:
    """The copies of :func:`scatter_chunks`, checked and planned once, then run for any layers, in any order, on
    any thread (each layer's copies write only that layer's cache).

    Straight from the source, no staging buffer: on CPU, per layer, one strided copy for each run of consecutive
    blocks within a chunk, and one for each run of whole chunks whose blocks follow each other; on a GPU, one
    indexed copy per layer (of the layer's chunks, moved to the device first when they are elsewhere).
    """

    def __init__(self, kv: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                 layout: Layout, skip: int = 0) -> None:
        first_cache = _checked_caches(kv, caches, layout, "kv")
        count, _, _, _, chunk, _ = kv.shape
        bs = first_cache.shape[3]
        if chunk % bs or skip % bs or not 0 <= skip < chunk:
            raise ValueError(f"chunks of {chunk} tokens, skip {skip}: both must be whole {bs}-token blocks, "
                             "skip < chunk")
        per, first = chunk // bs, skip // bs
        ids = _checked_ids(block_ids, first_cache)
        room = count * per - first  # blocks the chunks fill after the skip
        if not max(room - per, 0) < len(ids) <= room:
            raise ValueError(f"{count} chunks after skipping {skip} tokens fill {room} blocks; got {len(ids)} block "
                             f"ids (at most one chunk's worth fewer, ending inside the last chunk)")
        runs = _by_runs(first_cache.device)
        self._kv, self._caches, self._layout = kv, caches, layout
        self._per, self._bs, self._first, self._count = per, bs, first, len(ids)
        self._pieces = _pieces(ids, per, first) if runs else []
        self._idx = None if runs else torch.as_tensor(ids, dtype=torch.long, device=first_cache.device)

    def layers(self, layers: slice) -> None:
        """Copy the chunks' layers ``layers`` into their caches."""
        for layer in range(*layers.indices(len(self._caches))):
            pairs = self.pairs(layer)
            if pairs is not None and pairs[0]:
                # One call for the layer's strided copies: the GIL is taken once, not once a copy (a thread
                # copying beside an engine's forward pass would otherwise hand it back and forth with it).
                torch._foreach_copy_(*pairs)
                continue
            cache = self._caches[layer]
            blocks = _as_canonical_blocks(cache, self._layout)  # [blocks, 2, H, bs, D]
            src = _chunk_blocks(self._kv, layer, self._per, self._bs)  # [count, per, 2, H, bs, D]
            if src.device != cache.device or src.dtype != cache.dtype:
                src = src.to(cache.device, cache.dtype)
            if self._idx is not None:
                blocks.index_copy_(0, self._idx, src.flatten(0, 1)[self._first:self._first + self._count])
            for piece in self._pieces:
                _cache_span(blocks, piece, self._per).copy_(_chunk_span(src, piece))

    def pairs(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Layer ``layer``'s copies as (destinations, sources): views to copy one onto the other, each pair its own
        strided copy. None where the layer is not copied run by run (a GPU), or the source must be converted
        first (another device or dtype)."""
        cache = self._caches[layer]
        if self._idx is not None or self._kv.device != cache.device or self._kv.dtype != cache.dtype:
            return None
        blocks = _as_canonical_blocks(cache, self._layout)  # [blocks, 2, H, bs, D]
        src = _chunk_blocks(self._kv, layer, self._per, self._bs)  # [count, per, 2, H, bs, D]
        return ([_cache_span(blocks, piece, self._per) for piece in self._pieces],
                [_chunk_span(src, piece) for piece in self._pieces])
