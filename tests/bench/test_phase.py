"""The re-reading phase's pairs (``phase.disk_then_dram``): each prompt from the disk, then from kvtier's DRAM,
vLLM's prefix cache emptied before each, and a pair that was not what it stands for refused. vLLM and the store
are stand-ins here: what they serve follows what was emptied, as the real ones' does (the real phase runs in
``kvtier bench``)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvtier.bench import phase


class Store:
    """Serves a prompt's 4 chunks from the disk after its DRAM was dropped, else from DRAM (``dram_lost``: from
    the disk again, as if a disk hit had not been kept in DRAM)."""

    def __init__(self, dram_lost: bool = False) -> None:
        self.hits = {"dram": 0.0, "disk": 0.0}
        self.dropped = False
        self.dram_lost = dram_lost
        self.calls: list[str] = []

    class _Tier:
        name = "disk"

    tiers: ClassVar[list[_Tier]] = [_Tier()]

    def flush(self) -> None:
        self.calls.append("flush")

    def drop_dram(self) -> None:
        self.calls.append("drop")
        self.dropped = True

    def serve(self) -> None:
        self.hits["disk" if self.dropped or self.dram_lost else "dram"] += 4
        self.dropped = False

    def stats(self) -> dict[str, dict[str, float]]:
        return {"dram": {"hit_chunks_total": self.hits["dram"]}, "disk": {"hit_chunks_total": self.hits["disk"]},
                "_store": {}}


class LLM:
    def __init__(self, store: Store) -> None:
        self.store = store

    def reset_prefix_cache(self) -> bool:
        self.store.calls.append("reset")
        return True

    def generate(self, prompts, params, use_tqdm: bool) -> None:
        self.store.calls.append("generate")
        self.store.serve()


JOB = {"requests": [{"round": 0, "doc": 0, "tokens": [1, 2]}, {"round": 1, "doc": 0, "tokens": [1, 3]},
                    {"round": 1, "doc": 1, "tokens": [4, 5]}]}


def test_each_prompt_comes_from_the_disk_then_from_dram() -> None:
    store = Store()
    disk, dram, chunks = phase.disk_then_dram(LLM(store), store, JOB, [1])
    assert len(disk) == len(dram) == 2 and chunks == [4, 4]
    one = ["flush", "drop", "reset", "generate", "reset", "generate"]  # dropped before the disk hit only
    assert store.calls == one + one


def test_a_dram_hit_that_read_the_disk_is_refused() -> None:
    store = Store(dram_lost=True)
    with pytest.raises(RuntimeError, match=r"round 1 doc 0: .* \(0.0, 4.0, 0.0\) from the disk, then \(0.0, 4.0, "
                                           r"0.0\) from DRAM"):
        phase.disk_then_dram(LLM(store), store, JOB, [1])
