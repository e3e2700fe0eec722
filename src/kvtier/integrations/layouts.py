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


def _block_index(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long).to(device)


def block_size_of(cache: torch.Tensor, layout: Layout) -> int:
    """Tokens per block of one layer's cache."""
    _check(layout)
    return cache.shape[2]


def gather(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, layout: Layout) -> torch.Tensor:
    """The canonical KV of the tokens in ``block_ids`` (whole blocks, in order), one layer per cache."""
    _check(layout)
    layers = []
    for cache in caches:
        idx = _block_index(block_ids, cache.device)
        if layout == "cpu":
            blocks = cache.index_select(0, idx)  # [n, H, bs, 2D]
            n, heads, bs, two_d = blocks.shape
            kv = blocks.view(n, heads, bs, 2, two_d // 2).permute(3, 1, 0, 2, 4)  # [2, H, n, bs, D]
        else:
            blocks = cache.index_select(1, idx)  # [2, n, bs, H, D]
            _, n, bs, heads, _ = blocks.shape
            kv = blocks.permute(0, 3, 1, 2, 4)  # [2, H, n, bs, D]
        layers.append(kv.reshape(2, heads, n * bs, kv.shape[-1]))
    return torch.stack(layers)


def scatter(kv: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
            layout: Layout) -> None:
    """Write canonical ``kv`` (``[layers, 2, H, len(block_ids) * block_size, D]``) into the caches' blocks."""
    _check(layout)
    if kv.dim() != 5 or kv.shape[0] != len(caches) or kv.shape[1] != 2:
        raise ValueError(f"kv must be [{len(caches)} layers, 2, heads, tokens, head_dim], got {tuple(kv.shape)}")
    for layer, cache in enumerate(caches):
        idx = _block_index(block_ids, cache.device)
        bs = block_size_of(cache, layout)
        _, heads, tokens, dim = kv[layer].shape
        if tokens != len(idx) * bs:
            raise ValueError(f"kv holds {tokens} tokens, {len(idx)} blocks of {bs} hold {len(idx) * bs}")
        src = kv[layer].to(cache.device, cache.dtype).view(2, heads, len(idx), bs, dim)
        if layout == "cpu":
            cache.index_copy_(0, idx, src.permute(2, 1, 3, 0, 4).reshape(len(idx), heads, bs, 2 * dim))
        else:
            cache.index_copy_(1, idx, src.permute(0, 2, 3, 1, 4))
