"""kvtier bench's pairs (``kvtier.bench.pairs``): each kvtier hit beside vLLM's own hit of the same prompt shape,
their order alternating and the kinds rotating, each pair refused when it was not what it stands for, and the
ratio's interval and floor computed from what was measured. The engine and the store are a stand-in here: what
they serve follows what was emptied, as the real ones' does (the real pairs run in ``kvtier bench``)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import pairs

ROOT = Path(__file__).resolve().parents[2]
DOCS = [[1, 2, 3, 4], [5, 6, 7, 8]]


class Engine:
    """vLLM's prefix cache and kvtier's DRAM and disk, by document: a prompt is served by vLLM's cache if it holds
    the document, else by kvtier's DRAM, else by its disk (which keeps it in DRAM); either spares computing the
    document's blocks of two tokens up to the prompt's last token. ``kvtier_s``/``engine_s``: the TTFT either
    takes. ``leaky``: vLLM's own hit is helped by kvtier too (a chunk past vLLM's blocks). ``partial``: kvtier's
    hit loads a block short. ``fails``: a chunk of kvtier's hit is missing when read (vLLM recomputes it, but still
    counts the tokens it planned to load as cached). ``evicts``: neither vLLM's cache nor kvtier keeps what a hit
    loaded (the next request of the document recomputes it)."""

    BLOCK = 2

    def __init__(self, kvtier_s: float = 0.11, engine_s: float = 0.10, leaky: bool = False,
                 forgets_drop: bool = False, partial: bool = False, evicts: bool = False, fails: bool = False) -> None:
        self.vllm: set[int] = set()
        self.dram = {d[0] for d in DOCS}
        self.hits = [0.0, 0.0, 0.0]
        self.cached = 0
        self.calls: list[tuple[str, int]] = []
        self.kvtier_s, self.engine_s, self.leaky, self.forgets_drop = kvtier_s, engine_s, leaky, forgets_drop
        self.partial, self.evicts, self.fails = partial, evicts, fails
        self.gone: set[int] = set()

    def ttft(self, tokens: list[int]) -> float:
        doc = tokens[0]
        spared = min(len(DOCS[0]), (len(tokens) - 1) // self.BLOCK * self.BLOCK)
        if doc in self.vllm:
            self.calls.append(("engine", doc))
            self.hits[0] += self.leaky
            self.cached += spared
            return self.engine_s
        if self.evicts and doc in self.gone:
            self.calls.append(("recompute", doc))
            return self.engine_s
        self.hits[0 if doc in self.dram else 1] += 4 - self.fails
        self.hits[2] += self.fails
        self.cached += spared - self.BLOCK * self.partial
        self.calls.append(("kvtier" if doc in self.dram else "kvtier disk", doc))
        if self.evicts:
            self.gone.add(doc)
            self.dram.discard(doc)
        else:
            self.dram.add(doc)
            self.vllm.add(doc)
        return self.kvtier_s

    def reset(self) -> None:
        self.vllm.clear()

    def drop(self) -> None:
        if not self.forgets_drop:
            self.dram.clear()

    def ask(self, ttft=None) -> pairs.Ask:
        return pairs.Ask(ttft=ttft or self.ttft, served=lambda: (self.hits[0], self.hits[1], self.hits[2]),
                         cached=lambda: self.cached, reset=self.reset, drop=self.drop, block_tokens=self.BLOCK,
                         unit_tokens=self.BLOCK, chunk_tokens=1)


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
        # which request runs first: each document's by turns over its rounds
        for d in range(len(DOCS)):
            mine = times["kvtier_first"][d::len(DOCS)]
            assert all(a != b for a, b in itertools.pairwise(mine)), (kind, d, mine)
    per_doc = len(pairs.KINDS)
    # each document's round starts with an untimed request that brings it into kvtier's DRAM and vLLM's cache,
    # so a document's first pair may start with vLLM's own hit
    rounds_calls = [engine.calls[i:i + 1 + 2 * per_doc] for i in range(0, len(engine.calls), 1 + 2 * per_doc)]
    assert all(c[0][0] != "engine" for c in rounds_calls[:len(DOCS)]), "the first round's warm-up loads from kvtier"
    calls = [call for c in rounds_calls for call in c[1:]]
    firsts = [calls[i][0].startswith("kvtier") for i in range(0, len(calls), 2)]
    assert firsts == [f for r in range(rounds) for d in range(len(DOCS)) for f in
                      [got[kind]["kvtier_first"][r * len(DOCS) + d] for kind in _rotated(r + d)]], "as recorded"
    assert not all(firsts[i] for i in range(0, len(firsts), per_doc)), "a document's first pair may be vLLM's first"


def _rotated(shift: int) -> list[str]:
    shift %= len(pairs.KINDS)
    return [*pairs.KINDS[shift:], *pairs.KINDS[:shift]]


def test_one_kind_alone_alternates_its_order() -> None:
    """The API server's phase measures DRAM hits alone: half its pairs run vLLM's own hit first, by turns over
    the documents of a round and over the rounds of a document."""
    docs = [[d, 2, 3, 4] for d in range(1, 5)]
    engine = Engine()
    engine.dram |= {d[0] for d in docs}
    got = pairs.measure(engine.ask(), docs, suffixes(100), 2, kinds=("DRAM hit",))
    assert got["DRAM hit"]["kvtier_first"] == [True, True, False, False, False, False, True, True]


def test_the_order_is_balanced_by_kind_document_round_and_place() -> None:
    """The full profile's shape: 4 documents, 4 rounds, 4 kinds. Each kind runs kvtier first in half the pairs of
    each document and of each round, and each place of a document's round runs either way as often."""
    docs = [[d, 2, 3, 4] for d in range(1, 5)]
    engine = Engine()
    engine.dram |= {d[0] for d in docs}
    order: list[tuple[str, bool]] = []
    got = pairs.measure(engine.ask(), docs, suffixes(200), 4,
                        log=lambda m: order.append((m.split(":")[0][5:], "kvtier first" in m)))
    for kind, times in got.items():
        first = times["kvtier_first"]  # by round, then document
        assert all(sum(first[d::4]) == 2 for d in range(4)), (kind, "by document", first)
        assert all(sum(first[4 * r:4 * r + 4]) == 2 for r in range(4)), (kind, "by round", first)
        for place in range(4):  # each kind at each place of a document's round, either way as often
            at = [f for i, (k, f) in enumerate(order) if k == kind and i % 4 == place]
            assert len(at) == 4 and sum(at) == 2, (kind, place, at)


def test_the_kinds_take_each_place_as_often_even_in_one_round() -> None:
    docs = [[d, 2, 3, 4] for d in range(1, 5)]  # as many documents as kinds, one round
    engine = Engine()
    engine.dram |= {d[0] for d in docs}
    places: dict[str, list[int]] = {kind: [] for kind in pairs.KINDS}
    order: list[str] = []
    pairs.measure(engine.ask(), docs, suffixes(100), 1, log=lambda m: order.append(m.split(":")[0][5:]))
    for i, kind in enumerate(order):
        places[kind].append(i % len(pairs.KINDS))
    assert all(sorted(p) == [0, 1, 2, 3] for p in places.values()), places


def test_every_suffix_is_used_once_and_running_out_is_an_error() -> None:
    engine = Engine()
    fresh = suffixes(pairs.suffixes_needed(len(DOCS), 1))
    seen: list[list[int]] = []
    ttft = engine.ttft
    ask = engine.ask(ttft=lambda t: (seen.append(t), ttft(t))[1])
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


def test_a_partial_kvtier_hit_is_refused() -> None:
    with pytest.raises(RuntimeError, match="spared 2 of the document's 4 tokens"):
        pairs.measure(Engine(partial=True).ask(), DOCS, suffixes(100), 1, kinds=("DRAM hit",))


def test_a_kvtier_hit_with_a_chunk_missing_is_refused() -> None:
    """vLLM counts what it planned to load as cached even when a chunk's read fails and it recomputes: the chunks
    kvtier served, and none missing, must say the load was whole."""
    with pytest.raises(RuntimeError, match=r"served \(3.0, 0.0, 1.0\) chunks .*expected 4 from DRAM only"):
        pairs.measure(Engine(fails=True).ask(), DOCS, suffixes(100), 1, kinds=("DRAM hit",))


def test_a_kvtier_hit_that_also_reads_the_other_tier_is_refused() -> None:
    engine = Engine()
    ask = engine.ask()
    served = ask.served
    extra = [0.0]

    def ttft(tokens: list[int]) -> float:
        seconds = engine.ttft(tokens)
        if "kvtier" in engine.calls[-1][0]:
            extra[0] += 1  # one chunk more, from the disk, beside all of DRAM's
        return seconds

    both = dataclasses.replace(ask, ttft=ttft, served=lambda: (served()[0], served()[1] + extra[0], served()[2]))
    with pytest.raises(RuntimeError, match=r"\(4.0, 1.0, 0.0\) chunks .*expected 4 from DRAM only"):
        pairs.measure(both, DOCS, suffixes(100), 1, kinds=("DRAM hit",), warm=False)


def test_each_orders_ratio_is_reported() -> None:
    times = {"kvtier": [0.3, 0.2, 0.3, 0.2], "engine": [0.1] * 4, "kvtier_first": [True, False, True, False]}
    row = pairs.summary(times, "DRAM hit", None, None)
    assert row["kvtier_first"] == 2
    assert row["ratio_kvtier_first"] == pytest.approx(3.0) and row["ratio_vllm_first"] == pytest.approx(2.0)


def test_a_vllm_hit_that_recomputes_is_refused() -> None:
    with pytest.raises(RuntimeError, match="vLLM's own hit found 0 of the document's 4 tokens"):
        pairs.measure(Engine(evicts=True).ask(), DOCS, suffixes(100), 1, kinds=("DRAM hit",), warm=False)


def test_a_whole_hit_stops_before_the_prompts_last_token_and_at_what_kvtier_stores() -> None:
    ask = Engine().ask()
    doc = list(range(10))
    assert ask.whole_hit(doc, doc + [99], kvtier=False) == 10
    assert ask.whole_hit(doc, doc, kvtier=False) == 8  # vLLM computes the last token (block 2: up to 8)
    chunked = dataclasses.replace(ask, unit_tokens=4)  # no tails: kvtier stores chunks of 4 tokens only
    assert chunked.whole_hit(doc, doc + [99], kvtier=True) == 8
    assert chunked.whole_hit(doc, doc + [99], kvtier=False) == 10
    assert pairs.units({"block_tokens": 16, "store_tails": False, "store": {"chunk_tokens": 256}}) == {
        "block_tokens": 16, "unit_tokens": 256, "chunk_tokens": 256}
    assert pairs.units({"block_tokens": 16, "store": {"chunk_tokens": 256}})["unit_tokens"] == 16


def test_a_disk_hit_served_from_dram_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"\(4.0, 0.0, 0.0\) chunks .*expected 4 from the secondary tier only"):
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
    # pairs resampled whole: however much the times vary, kvtier at 1.1x of each vLLM time beside it is 1.1 exactly
    varied = [0.05, 0.30, 0.08, 0.50, 0.12, 0.09]
    assert pairs.interval([1.1 * t for t in varied], varied) == pytest.approx((1.1, 1.1))
    # and the interval is of the ratio, not of one side: the same kvtier times over slower vLLM times sit lower
    assert pairs.interval(kvtier, [2 * t for t in engine])[1] < low
    with pytest.raises(ValueError, match="2 kvtier times against 1"):
        pairs.interval([0.1, 0.1], [0.1])


def test_the_floor_adds_the_copy_and_for_a_disk_hit_the_read_and_the_checksum() -> None:
    bw = {"copy": 10e9, "read": 20e9, "checksum": 40e9}
    assert pairs.floor("DRAM hit", 0.1, 10**9, bw) == pytest.approx(0.2)
    assert pairs.floor("disk hit", 0.1, 10**9, bw) == pytest.approx(0.1 + 0.1 + 0.05 + 0.025)
    row = pairs.summary({"kvtier": [0.3, 0.3], "engine": [0.1, 0.1]}, "DRAM hit", 10**9, bw)
    assert row["ratio"] == pytest.approx(3.0) and row["floor"] == pytest.approx(2.0) and row["pairs"] == 2
    assert "floor" not in pairs.summary({"kvtier": [0.3], "engine": [0.1]}, "DRAM hit", None, None)
    # Copied layer by layer beside the forward pass, the copy adds nothing; a disk hit's read and checksum still do.
    beside = {**bw, "beside_forward": True}
    assert pairs.floor("DRAM hit", 0.1, 10**9, beside) == pytest.approx(0.1)
    assert pairs.floor("disk hit", 0.1, 10**9, beside) == pytest.approx(0.1 + 0.05 + 0.025)


def test_a_shared_hits_floor_is_the_prefix_at_the_servers_wire_speed() -> None:
    """Loaded beside vLLM's steps before the forward pass, a shared tier's hit moves the prefix's bytes over the
    wire first; its checksum and copy are at best hidden under them."""
    bw = {"copy": 10e9, "read": 20e9, "checksum": 40e9, "wire": 2e9, "beside_forward": True}
    assert pairs.floor("shared hit", 0.1, 10**9, bw) == pytest.approx(0.1 + 0.5)
    row = pairs.summary({"kvtier": [0.9, 0.9], "engine": [0.1, 0.1]}, "shared hit", 10**9, bw)
    assert row["floor"] == pytest.approx(6.0)


def test_the_wire_speed_is_read_through_the_tier_and_leaves_nothing(redis_server, unique_prefix: str) -> None:
    """A real Redis: the objects are written, read back through the tier's own read, and deleted."""
    from kvtier.tiers.redis.tier import RedisTier

    tier = RedisTier.from_config("redis", {"url": redis_server.url, "key_prefix": unique_prefix}, "tiers[0]")
    try:
        for readers in (1, 3):
            assert pairs.wire(tier, 4 * 2**20, 4, readers, repeats=2) > 0
        assert list(tier.list()) == []
    finally:
        tier.close()


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
    assert got["disk hit"]["kvtier_first"] == [True, True]


def test_runs_agree_when_every_ratio_is_within_the_limit_of_their_median() -> None:
    def run(dram: float, disk: float, extra: bool = False) -> dict:
        hits = {"DRAM hit": {"ratio": dram, "interval": [dram, dram]},
                "disk hit": {"ratio": disk, "interval": [disk, disk]}}
        if extra:
            hits["API server"] = {"ratio": 9.0, "interval": [9.0, 9.0]}
        return {"hits": hits}

    agreed = pairs.across_runs([run(1.00, 1.20, True), run(1.04, 1.30), run(1.02, 1.21)])
    rows = {r["name"]: r for r in agreed["rows"]}
    assert set(rows) == {"DRAM hit", "disk hit"}
    assert agreed["missing"] == {"API server": [1, 2]}, "a hit some runs lack is named, with the runs lacking it"
    assert rows["DRAM hit"]["median"] == 1.02 and rows["DRAM hit"]["within"]
    assert rows["disk hit"]["max_deviation"] == pytest.approx(1.30 / 1.21 - 1)  # the farthest run, signed
    assert not rows["disk hit"]["within"]
    with pytest.raises(ValueError, match="no runs"):
        pairs.across_runs([])


def _ttft_runs(tmp_path: Path, runs: list[dict], *extra: str) -> subprocess.CompletedProcess[str]:
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ttft_runs.py"), *map(str, paths), *extra],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def test_ttft_runs_compares_three_runs_of_one_profile_on_one_machine(tmp_path: Path) -> None:
    def run(dram: float, **over: object) -> dict:
        return {"profile": {"name": "full", "docs": 4}, "secondary": "disk", "machine": "AMD EPYC, 2 cores",
                "hits": {"DRAM hit": {"ratio": dram, "interval": [dram, dram]}}, **over}

    two = _ttft_runs(tmp_path, [run(1.1), run(1.1)])
    assert two.returncode == 2 and "at least three runs" in two.stderr
    other = _ttft_runs(tmp_path, [run(1.1), run(1.1), run(1.1, profile={"name": "full", "docs": 8})])
    assert other.returncode == 2 and "its profile is" in other.stderr
    moved = _ttft_runs(tmp_path, [run(1.1), run(1.1), run(1.1, secondary="redis")])
    assert moved.returncode == 2 and "its secondary is 'redis'" in moved.stderr
    lacking = run(1.1)
    lacking["hits"]["disk hit"] = {"ratio": 1.2, "interval": [1.2, 1.2]}
    out = tmp_path / "agreed.json"
    partial = _ttft_runs(tmp_path, [lacking, run(1.1), run(1.12)], "--json", str(out))
    assert partial.returncode == 1, "a hit some run lacks is not agreement"
    assert "disk hit: NOT compared, missing from" in partial.stdout
    assert json.loads(out.read_text())["missing"] == {"disk hit": [1, 2]}
    agreed = _ttft_runs(tmp_path, [run(1.1), run(1.1), run(1.12)])
    assert agreed.returncode == 0 and "DRAM hit: median 1.100" in agreed.stdout


def test_the_api_servers_counts_sum_its_stores_and_fail_when_one_stops_answering() -> None:
    """kvtier's counters in vLLM's API server: a scheduler's and a worker's store, each serving its metrics."""
    import http.server
    import threading

    from kvtier.bench import server
    from kvtier.errors import KVTierError
    from kvtier.testing.servers import free_port

    bodies = [
        'kvtier_hit_chunks_total{tier="dram",role="scheduler"} 0.0\nkvtier_miss_chunks_total{role="scheduler"} 0.0\n'
        'kvtier_hit_chunks_created{tier="dram",role="scheduler"} 1.7e9\n',
        'kvtier_hit_chunks_total{tier="dram",role="worker"} 16.0\nkvtier_hit_chunks_total{tier="disk",role="worker"} '
        '2.0\nkvtier_miss_chunks_total{role="worker"} 1.0\n']

    def handler(body: str) -> type[http.server.BaseHTTPRequestHandler]:
        class Metrics(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: object) -> None:
                pass
        return Metrics

    first = free_port()
    httpds = []
    for i, body in enumerate(bodies):
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", first + 2 * i), handler(body))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        httpds.append(httpd)
    try:
        ports = server.kvtier_ports(first)
        assert ports == [first, first + 2]  # the port between them has nothing
        assert server.kvtier_served(ports) == (16.0, 2.0, 1.0)
        httpds[1].shutdown()
        httpds[1].server_close()
        with pytest.raises(OSError):
            server.kvtier_served(ports)  # a store that stopped answering is an error, not fewer chunks
        httpds[0].shutdown()
        httpds[0].server_close()
        with pytest.raises(KVTierError, match="no kvtier metrics"):
            server.kvtier_ports(first)
    finally:
        for httpd in httpds:
            httpd.server_close()
