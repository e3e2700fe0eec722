"""Conversions between engines' paged KV-cache layouts and kvtier's canonical layout.

Canonical: ``[num_layers, 2 (K, V), kv_heads, tokens, head_dim]``. Engines keep one tensor per layer, cut into
blocks of ``block_size`` tokens; a request's tokens live in the blocks its block table lists, in order. Layouts
are converted here, at the engine's edge, and never stored.

- ``cpu``: vLLM's CPU backend, ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (K then V in the last axis).
- ``flash``: vLLM's GPU flash-attention backend, ``[2, num_blocks, block_size, kv_heads, head_dim]``.

Both functions work on any device: gathers and scatters run where the caches are.
"""

from __future__ import annotations

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


def gather(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, layout: Layout,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The canonical KV of the tokens in ``block_ids`` (whole blocks, in order), one layer per cache.

    ``out`` (``[layers, 2, kv_heads, len(block_ids) * block_size, head_dim]``), when given, receives it.
    """
    _check(layout)
    idx = torch.as_tensor(_block_list(block_ids), dtype=torch.long, device=caches[0].device)
    for layer, cache in enumerate(caches):
        blocks = _as_canonical_blocks(cache, layout).index_select(0, idx)  # [n, 2, H, bs, D]
        n, _, heads, bs, dim = blocks.shape
        if out is None:
            out = torch.empty((len(caches), 2, heads, n * bs, dim), dtype=cache.dtype, device=cache.device)
        out[layer].view(2, heads, n, bs, dim).copy_(blocks.permute(1, 2, 0, 3, 4))
    assert out is not None, "gather needs at least one layer"
    return out


def scatter_chunks(kv: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                   layout: Layout, skip: int = 0) -> None:
    """Write ``count`` chunks of canonical KV (``[count, layers, 2, H, chunk_tokens, D]``, any strides, e.g. a
    view of the store's DRAM pages) into the caches' blocks ``block_ids``, in order, skipping the first ``skip``
    tokens (whole blocks: the engine computed them itself). Fewer block ids than the chunks fill end the write
    inside the last chunk (a hit that stops a block before the prompt's last token).

    One indexed copy per layer and run of whole chunks, straight from the source: no staging buffer, no
    per-block loop.
    """
    _check(layout)
    count, layers, _, _, chunk, _ = kv.shape
    if layers != len(caches):
        raise ValueError(f"kv holds {layers} layers, the engine has {len(caches)}")
    bs = block_size_of(caches[0], layout)
    if chunk % bs or skip % bs or not 0 <= skip < chunk:
        raise ValueError(f"chunks of {chunk} tokens, skip {skip}: both must be whole {bs}-token blocks, skip < chunk")
    per, first = chunk // bs, skip // bs
    ids = _block_list(block_ids)
    room = count * per - first  # blocks the chunks fill after the skip
    if not max(room - per, 0) < len(ids) <= room:
        raise ValueError(f"{count} chunks after skipping {skip} tokens fill {room} blocks; got {len(ids)} block "
                         f"ids (at most one chunk's worth fewer, ending inside the last chunk)")
    keep = per - (room - len(ids))  # blocks of the last chunk written
    idx = torch.as_tensor([-1] * first + ids + [-1] * (room - len(ids)), dtype=torch.long,
                          device=caches[0].device).view(count, per)
    # Chunks written whole go in one indexed copy; a first chunk entered past its start, or a last one left
    # before its end, each in one more.
    whole_from, whole_to = (1 if first else 0), (count if keep == per else count - 1)
    if count == 1 and (first or keep < per):
        parts = [(0, first, keep)]
    else:
        parts = ([(0, first, per)] if first else []) + ([(count - 1, 0, keep)] if keep < per else [])
    for layer, cache in enumerate(caches):
        blocks = _as_canonical_blocks(cache, layout)  # [blocks, 2, H, bs, D]
        src = kv[:, layer].unflatten(3, (per, bs)).permute(0, 3, 1, 2, 4, 5)  # [count, per, 2, H, bs, D]
        if src.device != cache.device or src.dtype != cache.dtype:
            src = src.to(cache.device, cache.dtype)
        if whole_to > whole_from:
            blocks[idx[whole_from:whole_to]] = src[whole_from:whole_to]
        for c, a, b in parts:
            blocks[idx[c, a:b]] = src[c, a:b]
