"""The exact cache layer: prefix-hit ratios of a trace against one cache of a given capacity, in blocks.

The access model is the store's. A request looks its whole blocks up from the first; its hit is the leading run
of resident blocks. Then each of its whole blocks is used in order: a resident block is touched (a hit is read,
a block stored again is refreshed), an absent one is inserted, evicting by the policy when the cache is full.
A partial trailing block is never stored. The hit ratio divides hit blocks by every block of every prompt.

- :func:`replay` runs any policy of :data:`kvtier.eviction.POLICIES`, the very classes the DRAM pool uses, with
  the pool's two-phase puts (a request's new blocks are committed together, and never evict each other).
- :func:`lru_curve` gives LRU's hit ratio at every capacity in one pass (Mattson's stack distances; a request's
  block hits at capacity C iff every block up to it has a stack distance below C). It treats a request's blocks
  as touched one by one in order, so it can differ slightly from the two-phase replay (by 0.0001 on the
  Mooncake traces): the curve is for the shape over all capacities, the replay for exact numbers.
- :func:`oracle_admission` is LRU storing only blocks used again later, a reference for admission policies.
- :func:`leaf_first_lru` is textbook leaf-first LRU (blocks inserted one by one), the reference ``prefix_lru``
  is held to: replayed with the pool's puts, which never evict the prompt's own prefix, it never loses to it
  (a property test; it lost on multi-tenant agent traces when puts could evict their own prefix).
- :func:`belady` is Belady's MIN (evict the block used farthest in the future; never-used-again and deepest
  first on ties), a reference line: it maximizes block hits, which bounds but does not equal prefix hits.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from kvtier.eviction import POLICIES
from kvtier.sim.trace import Trace

Progress = Callable[[int], None]  # called with how many requests were just processed


@dataclasses.dataclass(frozen=True)
class HitCount:
    """Hit blocks out of every block looked up."""

    hits: int
    accesses: int

    @property
    def ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


class LRUCurve:
    """LRU's prefix-hit count at every capacity, from one pass over a trace."""

    def __init__(self, histogram: np.ndarray, accesses: int) -> None:
        self._cumulative = np.concatenate([[0], np.cumsum(histogram)])  # [c] = hits at capacity c
        self.accesses = accesses

    @property
    def saturation(self) -> int:
        """The smallest capacity with the infinite cache's hits."""
        return len(self._cumulative) - 1

    def at(self, capacity: int) -> HitCount:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        return HitCount(int(self._cumulative[min(capacity, self.saturation)]), self.accesses)


def lru_curve(trace: Trace, progress: Progress | None = None) -> LRUCurve:
    """LRU's hit count at every capacity in one pass: O(log n) per block (a Fenwick tree over access times
    marks each block's last access; the marks between two accesses of a block are its stack distance)."""
    size = sum(r.whole for r in trace.requests) + 1
    tree = [0] * (size + 1)

    def add(i: int, delta: int) -> None:
        i += 1
        while i <= size:
            tree[i] += delta
            i += i & -i

    def before(i: int) -> int:  # marks at positions < i
        total = 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    last: dict[int, int] = {}
    levels: list[int] = []  # per whole-block access: the running maximum stack distance of its request so far
    now = 0
    for count, request in enumerate(trace.requests, 1):
        worst = -1
        for block in request.blocks[:request.whole]:
            prev = last.get(block)
            if prev is None:
                worst = math.inf  # type: ignore[assignment]  # never seen: farther than any distance
            else:
                distance = before(now) - before(prev + 1)
                worst = max(worst, distance)
                add(prev, -1)
            add(now, 1)
            last[block] = now
            now += 1
            if worst != math.inf:
                levels.append(worst)
        if progress is not None and count % 1000 == 0:
            progress(1000)
    if progress is not None:
        progress(len(trace.requests) % 1000)
    # A block with running maximum m hits at every capacity above m.
    histogram = np.bincount(np.asarray(levels, dtype=np.int64)) if levels else np.zeros(0, dtype=np.int64)
    return LRUCurve(histogram, trace.accesses)


class BlockCache:
    """One cache of ``capacity`` blocks (None: unbounded) evicting by a named policy, with the DRAM pool's
    two-phase puts: :meth:`put` touches the blocks already resident and reserves the rest, evicting only what was
    committed before and is not one of the prompt's blocks before the one being stored (its prefix: evicting it
    would strand the blocks after it); those are committed together, in order. When nothing else is left to
    evict, the rest of the put is dropped, as the pool answers "full"."""

    def __init__(self, policy: str, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self._order = POLICIES.resolve(policy, "policy")()
        self.resident: set[int] = set()

    def run(self, blocks: Sequence[int], start: int = 0) -> int:
        """How many blocks from ``start`` on are resident, in a row."""
        end = start
        while end < len(blocks) and blocks[end] in self.resident:
            end += 1
        return end - start

    def touch(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if block in self.resident:
                self._order.touch(block)

    def put(self, blocks: Sequence[int], admit: Callable[[int], bool] | None = None, start: int = 0,
            only: set[int] | None = None) -> list[int]:
        """Store ``blocks[start:]`` (a prompt's whole blocks, in order; the earlier ones name parents), or of
        those only the ones in ``only``; returns those newly stored."""
        pending: dict[int, int | None] = {}  # reserved block -> parent, in order
        own = set(blocks[:start])  # the prompt's blocks before the one being stored: never evicted for it

        def evictable(block: Hashable) -> bool:
            return block not in own

        for j in range(start, len(blocks)):
            if j > start:
                own.add(blocks[j - 1])
            block = blocks[j]
            if only is not None and block not in only:
                continue
            if block in self.resident:
                self._order.touch(block)
                continue
            if block in pending or (admit is not None and not admit(block)):
                continue
            if self.capacity is not None and len(self.resident) + len(pending) >= self.capacity:
                victim = self._order.victim(evictable)
                if victim is None:
                    break  # only this put's own reservations left: the pool answers "full"
                self._order.remove(victim)
                self.resident.discard(victim)
            pending[block] = blocks[j - 1] if j else None
        for block, parent in pending.items():
            self._order.insert(block, block, parent)
            self.resident.add(block)
        return list(pending)


def replay(trace: Trace, policy: str, capacity: int, progress: Progress | None = None,
           admit: Callable[[int, int], bool] | None = None) -> HitCount:
    """Replay the trace through a :class:`BlockCache` of ``capacity`` blocks, as the DRAM pool runs: each
    request's hit run is read (touched), then its whole blocks are put. ``admit(block, request index)``, when
    given, decides whether a new block is stored at all."""
    cache = BlockCache(policy, capacity)
    hits = 0
    for count, request in enumerate(trace.requests, 1):
        blocks = request.blocks[:request.whole]
        run = cache.run(blocks)
        cache.touch(blocks[:run])
        hits += run
        i = count - 1
        cache.put(blocks, None if admit is None else (lambda block: admit(block, i)))  # noqa: B023 used within put only
        if progress is not None and count % 1000 == 0:
            progress(1000)
    if progress is not None:
        progress(len(trace.requests) % 1000)
    return HitCount(hits, trace.accesses)


def leaf_first_lru(trace: Trace, capacity: int) -> HitCount:
    """Textbook leaf-first LRU, a reference line: a request's whole blocks are used one by one in order, each
    absent one inserted at once, evicting the least recently used block with no resident child (the policy
    ``prefix_lru``, without the pool's two-phase puts or their rule of never evicting the prompt's own
    prefix)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    order = POLICIES.resolve("prefix_lru", "policy")()
    resident: set[int] = set()
    hits = 0
    for request in trace.requests:
        blocks = request.blocks[:request.whole]
        run = 0
        while run < len(blocks) and blocks[run] in resident:
            run += 1
        hits += run
        for j, block in enumerate(blocks):
            if block in resident:
                order.touch(block)
                continue
            if len(resident) >= capacity:
                victim = order.victim(_any)
                assert victim is not None, "a full cache has a resident block"
                order.remove(victim)
                resident.discard(victim)
            order.insert(block, block, blocks[j - 1] if j else None)
            resident.add(block)
    return HitCount(hits, trace.accesses)


def _any(_block: Hashable) -> bool:
    return True


def belady(trace: Trace, capacity: int, progress: Progress | None = None) -> HitCount:
    """Belady's MIN at ``capacity`` blocks, under the same access model (it always admits)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    sequence = [(block, depth) for r in trace.requests for depth, block in enumerate(r.blocks[:r.whole])]
    never = len(sequence)
    following = [never] * len(sequence)
    seen: dict[int, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        block = sequence[i][0]
        following[i] = seen.get(block, never)
        seen[block] = i
    resident: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block); stale entries skipped on pop
    hits = 0
    i = 0
    for count, request in enumerate(trace.requests, 1):
        blocks = request.blocks[:request.whole]
        run = 0
        while run < len(blocks) and blocks[run] in resident:
            run += 1
        hits += run
        for block in blocks:
            nxt, depth = following[i], sequence[i][1]
            i += 1
            if block not in resident and len(resident) >= capacity:
                while True:
                    neg_next, _, victim = heapq.heappop(heap)
                    if resident.get(victim) == -neg_next:
                        del resident[victim]
                        break
            resident[block] = nxt
            heapq.heappush(heap, (-nxt, -depth, block))
        if progress is not None and count % 1000 == 0:
            progress(1000)
    if progress is not None:
        progress(len(trace.requests) % 1000)
    return HitCount(hits, trace.accesses)


def oracle_admission(trace: Trace, capacity: int, progress: Progress | None = None) -> HitCount:
    """LRU that stores only blocks some later request uses: a reference line (it knows the future) for how
    much an admission policy could add."""
    last: dict[int, int] = {}
    for i, request in enumerate(trace.requests):
        for block in request.blocks[:request.whole]:
            last[block] = i
    return replay(trace, "lru", capacity, progress, admit=lambda block, i: last[block] > i)


def infinite(trace: Trace) -> HitCount:
    """Hits with a cache that never evicts: the bound no capacity or policy exceeds."""
    resident: set[int] = set()
    hits = 0
    for request in trace.requests:
        blocks = request.blocks[:request.whole]
        run = 0
        while run < len(blocks) and blocks[run] in resident:
            run += 1
        hits += run
        resident.update(blocks)
    return HitCount(hits, trace.accesses)


def default_capacities(trace: Trace, points: int = 24) -> list[int]:
    """Log-spaced capacities from one block to the trace's distinct whole blocks."""
    top = max(trace.distinct_blocks, 1)
    grid = np.unique(np.round(np.geomspace(1, top, points)).astype(int))
    return [int(c) for c in grid]


def compare(trace: Trace, capacities: Sequence[int], policies: Sequence[str],
            progress: Progress | None = None) -> dict[str, dict[int, HitCount]]:
    """Hit counts per policy and capacity, with the ``oracle_admit``, ``belady`` and ``infinite`` reference
    lines."""
    out = {name: {c: replay(trace, name, c, progress) for c in capacities} for name in policies}
    out["oracle_admit"] = {c: oracle_admission(trace, c, progress) for c in capacities}
    out["belady"] = {c: belady(trace, c, progress) for c in capacities}
    top = infinite(trace)
    out["infinite"] = dict.fromkeys(capacities, top)
    return out
