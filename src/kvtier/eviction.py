"""Eviction policies for the DRAM tier, chosen by name (``dram.eviction``).

A policy only orders keys; it never touches bytes. The pool asks it for a victim and passes a predicate that
says which keys may go now (nothing being read or written may).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable

from kvtier.registry import Registry


class EvictionPolicy(ABC):
    """Orders resident entries for eviction."""

    @abstractmethod
    def insert(self, key: Hashable, chunk: str, parent: str | None) -> None:
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

    def insert(self, key: Hashable, chunk: str, parent: str | None) -> None:
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
    """

    def __init__(self) -> None:
        super().__init__()
        self._chunk_of: dict[Hashable, tuple[str, str | None]] = {}
        self._children: Counter[str] = Counter()

    def insert(self, key: Hashable, chunk: str, parent: str | None) -> None:
        super().insert(key, chunk, parent)
        self._chunk_of[key] = (chunk, parent)
        if parent is not None:
            self._children[parent] += 1

    def remove(self, key: Hashable) -> None:
        super().remove(key)
        chunk_parent = self._chunk_of.pop(key, None)
        if chunk_parent is not None and chunk_parent[1] is not None:
            parent = chunk_parent[1]
            self._children[parent] -= 1
            if self._children[parent] <= 0:
                del self._children[parent]

    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        for key in self._order:
            if self._children.get(self._chunk_of[key][0], 0) == 0 and evictable(key):
                return key
        return super().victim(evictable)
