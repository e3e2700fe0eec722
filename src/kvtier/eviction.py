"""Eviction policies for the DRAM tier, chosen by name (``dram.eviction``).

A policy only orders keys; it never touches bytes. The pool asks it for a victim and passes a predicate that
says which keys may go now (nothing being read or written may).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable

from kvtier.registry import Registry


class EvictionPolicy(ABC):
    """Orders resident entries for eviction."""

    @abstractmethod
    def insert(self, key: Hashable, chunk: Hashable, parent: Hashable | None) -> None:
        """A new entry of chunk ``chunk`` (whose prefix parent is ``parent``) became resident."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """The entry was used."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """The entry is gone."""

    @abstractmethod
    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        """The entry to evict next among those ``evictable`` accepts, or None."""


POLICIES: Registry[EvictionPolicy] = Registry("eviction policy", EvictionPolicy)


@POLICIES.register("lru")
class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable, chunk: Hashable, parent: Hashable | None) -> None:
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        return next((k for k in self._order if evictable(k)), None)


@POLICIES.register("prefix_lru")
class PrefixLRUPolicy(LRUPolicy):
    """LRU among leaves: a chunk goes only after every resident chunk that extends its prefix.

    A prefix is useless without its head, so dropping the tail first keeps the longest usable prefixes. When
    every leaf is busy (being read or written), it falls back to plain LRU rather than fail the caller.

    O(log n) per operation: leaves wait in a heap by last use; an entry is checked when it comes to the top
    (still resident, not used since, still a leaf) and dropped if stale.
    """

    def __init__(self) -> None:
        super().__init__()
        self._chunk_of: dict[Hashable, tuple[Hashable, Hashable | None]] = {}
        self._keys: dict[Hashable, set[Hashable]] = {}  # chunk -> its resident keys (one per head range)
        self._children: Counter[Hashable] = Counter()  # chunk -> resident keys whose parent it is
        self._stamp: dict[Hashable, int] = {}
        self._clock = itertools.count()
        self._leaves: list[tuple[int, int, Hashable]] = []  # (last use, tie-break, key)

    def _push(self, key: Hashable) -> None:
        if self._children.get(self._chunk_of[key][0], 0) == 0:
            heapq.heappush(self._leaves, (self._stamp[key], next(self._clock), key))
            if len(self._leaves) > 2 * len(self._stamp) + 64:  # mostly stale: rebuild (amortized O(1))
                self._leaves = [entry for entry in self._leaves if self._current(entry)]
                heapq.heapify(self._leaves)

    def _current(self, entry: tuple[int, int, Hashable]) -> bool:
        """Whether a heap entry still stands for a resident leaf not used since it was pushed."""
        stamp, _, key = entry
        return self._stamp.get(key) == stamp and not self._children.get(self._chunk_of[key][0], 0)

    def insert(self, key: Hashable, chunk: Hashable, parent: Hashable | None) -> None:
        super().insert(key, chunk, parent)
        self._chunk_of[key] = (chunk, parent)
        self._keys.setdefault(chunk, set()).add(key)
        if parent is not None:
            self._children[parent] += 1
        self._stamp[key] = next(self._clock)
        self._push(key)

    def touch(self, key: Hashable) -> None:
        super().touch(key)
        if key in self._stamp:
            self._stamp[key] = next(self._clock)
            self._push(key)

    def remove(self, key: Hashable) -> None:
        super().remove(key)
        self._stamp.pop(key, None)
        chunk_parent = self._chunk_of.pop(key, None)
        if chunk_parent is None:
            return
        chunk, parent = chunk_parent
        keys = self._keys[chunk]
        keys.discard(key)
        if not keys:
            del self._keys[chunk]
        if parent is not None:
            self._children[parent] -= 1
            if self._children[parent] <= 0:
                del self._children[parent]
                for now_leaf in self._keys.get(parent, ()):
                    self._push(now_leaf)

    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        busy: list[tuple[int, int, Hashable]] = []
        found = None
        while self._leaves:
            entry = heapq.heappop(self._leaves)
            if not self._current(entry):
                continue  # stale: gone, used since (pushed again then), or no longer a leaf
            key = entry[2]
            if evictable(key):
                found = key
                busy.append(entry)  # stays a candidate until the caller removes it
                break
            busy.append(entry)
        for entry in busy:
            heapq.heappush(self._leaves, entry)
        return found if found is not None else super().victim(evictable)
