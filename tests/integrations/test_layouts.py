"""Layout conversions checked against a token-by-token reading of each engine layout."""

from __future__ import annotations

import pytest
import torch

from kvtier.integrations.layouts import gather, scatter

LAYERS, HEADS, DIM, BS, BLOCKS = 3, 4, 8, 16, 12


def make_caches(layout: str) -> list[torch.Tensor]:
    shape = (BLOCKS, HEADS, BS, 2 * DIM) if layout == "cpu" else (2, BLOCKS, BS, HEADS, DIM)
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]


def reference(caches: list[torch.Tensor], block_ids: list[int], layout: str) -> torch.Tensor:
    """Canonical KV read one token, head and K/V at a time from the documented engine layout."""
    out = torch.empty(LAYERS, 2, HEADS, len(block_ids) * BS, DIM, dtype=torch.bfloat16)
    for layer, cache in enumerate(caches):
        for t in range(len(block_ids) * BS):
            block, off = block_ids[t // BS], t % BS
            for h in range(HEADS):
                if layout == "cpu":
                    out[layer, 0, h, t] = cache[block, h, off, :DIM]
                    out[layer, 1, h, t] = cache[block, h, off, DIM:]
                else:
                    out[layer, 0, h, t] = cache[0, block, off, h]
                    out[layer, 1, h, t] = cache[1, block, off, h]
    return out


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_gather_matches_the_layout(layout: str) -> None:
    caches = make_caches(layout)
    block_ids = [7, 2, 9, 0]  # out of order, as block tables are
    assert torch.equal(gather(caches, block_ids, layout), reference(caches, block_ids, layout))


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_scatter_writes_only_the_listed_blocks(layout: str) -> None:
    source = make_caches(layout)
    kv = gather(source, [1, 5, 3], layout)
    target = make_caches(layout)
    before = [c.clone() for c in target]
    scatter(kv, target, [10, 4, 6], layout)
    assert torch.equal(gather(target, [10, 4, 6], layout), kv)
    others = [b for b in range(BLOCKS) if b not in (10, 4, 6)]
    assert torch.equal(gather(target, others, layout), gather(before, others, layout))


def test_cpu_and_flash_hold_the_same_kv() -> None:
    cpu = make_caches("cpu")
    kv = gather(cpu, list(range(BLOCKS)), "cpu")
    flash = make_caches("flash")
    scatter(kv, flash, list(range(BLOCKS)), "flash")
    assert torch.equal(gather(flash, [3, 1], "flash"), gather(cpu, [3, 1], "cpu"))


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown KV layout 'paged'; known: cpu, flash"):
        gather(make_caches("cpu"), [0], "paged")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="blocks of 16 hold 32"):
        scatter(torch.zeros(LAYERS, 2, HEADS, 16, DIM), make_caches("cpu"), [0, 1], "cpu")


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_gather_into_a_given_buffer(layout: str) -> None:
    from kvtier.integrations.layouts import kv_shape

    caches = make_caches(layout)
    out = torch.empty(kv_shape(caches, layout, 2 * BS), dtype=torch.bfloat16)
    assert gather(caches, [4, 8], layout, out=out) is out
    assert torch.equal(out, reference(caches, [4, 8], layout))
