"""Copy-out: the planned chunks of a read as tensors a caller can use (:func:`chunk_views`), or copied into one
output tensor (:func:`copy_out`). Consecutive chunks each served whole by one DRAM entry, laid out at one stride,
move as one view. Moves bytes only."""

from __future__ import annotations

import torch

from kvtier.dram import DramEntry, DramPool
from kvtier.store.plan import Piece, Shape


def copy_out(dram: DramPool, chunk_tokens: int, plans: list[list[Piece]], shape: Shape,
             out: torch.Tensor | None) -> torch.Tensor:
    """Copy every chunk into ``out`` ``[layers, 2, heads, tokens, head_dim]`` (allocated when None)."""
    t = chunk_tokens
    full = (shape.layers, 2, sum(p.count for p in plans[0]), len(plans) * t, shape.head_dim)
    if out is None:
        out = torch.empty(full, dtype=shape.dtype)
    elif tuple(out.shape) != full or out.dtype != shape.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, the stored KV is {full} {shape.dtype}")
    for first, kv in chunk_views(dram, chunk_tokens, plans, shape, out.device):
        count = kv.shape[0]
        dst = out[:, :, :, first * t:(first + count) * t]
        dst = dst.unflatten(3, (count, t))  # type: ignore[no-untyped-call]  # torch: unflatten untyped
        dst.permute(3, 0, 1, 2, 4, 5).copy_(kv, non_blocking=out.is_cuda and kv.is_pinned())
    return out


def chunk_views(dram: DramPool, chunk_tokens: int, plans: list[list[Piece]], shape: Shape,
                device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """Each planned chunk as ``[count, layers, 2, heads, T, head_dim]`` views, consecutive DRAM chunks at one
    stride together; a chunk assembled from several head ranges is copied into a buffer of its own."""
    views: list[tuple[int, torch.Tensor]] = []
    whole = [(i, p[0].source) for i, p in enumerate(plans)
             if len(p) == 1 and isinstance(p[0].source, DramEntry) and p[0].count == p[0].source.meta.heads.count]
    done: set[int] = set()
    for run in dram.runs(whole, device):
        i0, entry = run[0]
        if len(entry.extents) == 1:
            views.append((i0, dram.run_view(entry, len(run))))
            done.update(i for i, _ in run)
    for i, pieces in enumerate(plans):
        if i in done:
            continue
        if len(pieces) == 1:
            piece = pieces[0]
            src = dram.tensor(piece.source) if isinstance(piece.source, DramEntry) else piece.source
            views.append((i, src[:, :, piece.src:piece.src + piece.count].unsqueeze(0)))
            continue
        heads = sum(p.count for p in pieces)
        buf = torch.empty((1, shape.layers, 2, heads, chunk_tokens, shape.head_dim), dtype=shape.dtype)
        for piece in pieces:
            src = dram.tensor(piece.source) if isinstance(piece.source, DramEntry) else piece.source
            buf[0, :, :, piece.dst:piece.dst + piece.count].copy_(src[:, :, piece.src:piece.src + piece.count])
        views.append((i, buf))
    return sorted(views, key=lambda v: v[0])
