"""A size-bounded map of the most recently set keys: what a process remembers of an unbounded stream (namespaces,
tenants, shards) without growing with it.

Not locked: each owner holds its own lock around it, as it does for the state the map sits beside.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


class RecentMap(Generic[K, V]):
    """At most ``limit`` entries; setting a key (or :meth:`touch`) makes it the newest, and past the limit the
    oldest go, each handed to ``on_drop`` when given."""

    def __init__(self, limit: int, on_drop: Callable[[K, V], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self._on_drop = on_drop
        self._items: OrderedDict[K, V] = OrderedDict()

    def __setitem__(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.limit:
            dropped = self._items.popitem(last=False)
            if self._on_drop is not None:
                self._on_drop(*dropped)

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...
    def get(self, key: K, default: object = None) -> object:
        return self._items.get(key, default)

    def touch(self, key: K) -> bool:
        """Make ``key`` the newest, if held; whether it was."""
        if key not in self._items:
            return False
        self._items.move_to_end(key)
        return True

    @overload
    def pop(self, key: K) -> V | None: ...
    @overload
    def pop(self, key: K, default: D) -> V | D: ...
    def pop(self, key: K, default: object = None) -> object:
        return self._items.pop(key, default)

    def __delitem__(self, key: K) -> None:
        del self._items[key]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[K]:
        """Oldest first."""
        return iter(self._items)

    def items(self) -> list[tuple[K, V]]:
        """A snapshot, oldest first."""
        return list(self._items.items())

    def values(self) -> list[V]:
        return list(self._items.values())

    def clear(self) -> None:
        self._items.clear()
