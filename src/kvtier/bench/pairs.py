"""Hits measured in pairs: each kvtier hit next to vLLM's own hit of the same prompt shape, in the same process
moments apart, in balanced order, so that neither how fast a process computes nor how the machine drifts
over a run can move their ratio.

A pair is one document asked twice, each time with a suffix of its own (a window of real text of one fixed
length, never asked before, so neither kvtier nor vLLM holds it): kvtier's hit (vLLM's prefix cache emptied,
for a disk hit kvtier's DRAM too; kvtier loads the document's chunks, vLLM computes the suffix) and vLLM's own
hit (the document's blocks left in vLLM's cache by an earlier request of it; vLLM computes the suffix). An
exact-repeat pair asks the document alone, twice. Each pair is checked to be what it stands for: kvtier's
request served from the intended tier and nowhere else, every chunk the document's hit needs and none missing,
and spared computing the whole document (no partial hit, no failed load recomputed); vLLM's own served nothing
from kvtier and found the whole document in its own prefix cache.

The ratio of a row is the mean of kvtier's times over the mean of vLLM's (TTFTs are compared by their means);
its interval is a percentile bootstrap over the pairs (seeded, so a result file reproduces its interval). The
floor of a row is what it cannot go under on this machine: vLLM's own hit plus the bytes of the prefix's KV over
this process's measured copy bandwidth (one copy into vLLM's blocks; none where the engine's loads are copied
layer by layer beside its forward pass), and for a disk hit over its page-cache read and checksum bandwidth too
(the forward pass's first layer needs every chunk read).
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What the pairs measure and check, numbered: results of different designs are not compared (ttft_runs.py).
# 4: each pair checked whole (every chunk from the intended tier, none missing; vLLM's cached tokens), its order
# kv_goes_first's (balanced by kind and place too).
DESIGN = 4
KINDS = ("DRAM hit", "disk hit", "DRAM hit, exact repeat", "disk hit, exact repeat")


@dataclass(frozen=True)
class Ask:
    """What a pair needs of its process: ``ttft(tokens)`` times one request; ``served()`` the chunks kvtier
    served so far from DRAM and from the secondary tier, and those it found nowhere; ``cached()`` the prompt
    tokens vLLM did not compute so far (found in its own prefix cache or loaded through its connector);
    ``reset()`` empties vLLM's prefix cache; ``drop()`` ends kvtier's queued writes and empties its DRAM.
    ``block_tokens`` is vLLM's block size, ``unit_tokens`` what kvtier stores a prompt by (a block with tails,
    else a chunk), ``chunk_tokens`` its chunk."""

    ttft: Callable[[list[int]], float]
    served: Callable[[], tuple[float, float, float]]
    cached: Callable[[], float]
    reset: Callable[[], None]
    drop: Callable[[], None]
    block_tokens: int
    unit_tokens: int
    chunk_tokens: int

    def whole_hit(self, doc: list[int], prompt: list[int], kvtier: bool) -> int:
        """The tokens a hit of ``doc`` must spare vLLM computing of ``prompt``: the document's blocks up to the
        block before the prompt's last token (which vLLM computes to sample from), and for kvtier's hit no
        more than the whole units it stores."""
        upto = min(len(doc), (len(prompt) - 1) // self.block_tokens * self.block_tokens)
        own = upto // self.block_tokens * self.block_tokens
        return min(own, len(doc) // self.unit_tokens * self.unit_tokens) if kvtier else own


def units(job: dict) -> dict[str, int]:
    """A bench job's ``block_tokens``, ``unit_tokens`` and ``chunk_tokens`` (:class:`Ask`): vLLM's block, what
    kvtier stores a prompt by (a block with tails, else a chunk) and kvtier's chunk."""
    block, chunk = job["block_tokens"], job["store"]["chunk_tokens"]
    return {"block_tokens": block, "unit_tokens": block if job.get("store_tails", True) else chunk,
            "chunk_tokens": chunk}


def measure(ask: Ask, docs: Sequence[list[int]], suffixes: Sequence[list[int]], rounds: int,
            kinds: Sequence[str] = KINDS, log: Callable[[str], None] = lambda _: None,
            warm: bool = True) -> dict[str, dict[str, list]]:
    """``rounds`` pairs of each kind for each document: ``{kind: {"kvtier": [s], "engine": [s], "chunks": [n],
    "kvtier_first": [bool]}}``. The kinds take turns within each document's round, their order rotated by
    document and round, so that each kind takes each place as often when the documents times the rounds are a
    multiple of the kinds; which of a pair's two requests comes first is :func:`kv_goes_first`. Each document's
    round starts with an untimed request of it (``warm``; a process's first use of what another stored is
    measured without), which leaves it in kvtier's DRAM (an earlier document's disk hit emptied it) and in vLLM's
    cache; without it, a document's first pair starts with kvtier's request, as vLLM holds none of it.
    RuntimeError when a pair was not what it stands for, or when the suffixes run out (``suffixes_needed``)."""
    out: dict[str, dict[str, list]] = {k: {"kvtier": [], "engine": [], "chunks": [], "kvtier_first": []}
                                       for k in kinds}
    fresh = iter(suffixes)
    for r in range(rounds):
        for d, doc in enumerate(docs):
            if warm:
                ask.ttft(doc)
            first = not warm
            shift = (r + d) % len(kinds)
            for kind in [*kinds[shift:], *kinds[:shift]]:
                kv_first = first or kv_goes_first(r, d, kinds.index(kind))
                first = False
                kv, engine, chunks = _pair(ask, doc, kind, fresh, kv_first)
                for key, value in (("kvtier", kv), ("engine", engine), ("chunks", chunks),
                                   ("kvtier_first", kv_first)):
                    out[kind][key].append(value)
                log(f"pair {kind}: round {r} doc {d}: kvtier {kv:.3f} s, vLLM's own hit {engine:.3f} s "
                    f"({chunks} chunks{', kvtier first' if kv_first else ', vLLM first'})")
    return out


def kv_goes_first(r: int, d: int, k: int) -> bool:
    """Whether the pair of kind ``k`` (its index) in round ``r`` of document ``d`` runs kvtier's request first: by
    turns over the rounds of each document, the documents of a round two by two, the kinds two by two. With the
    kinds rotated by ``r + d``, the full profile's 4 documents, 4 rounds and 4 kinds run each kind either way as
    often in each document, each round and each place of a document's round; with 3 documents no order can be
    balanced by round and place, and this one is by kind and document."""
    return (r + d // 2 + k // 2) % 2 == 0


def suffixes_needed(docs: int, rounds: int, kinds: Sequence[str] = KINDS) -> int:
    return docs * rounds * sum(0 if "exact" in k else 2 for k in kinds)


def _pair(ask: Ask, doc: list[int], kind: str, fresh, kv_first: bool) -> tuple[float, float, int]:
    exact, disk = "exact" in kind, kind.startswith("disk")

    def prompt() -> list[int]:
        if exact:
            return doc
        try:
            return doc + next(fresh)
        except StopIteration:
            raise RuntimeError("the pairs ran out of fresh suffixes") from None

    def kvtier() -> _Timed:
        if disk:
            ask.drop()
        ask.reset()
        return _timed(ask, prompt())

    def engine() -> _Timed:
        return _timed(ask, prompt())

    if kv_first:
        kv, own = kvtier(), engine()
    else:
        own, kv = engine(), kvtier()
    (from_dram, from_tier, missed), source = kv.served, "the secondary tier" if disk else "DRAM"
    if own.served != (0.0, 0.0, 0.0):
        raise RuntimeError(f"pair {kind}: vLLM's own hit was served {own.served} chunks (DRAM, secondary tier, "
                           "missing) by kvtier; it must be vLLM's cache alone")
    if own.cached < (need := ask.whole_hit(doc, own.prompt, kvtier=False)):
        raise RuntimeError(f"pair {kind}: vLLM's own hit found {own.cached:.0f} of the document's {need} tokens in "
                           "its prefix cache; it must find them all")
    need = ask.whole_hit(doc, kv.prompt, kvtier=True)
    chunks = -(-need // ask.chunk_tokens)  # the chunks, the last perhaps a tail, that hold the tokens it needs
    got = from_tier if disk else from_dram
    if got < chunks or missed or (from_dram if disk else from_tier):
        raise RuntimeError(f"pair {kind}: kvtier's request served {kv.served} chunks (DRAM, secondary tier, "
                           f"missing); expected {chunks} from {source} only")
    if kv.cached < need:
        raise RuntimeError(f"pair {kind}: kvtier's request was spared {kv.cached:.0f} of the document's {need} "
                           f"tokens; a hit from {source} must load them all")
    return kv.seconds, own.seconds, int(got)


@dataclass(frozen=True)
class _Timed:
    prompt: list[int]
    seconds: float
    served: tuple[float, float, float]  # chunks kvtier served it, from DRAM and from the secondary tier; missing
    cached: float  # its tokens vLLM did not compute


def _timed(ask: Ask, tokens: list[int]) -> _Timed:
    before, cached = ask.served(), ask.cached()
    seconds = ask.ttft(tokens)
    after = ask.served()
    served = (after[0] - before[0], after[1] - before[1], after[2] - before[2])
    return _Timed(tokens, seconds, served, ask.cached() - cached)


def ratio(kvtier: Sequence[float], engine: Sequence[float]) -> float:
    return statistics.fmean(kvtier) / statistics.fmean(engine)


def interval(kvtier: Sequence[float], engine: Sequence[float], level: float = 0.90, resamples: int = 2000,
             seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of :func:`ratio` over the pairs (resampled whole, so each kvtier time
    stays with the vLLM time it was measured beside)."""
    if len(kvtier) != len(engine) or not kvtier:
        raise ValueError(f"pairs: {len(kvtier)} kvtier times against {len(engine)} of vLLM's own hit")
    rng = random.Random(seed)
    pairs = list(zip(kvtier, engine, strict=True))
    draws = []
    for _ in range(resamples):
        drawn = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        draws.append(sum(ours for ours, _ in drawn) / sum(theirs for _, theirs in drawn))
    draws.sort()
    tail = (1.0 - level) / 2
    return draws[int(tail * (resamples - 1))], draws[int((1.0 - tail) * (resamples - 1))]


def bandwidths(nbytes: int, repeats: int = 5, work: Path | None = None) -> dict[str, float]:
    """This process's bytes per second, the median of ``repeats``: ``copy``, one copy of ``nbytes`` between two
    buffers in memory (torch, this thread); ``read``, reading a file of that size from the page cache into a
    buffer; ``checksum``, xxh3-128 over it (the frame's payload check)."""
    import torch
    import xxhash

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - start)
    view = src.numpy().data
    sums = []
    for _ in range(repeats):
        start = time.perf_counter()
        xxhash.xxh3_128_digest(view)
        sums.append(time.perf_counter() - start)
    reads = []
    buffer = dst.numpy().data
    with tempfile.NamedTemporaryFile(dir=work) as f:
        f.write(view)
        f.flush()
        with open(f.name, "rb", buffering=0) as g:
            for _ in range(repeats + 1):  # the first fills the page cache
                g.seek(0)
                start = time.perf_counter()
                done = 0
                while done < nbytes:
                    got = g.readinto(buffer[done:])
                    if not got:
                        raise RuntimeError(f"{f.name}: ended at {done} of {nbytes} bytes")
                    done += got
                reads.append(time.perf_counter() - start)
    return {"copy": nbytes / statistics.median(copies), "read": nbytes / statistics.median(reads[1:]),
            "checksum": nbytes / statistics.median(sums)}


def wire(tier: Any, nbytes: int, objects: int, readers: int, repeats: int = 3) -> float:
    """Bytes per second a shared tier's server sends here: ``objects`` objects of ``nbytes`` in all (a
    document's chunks), written under a namespace of their own, then read back through the tier's own read, each
    into a buffer (no checksum, no DRAM, no copy into vLLM's blocks), ``readers`` at a time (as many as a load
    keeps in flight), the median of ``repeats``; the objects are deleted afterwards (one that cannot be is
    reported on stderr)."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from kvtier.keys import HeadRange, ShardKey

    size = nbytes // objects
    namespace = os.urandom(16).hex()
    keys = [ShardKey(namespace, f"{i:032x}", HeadRange(0, 1, 1)) for i in range(objects)]
    buffers = [memoryview(torch.empty(size, dtype=torch.uint8).numpy().data) for _ in range(readers)]
    slots: list[memoryview] = []

    def read(key: ShardKey) -> None:
        buffer = slots.pop()  # one buffer a reading thread (list.pop is atomic)
        try:
            if tier.get_into(key, 0, [buffer]) is None:
                raise RuntimeError(f"tier {tier.name}: {key.name} vanished while measuring its wire speed")
        finally:
            slots.append(buffer)

    try:
        for key in keys:
            tier.put(key, [os.urandom(size)])
        times = []
        with ThreadPoolExecutor(readers) as pool:
            for _ in range(repeats + 1):  # the first warms the connections
                slots[:] = buffers
                start = time.perf_counter()
                list(pool.map(read, keys))
                times.append(time.perf_counter() - start)
    finally:
        for key in keys:
            try:
                tier.delete(key)
            except Exception as exc:  # noqa: BLE001 reported; the measurement's own outcome stands
                print(f"bench: could not delete {key.name} from tier {tier.name}: {exc}", file=sys.stderr)
    return size * objects / statistics.median(times[1:])


def floor(kind: str, engine_hit: float, nbytes: int, bw: dict[str, float]) -> float:
    """The least TTFT a hit of ``kind`` can have here: vLLM's own hit plus moving the prefix's KV (its copy into
    vLLM's blocks only where it is not hidden beside the forward pass: ``bw["beside_forward"]``). A hit from a
    shared tier (``kind`` "shared hit") is loaded beside vLLM's steps before its forward pass: the prefix's bytes
    at the server's wire speed (``bw["wire"]``), with the checksum and the copy into vLLM's blocks at best
    hidden under them."""
    if kind == "shared hit":
        return engine_hit + nbytes / bw["wire"]
    moved = 0.0 if bw.get("beside_forward") else nbytes / bw["copy"]
    if kind.startswith("disk") or "restart" in kind:
        moved += nbytes / bw["read"] + nbytes / bw["checksum"]
    return engine_hit + moved


def summary(times: dict[str, list], kind: str, nbytes: int | None, bw: dict[str, float] | None) -> dict[str, Any]:
    """One row: the ratio, its interval, the pairs' count, the means, and the floor where it is known."""
    kv, own = times["kvtier"], times["engine"]
    row: dict[str, Any] = {"ratio": ratio(kv, own), "interval": list(interval(kv, own)), "pairs": len(kv),
                           "kvtier_mean": statistics.fmean(kv), "engine_mean": statistics.fmean(own)}
    if "kvtier_first" in times:  # how many of the pairs ran kvtier's request first, and each order's ratio
        row["kvtier_first"] = sum(times["kvtier_first"])
        for name, first in (("ratio_kvtier_first", True), ("ratio_vllm_first", False)):
            picked = [i for i, f in enumerate(times["kvtier_first"]) if f == first]
            if picked:
                row[name] = ratio([kv[i] for i in picked], [own[i] for i in picked])
    if nbytes and bw:
        row["floor"] = floor(kind, row["engine_mean"], nbytes, bw) / row["engine_mean"]
    return row


def across_runs(runs: Sequence[dict[str, Any]], limit: float = 0.05) -> dict[str, Any]:
    """Whether several runs (``kvtier bench --json`` files) agree: ``rows``, one per hit every run measured, with
    each run's ratio, their median, the run farthest from it (its deviation, signed) and whether that is within
    ``limit``; ``missing``, each hit some run lacks, with the runs (by index) that lack it."""
    if not runs:
        raise ValueError("across_runs: no runs")
    names = list(dict.fromkeys(n for r in runs for n in r["hits"]))
    rows, missing = [], {}
    for name in names:
        if lacking := [i for i, r in enumerate(runs) if name not in r["hits"]]:
            missing[name] = lacking
            continue
        values = [r["hits"][name]["ratio"] for r in runs]
        median = statistics.median(values)
        deviation = max((v / median - 1 for v in values), key=abs)
        rows.append({"name": name, "runs": values, "median": median, "max_deviation": deviation,
                     "within": abs(deviation) <= limit, "intervals": [r["hits"][name]["interval"] for r in runs]})
    return {"rows": rows, "missing": missing}


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    """Bytes of KV one token takes in vLLM's cache for the model in ``model_dir`` (keys and values, every
    layer)."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head_dim * dtype_bytes
