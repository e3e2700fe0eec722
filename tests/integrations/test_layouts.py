"""Layout conversions checked against a token-by-token reading of each engine layout."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.integrations import layouts
from kvtier.integrations.layouts import block_runs, gather, gather_chunks, scatter_chunks

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
    scatter_chunks(kv.unsqueeze(0), target, [10, 4, 6], layout)  # one chunk of three blocks
    assert torch.equal(gather(target, [10, 4, 6], layout), kv)
    others = [b for b in range(BLOCKS) if b not in (10, 4, 6)]
    assert torch.equal(gather(target, others, layout), gather(before, others, layout))


def test_cpu_and_flash_hold_the_same_kv() -> None:
    cpu = make_caches("cpu")
    kv = gather(cpu, list(range(BLOCKS)), "cpu")
    flash = make_caches("flash")
    scatter_chunks(kv.unsqueeze(0), flash, list(range(BLOCKS)), "flash")
    assert torch.equal(gather(flash, [3, 1], "flash"), gather(cpu, [3, 1], "cpu"))


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown KV layout 'paged'; known: cpu, flash"):
        gather(make_caches("cpu"), [0], "paged")  # type: ignore[arg-type] # an unknown layout, on purpose
    with pytest.raises(ValueError, match="1 chunks after skipping 0 tokens fill 1 blocks; got 2 block ids"):
        scatter_chunks(torch.zeros(1, LAYERS, 2, HEADS, 16, DIM), make_caches("cpu"), [0, 1], "cpu")
    with pytest.raises(ValueError, match="whole 16-token blocks"):
        scatter_chunks(torch.zeros(1, LAYERS, 2, HEADS, 24, DIM), make_caches("cpu"), [0, 1], "cpu")


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_gather_into_a_given_buffer(layout: str) -> None:
    from kvtier.integrations.layouts import kv_shape

    caches = make_caches(layout)
    out = torch.empty(kv_shape(caches, layout, 2 * BS), dtype=torch.bfloat16)
    assert gather(caches, [4, 8], layout, out=out) is out
    assert torch.equal(out, reference(caches, [4, 8], layout))


@pytest.mark.parametrize("layout", ["cpu", "flash"])
@pytest.mark.parametrize("skip", [0, BS, 2 * BS])
@pytest.mark.parametrize("stop", [6, 5, 4])
def test_scatter_chunks_from_strided_views(layout: str, skip: int, stop: int) -> None:
    """Chunks of 3 blocks handed over as a strided view (DRAM entries at a page stride, with gaps between
    them): written into out-of-order blocks, the first ``skip`` tokens left as the engine computed them, and
    only the first ``stop`` blocks written (a hit that ends inside the last chunk)."""
    caches = make_caches(layout)
    before = [c.clone() for c in caches]
    chunk, count = 3 * BS, 2
    padded = torch.randn(count, LAYERS + 1, 2, HEADS, chunk, DIM).to(torch.bfloat16)  # gaps between entries
    kv = padded[:, :LAYERS]
    assert not kv.is_contiguous()
    blocks = [5, 1, 8, 3, 11, 0]
    written = blocks[skip // BS:stop]
    scatter_chunks(kv, caches, written, layout, skip)
    canonical = torch.cat([kv[i] for i in range(count)], dim=3)  # [layers, 2, H, count * chunk, D]
    got = reference(caches, blocks[:stop], layout)
    assert torch.equal(got[:, :, :, skip:], canonical[:, :, :, skip:stop * BS])
    untouched = reference(before, blocks[:skip // BS], layout) if skip else None
    if untouched is not None:
        assert torch.equal(got[:, :, :, :skip], untouched)
    others = [b for b in range(BLOCKS) if b not in written]
    assert torch.equal(reference(caches, others, layout), reference(before, others, layout))
    with pytest.raises(ValueError, match="block ids"):
        scatter_chunks(kv, caches, blocks[:3], layout)  # ends before the last chunk: not this call's chunks


@settings(max_examples=60, deadline=None)
@given(data=st.data(), layout=st.sampled_from(["cpu", "flash"]), indexed=st.booleans())
def test_runs_of_blocks_copy_like_single_blocks(data: st.DataObject, layout: str, indexed: bool) -> None:
    """Block tables with runs of consecutive ids (as vLLM allocates them) and jumps between them, written and read
    run by run (CPU) or by one indexed copy per layer (``indexed``: a GPU's path, run here on CPU tensors), hold
    exactly what a token-by-token reading of the layout says, and no other block changes."""
    with mock.patch.object(layouts, "_by_runs", lambda device: not indexed):
        check_runs_of_blocks(data, layout)


def check_runs_of_blocks(data: st.DataObject, layout: str) -> None:
    per = data.draw(st.sampled_from([1, 2, 3]), label="blocks per chunk")
    count = data.draw(st.integers(1, 3), label="chunks")
    first = data.draw(st.integers(0, per - 1), label="skipped blocks")
    room = count * per - first
    n = data.draw(st.integers(max(room - per, 0) + 1, room), label="blocks written")
    blocks = data.draw(st.permutations(range(BLOCKS)), label="order")[:n]
    if data.draw(st.booleans(), label="consecutive"):
        start = data.draw(st.integers(0, BLOCKS - n), label="first block")
        blocks = list(range(start, start + n))
    caches = make_caches(layout)
    before = [c.clone() for c in caches]
    kv = torch.randn(count, LAYERS + 1, 2, HEADS, per * BS, DIM).to(torch.bfloat16)[:, :LAYERS]
    scatter_chunks(kv, caches, blocks, layout, first * BS)
    canonical = torch.cat([kv[i] for i in range(count)], dim=3)[:, :, :, first * BS:(first + n) * BS]
    assert torch.equal(reference(caches, blocks, layout), canonical)
    assert torch.equal(gather(caches, blocks, layout), canonical)
    others = [b for b in range(BLOCKS) if b not in blocks]
    assert torch.equal(reference(caches, others, layout), reference(before, others, layout))


def test_block_runs() -> None:
    assert block_runs([4, 5, 6, 2, 3, 9]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1)]
    assert block_runs([]) == []


@settings(max_examples=40, deadline=None)
@given(data=st.data(), layout=st.sampled_from(["cpu", "flash"]), staged=st.booleans(), indexed=st.booleans())
def test_gather_chunks_into_strided_pages(data: st.DataObject, layout: str, staged: bool, indexed: bool) -> None:
    """A save's gather straight into DRAM pages (a strided view with gaps between chunks) holds exactly the
    blocks' KV, chunk by chunk; ``staged``: into another dtype, a chunk at a time through a buffer (the path a
    GPU cache takes into host pages); ``indexed``: a GPU's indexed copies. A tail (fewer blocks than the last
    chunk holds) fills the start of the last chunk and, gathered in place, writes nothing after it."""
    with mock.patch.object(layouts, "_by_runs", lambda device: not indexed):
        check_gather_chunks(data, layout, staged)


def check_gather_chunks(data: st.DataObject, layout: str, staged: bool) -> None:
    per = data.draw(st.sampled_from([1, 2, 3]), label="blocks per chunk")
    count = data.draw(st.integers(1, 3), label="chunks")
    blocks = data.draw(st.permutations(range(BLOCKS)), label="order")[:count * per]
    if data.draw(st.booleans(), label="consecutive"):
        start = data.draw(st.integers(0, BLOCKS - count * per), label="first block")
        blocks = list(range(start, start + count * per))
    blocks = blocks[:len(blocks) - data.draw(st.integers(0, per - 1), label="blocks missing from the tail")]
    caches = make_caches(layout)
    dtype = torch.float32 if staged else torch.bfloat16
    out = torch.zeros(count, LAYERS + 1, 2, HEADS, per * BS, DIM, dtype=dtype)[:, :LAYERS]
    gather_chunks(caches, blocks, layout, out)
    want = reference(caches, blocks, layout).to(dtype)
    got = torch.cat([out[i] for i in range(count)], dim=3)
    assert torch.equal(got[:, :, :, :len(blocks) * BS], want)
    if not staged:
        assert not got[:, :, :, len(blocks) * BS:].any()


@pytest.mark.parametrize("ids", [[0, 1], [0, 1, 2, 3, 4]])
def test_gather_chunks_needs_its_chunks_blocks(ids: list[int]) -> None:
    """Blocks for every chunk but the last, which may be a tail: no fewer (a chunk gathered from nothing), no more."""
    with pytest.raises(ValueError, match=rf"2 chunks of 32 tokens hold 4 whole 16-token blocks \(at most one "
                                         rf"chunk's worth fewer, ending inside the last chunk\); got {len(ids)} "):
        gather_chunks(make_caches("cpu"), ids, "cpu", torch.zeros(2, LAYERS, 2, HEADS, 32, DIM))


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_block_ids_and_heads_outside_the_cache_are_refused(layout: str) -> None:
    """A slice past the last block would read the last block again and a one-head chunk would be broadcast into
    every head: both are refused, never copied."""
    caches = make_caches(layout)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 12\), got 11..12"):
        gather(caches, [11, 12], layout)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 12\), got -1..0"):
        scatter_chunks(torch.zeros(1, LAYERS, 2, HEADS, 2 * BS, DIM), caches, [-1, 0], layout)
    one_head = torch.zeros(1, LAYERS, 2, 1, BS, DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"kv is \(1, 3, 2, 1, 16, 8\); the engine's cache holds chunks of "
                                         r"\[layers, 2, 4 KV heads, tokens, 8\]"):
        scatter_chunks(one_head, caches, [0], layout)
    with pytest.raises(ValueError, match="out is"):
        gather_chunks(caches, [0], layout, one_head)
