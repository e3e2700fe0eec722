"""Per-tenant shares (quotas): one mechanism, which the DRAM pool and every tier that keeps quotas use.

A placement rule with a ``quota`` is one tenant *share*, however many salts it matches. The store tells the pool
and each tier its quota names which share a namespace counts against, and asks what a share holds: the two calls
of :class:`ShareKeeper`. Where a share is counted depends on who sees every write:

- :mod:`kvtier.quotas.pool`: the DRAM pool's, in pages, under the pool's lock (one process).
- :mod:`kvtier.quotas.index`: a tier with an index of its own (a local disk), with
  :mod:`kvtier.quotas.ledger`: how the processes sharing one directory count a share together.
- :mod:`kvtier.quotas.redis`: counted in the Redis server itself, over every engine's writes.
- :mod:`kvtier.quotas.listed`: each engine's view of a store it lists (S3's bucket, Mooncake's key list).

Each follows one order: a write is counted before it lands (so a concurrent write sees it), then either lands
(and the share's victims are removed) or is rolled back; a read moves its object to the share's recent end; a
delete takes it out of its share. And one rule, decided here without I/O: a new object that the share's objects
*in use* leave no room for is refused, evicting nothing (:func:`refuses`); otherwise, while the share is past
its quota, its own least recently used objects not in use go (:func:`victims`): an isolated LRU, a tenant past
its share never evicts another's. In use: in DRAM, pinned (being written, read or cascaded); in a tier, used in
the last :data:`RECENT_SECONDS`, because a prompt's own chunks are put (and read) together, first chunk first,
and evicting its first ones would leave its later ones unreachable: a prompt larger than its share keeps its
leading chunks.

The conformance suite every implementation passes is :mod:`kvtier.testing.quotas`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

K = TypeVar("K")

RECENT_SECONDS = 10.0  # a tier's objects used this recently are in use: never evicted to make room (see above)


def share_id(share: str) -> str:
    """The name a share has where a tier keeps it (a server, a bucket, a directory): a digest of the store's, which
    holds the tenant's salt (a salt is never written to a tier; the share does group a tenant's namespaces)."""
    return hashlib.sha256(b"kvtier share/" + share.encode()).hexdigest()[:32]


class Share(NamedTuple):
    """The share a namespace counts against: its name (the store's, or :func:`share_id` of it where a tier keeps
    it) and its quota, in the accounting's unit (bytes; pages in DRAM)."""

    name: str
    quota: int


@runtime_checkable
class ShareKeeper(Protocol):
    """What keeps per-tenant quotas: the DRAM pool, and every tier whose ``shares`` flag is set."""

    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        """Count ``namespace``'s objects against the share ``share`` of ``quota_bytes`` (None: against none)."""

    def share_bytes(self, share: str) -> int:
        """The bytes counted against ``share`` (0 for a share this keeper counts nothing against)."""


def refuses(size: int, quota: int, in_use: Iterable[int]) -> bool:
    """Whether a new object of ``size`` must not be written into a share of ``quota``: with the sizes of the
    share's objects in use (read only as far as needed), it would not fit."""
    busy = size
    for n in in_use:
        busy += n
        if busy > quota:
            return True
    return busy > quota


def victims(oldest_first: Iterable[K], over: int, size_of: Callable[[K], int],
            evictable: Callable[[K], bool]) -> tuple[list[K], int]:
    """What to evict from a share ``over`` units past its quota: its evictable objects, least recently used first,
    until it is within it (read only as far as needed). Also what is then still over (0 or less: within)."""
    out: list[K] = []
    for key in oldest_first:
        if over <= 0:
            break
        if evictable(key):
            out.append(key)
            over -= size_of(key)
    return out, over


class Usage(Generic[K]):
    """Per share: the units counted against it and its objects, least recently used first. Plain data, kept under
    its owner's lock. A share counting nothing and holding nothing takes no room."""

    def __init__(self) -> None:
        self._units: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[K, None]] = {}

    def units(self, share: str) -> int:
        return self._units.get(share, 0)

    def totals(self) -> dict[str, int]:
        """Every share's units (none at 0)."""
        return dict(self._units)

    def charge(self, share: str, units: int) -> None:
        """Count ``units`` more (fewer, when negative) against ``share``."""
        left = self._units.get(share, 0) + units
        if left:
            self._units[share] = left
        else:
            self._units.pop(share, None)

    def add(self, share: str, key: K) -> None:
        """``key`` is (again) the share's most recently used object."""
        lru = self._lru.setdefault(share, OrderedDict())
        lru[key] = None
        lru.move_to_end(key)

    def touch(self, share: str, key: K) -> None:
        """A read of ``key``, one of the share's objects: now its most recently used."""
        self._lru[share].move_to_end(key)

    def discard(self, share: str, key: K) -> None:
        lru = self._lru.get(share)
        if lru is not None:
            lru.pop(key, None)
            if not lru:
                del self._lru[share]

    def holds(self, share: str, key: K) -> bool:
        return key in self._lru.get(share, ())

    def oldest(self, share: str) -> Iterator[K]:
        """The share's objects, least recently used first."""
        return iter(self._lru.get(share, ()))

    def replace(self, share: str, keys: Iterable[K]) -> None:
        """The share's objects are ``keys``, least recently used first."""
        self._lru.pop(share, None)
        for key in keys:
            self.add(share, key)

    def drop(self, share: str) -> None:
        """Forget ``share``: its count and its objects."""
        self._units.pop(share, None)
        self._lru.pop(share, None)

    def clear(self) -> None:
        """Forget every object and count (an index being rebuilt)."""
        self._units.clear()
        self._lru.clear()
