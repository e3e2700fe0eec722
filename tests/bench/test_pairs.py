"""kvtier bench's pairs (``kvtier.bench.pairs``): each kvtier hit beside vLLM's own hit of the same prompt shape,
their order alternating and the kinds rotating, each pair refused when it was not what it stands for, and the
ratio's interval and floor computed from what was measured. The engine and the store are a stand-in here: what
they serve follows what was emptied, as the real ones' does (the real pairs run in ``kvtier bench``)."""

from __future__ import annotations

import pytest

from kvtier.bench import pairs

DOCS = [[1, 2, 3, 4], [5, 6, 7, 8]]


class Engine:
    """vLLM's prefix cache and kvtier's DRAM and disk, by document: a prompt is served by vLLM's cache if it holds
    the document, else by kvtier's DRAM, else by its disk (which keeps it in DRAM). ``kvtier_s``/``engine_s``: the
    TTFT either takes. ``leaky``: vLLM's own hit is helped by kvtier too (a chunk past vLLM's blocks)."""

    def __init__(self, kvtier_s: float = 0.11, engine_s: float = 0.10, leaky: bool = False,
                 forgets_drop: bool = False) -> None:
        self.vllm: set[int] = set()
        self.dram = {d[0] for d in DOCS}
        self.hits = [0.0, 0.0]
        self.calls: list[tuple[str, int]] = []
        self.kvtier_s, self.engine_s, self.leaky, self.forgets_drop = kvtier_s, engine_s, leaky, forgets_drop

    def ttft(self, tokens: list[int]) -> float:
        doc = tokens[0]
        if doc in self.vllm:
            self.calls.append(("engine", doc))
            self.hits[0] += self.leaky
            return self.engine_s
        self.hits[0 if doc in self.dram else 1] += 4
        self.calls.append(("kvtier" if doc in self.dram else "kvtier disk", doc))
        self.dram.add(doc)
        self.vllm.add(doc)
        return self.kvtier_s

    def reset(self) -> None:
        self.vllm.clear()

    def drop(self) -> None:
        if not self.forgets_drop:
            self.dram.clear()

    def ask(self) -> pairs.Ask:
        return pairs.Ask(ttft=self.ttft, served=lambda: (self.hits[0], self.hits[1]), reset=self.reset,
                         drop=self.drop)


def suffixes(n: int) -> list[list[int]]:
    return [[100 + i] for i in range(n)]


def test_each_kind_gets_its_pairs_with_kvtier_and_vllm_in_alternating_order() -> None:
    engine = Engine()
    rounds = 3
    got = pairs.measure(engine.ask(), DOCS, suffixes(pairs.suffixes_needed(len(DOCS), rounds)), rounds)
    assert set(got) == set(pairs.KINDS)
    for kind, times in got.items():
        assert times["kvtier"] == [0.11] * rounds * len(DOCS), kind
        assert times["engine"] == [0.10] * rounds * len(DOCS), kind
        assert times["chunks"] == [4] * rounds * len(DOCS), kind
    per_doc = len(pairs.KINDS)
    # each document's round starts with an untimed request that brings it into kvtier's DRAM, then its pairs
    rounds_calls = [engine.calls[i:i + 1 + 2 * per_doc] for i in range(0, len(engine.calls), 1 + 2 * per_doc)]
    assert all(c[0][0] != "engine" for c in rounds_calls), "vLLM's cache is emptied before each document's round"
    calls = [call for c in rounds_calls for call in c[1:]]
    sides = [who for who, _ in calls]
    firsts = [sides[i].startswith("kvtier") for i in range(0, len(sides), 2)]
    assert all(firsts[i] for i in range(0, len(firsts), per_doc)), "each document's first pair starts with kvtier"
    later = [f for i, f in enumerate(firsts) if i % per_doc]
    assert True in later and False in later, "within a document the order alternates"
    disk_first = [calls[2 * i][0] == "kvtier disk" or calls[2 * i + 1][0] == "kvtier disk"
                  for i in range(0, len(firsts), per_doc)]
    assert disk_first[:len(DOCS)] == [False] * len(DOCS) and True in disk_first, "the kinds' order rotates by round"


def test_every_suffix_is_used_once_and_running_out_is_an_error() -> None:
    engine = Engine()
    fresh = suffixes(pairs.suffixes_needed(len(DOCS), 1))
    seen: list[list[int]] = []
    ttft = engine.ttft
    ask = pairs.Ask(ttft=lambda t: (seen.append(t), ttft(t))[1], served=lambda: (engine.hits[0], engine.hits[1]),
                    reset=engine.reset, drop=engine.drop)
    pairs.measure(ask, DOCS, fresh, 1)
    tails = [t[4:] for t in seen if len(t) > 4]
    assert sorted(tails) == sorted(fresh), "each fresh suffix asked exactly once"
    # the documents alone: the untimed request before each document's pairs, and the two exact-repeat pairs
    assert [t for t in seen if len(t) == 4] == [d for d in DOCS for _ in range(5)]
    with pytest.raises(RuntimeError, match="ran out of fresh suffixes"):
        pairs.measure(Engine().ask(), DOCS, fresh[:-1], 1)


def test_a_vllm_hit_helped_by_kvtier_is_refused() -> None:
    with pytest.raises(RuntimeError, match="vLLM's own hit"):
        pairs.measure(Engine(leaky=True).ask(), DOCS, suffixes(100), 1, kinds=("DRAM hit",))


def test_a_disk_hit_served_from_dram_is_refused() -> None:
    with pytest.raises(RuntimeError, match="expected only the secondary tier"):
        pairs.measure(Engine(forgets_drop=True).ask(), DOCS, suffixes(100), 1, kinds=("disk hit",))


def test_the_interval_is_seeded_and_holds_the_ratio() -> None:
    kvtier = [0.11, 0.12, 0.10, 0.13, 0.11, 0.12, 0.30, 0.11]
    engine = [0.10, 0.10, 0.09, 0.11, 0.10, 0.10, 0.10, 0.10]
    low, high = pairs.interval(kvtier, engine)
    assert (low, high) == pairs.interval(kvtier, engine), "a result file reproduces its interval"
    assert low < pairs.ratio(kvtier, engine) < high
    assert pairs.interval(kvtier, engine, seed=1) != (low, high)
    same = pairs.interval([0.2] * 5, [0.1] * 5)
    assert same == pytest.approx((2.0, 2.0))
    with pytest.raises(ValueError, match="2 kvtier times against 1"):
        pairs.interval([0.1, 0.1], [0.1])


def test_the_floor_adds_the_copy_and_for_a_disk_hit_the_read_and_the_checksum() -> None:
    bw = {"copy": 10e9, "read": 20e9, "checksum": 40e9}
    assert pairs.floor("DRAM hit", 0.1, 10**9, bw) == pytest.approx(0.2)
    assert pairs.floor("disk hit", 0.1, 10**9, bw) == pytest.approx(0.1 + 0.1 + 0.05 + 0.025)
    row = pairs.summary({"kvtier": [0.3, 0.3], "engine": [0.1, 0.1]}, "DRAM hit", 10**9, bw)
    assert row["ratio"] == pytest.approx(3.0) and row["floor"] == pytest.approx(2.0) and row["pairs"] == 2
    assert "floor" not in pairs.summary({"kvtier": [0.3], "engine": [0.1]}, "DRAM hit", None, None)


def test_the_bandwidths_are_measured(tmp_path) -> None:
    bw = pairs.bandwidths(1 << 20, repeats=2, work=tmp_path)
    assert set(bw) == {"copy", "read", "checksum"} and all(v > 0 for v in bw.values())
    assert list(tmp_path.iterdir()) == [], "the read's file is removed"


def test_without_warming_a_documents_first_request_is_kvtiers_timed_one() -> None:
    engine = Engine()
    engine.dram.clear()  # a new process: everything is on the disk
    got = pairs.measure(engine.ask(), DOCS, suffixes(4), 1, kinds=("disk hit",), warm=False)
    assert engine.calls == [("kvtier disk", 1), ("engine", 1), ("kvtier disk", 5), ("engine", 5)]
    assert got["disk hit"]["chunks"] == [4, 4]


def test_runs_agree_when_every_ratio_is_within_the_limit_of_their_median() -> None:
    def run(dram: float, disk: float, extra: bool = False) -> dict:
        hits = {"DRAM hit": {"ratio": dram, "interval": [dram, dram]},
                "disk hit": {"ratio": disk, "interval": [disk, disk]}}
        if extra:
            hits["API server"] = {"ratio": 9.0, "interval": [9.0, 9.0]}
        return {"hits": hits}

    rows = {r["name"]: r for r in pairs.across_runs([run(1.00, 1.20, True), run(1.04, 1.30), run(1.02, 1.21)])}
    assert set(rows) == {"DRAM hit", "disk hit"}  # a hit one run lacks is no row
    assert rows["DRAM hit"]["median"] == 1.02 and rows["DRAM hit"]["within"]
    assert rows["disk hit"]["max_deviation"] == pytest.approx(1.30 / 1.21 - 1)  # the farthest run, signed
    assert not rows["disk hit"]["within"]
    with pytest.raises(ValueError, match="no runs"):
        pairs.across_runs([])
