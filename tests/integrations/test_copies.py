"""kvtier.integrations.copies: a copy split by layers over helper threads (the vLLM connector's use of it, with
real requests and exact KV, is in tests/integrations/vllm/test_connector.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.integrations.copies import MAX_HELPERS, LayerCopies


def test_a_failed_part_of_a_split_copy_is_raised_once_every_part_has_ended() -> None:
    copies = LayerCopies(2)
    done: list[tuple[int, int]] = []
    lock = threading.Lock()

    def copy(s: slice) -> None:
        if s.start == 0:
            raise RuntimeError("the engine's part failed")
        time.sleep(0.05)  # a helper's part still copying when the engine's fails
        with lock:
            done.append((s.start, s.stop))

    with pytest.raises(RuntimeError, match="the engine's part failed"):
        copies.run(copy, 9)
    assert sorted(done) == [(3, 6), (6, 9)]  # both helpers' parts had ended before the failure was raised
    # vLLM runs its steps in torch's inference mode (per thread), where its caches are made: every part copies in
    # it, the helpers' and the caller's, also when the caller (an asynchronous load's thread) is not in it
    with torch.inference_mode():
        caches = torch.zeros(4, 8)
        copies.run(lambda s: caches[s].copy_(torch.ones(s.stop - s.start, 8)), 4)
    assert torch.equal(caches, torch.ones(4, 8))
    copies.run(lambda s: caches[s].copy_(torch.full((s.stop - s.start, 8), 2.0)), 4)
    assert torch.equal(caches, torch.full((4, 8), 2.0))
    normal = torch.zeros(4, 8)  # a tensor made outside it (the DRAM pages) is written as well
    copies.run(lambda s: normal[s].copy_(torch.ones(s.stop - s.start, 8)), 4)
    assert torch.equal(normal, torch.ones(4, 8))
    parts: list[tuple[int, int]] = []
    copies.run(lambda s: parts.append((s.start, s.stop)), 2)  # fewer layers than threads: one part each
    assert sorted(parts) == [(0, 1), (1, 2)]
    LayerCopies(0).run(lambda s: parts.append((s.start, s.stop)), 30)
    assert parts[-1] == (0, 30)


def test_helpers_are_bounded() -> None:
    assert LayerCopies(64).helpers == MAX_HELPERS and LayerCopies(-1).helpers == 0


def test_no_split_where_torch_copies_on_several_threads(monkeypatch) -> None:
    import kvtier.integrations.copies as copies_module

    monkeypatch.setattr(copies_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(copies_module.threads, "placed_on", lambda: None)
    monkeypatch.setattr(copies_module.torch, "get_num_threads", lambda: 1)
    assert copies_module.spare_cores() == 3  # an in-process engine computing on one thread of four CPUs
    monkeypatch.setattr(copies_module.threads, "placed_on", lambda: frozenset({3}))
    assert copies_module.spare_cores() == 1  # kvtier's threads placed off the compute cores: those
    monkeypatch.setattr(copies_module.torch, "get_num_threads", lambda: 15)
    assert copies_module.spare_cores() == 0  # torch spreads each copy over its 15 threads already
