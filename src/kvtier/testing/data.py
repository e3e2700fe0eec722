"""Deterministic KV data whose values depend on the whole prefix, as real attention KV does."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def synthetic_tokens(seed: int, n: int, vocab: int = 32000) -> list[int]:
    """``n`` token ids drawn from ``seed``."""
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def synthetic_kv(tokens: Sequence[int], *, layers: int = 2, heads: int = 4, head_dim: int = 8,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Canonical KV ``[layers, 2, heads, len(tokens), head_dim]``; position t depends on ``tokens[:t+1]``.

    Two sequences share values exactly on their common prefix, so a wrong-prefix hit shows up as a mismatch.
    """
    seeds = np.empty(len(tokens), dtype=np.float64)
    state = 7
    for i, tok in enumerate(tokens):
        state = (state * 1_000_003 + int(tok) + 1) % 2_147_483_647
        seeds[i] = state
    base = torch.from_numpy(seeds / 2_147_483_647.0)  # [T] in (0, 1)
    grid = torch.arange(layers * 2 * heads * head_dim, dtype=torch.float64).view(layers, 2, heads, 1, head_dim)
    values = torch.sin(base.view(1, 1, 1, -1, 1) * 1000.0 + grid * 0.37)
    return values.to(dtype)
