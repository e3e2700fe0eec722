"""Per-tenant shares (quotas) inside one tier's own index: which namespaces count against which share, the bytes
each namespace holds, and each share's objects least recently used first. Plain data, kept under the tier's lock;
the tier asks :meth:`Shares.refuses` before a write and :meth:`Shares.victims` after it, and removes what those
name.

Objects used in the last :data:`RECENT_SECONDS` are never evicted to make room: a prompt's own chunks are put
(and read) together, first chunk first, so evicting the least recently used of them would cut the prompt's
prefix and leave its later chunks unreachable. When only such objects are left, a new one is refused instead,
so a prompt larger than its share keeps its leading chunks."""

from __future__ import annotations

import builtins
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from kvtier.keys import ShardKey

_KEPT = 65536  # namespaces learned from other processes whose share is remembered (those the store set are kept)
RECENT_SECONDS = 10.0  # objects used this recently are never evicted to make room (see above)


def share_id(share: str) -> str:
    """The name a share has where a tier keeps it (a server, a bucket, a directory): a digest of the store's."""
    return hashlib.sha256(b"kvtier share/" + share.encode()).hexdigest()[:32]


class Shares:
    def __init__(self) -> None:
        self._ns_bytes: dict[str, int] = {}
        self._share_of: dict[str, tuple[str, int]] = {}  # namespace -> (share, quota in bytes)
        # Namespaces learned from other processes, least recent first: only these are forgotten past _KEPT, as the
        # store tells a tier each of its own namespaces' shares once (a flood of learned ones must not drop them).
        self._learned: OrderedDict[str, None] = OrderedDict()
        self._bytes: dict[str, int] = {}  # share -> the bytes its namespaces hold (kept, not summed per call)
        self._members: dict[str, set[str]] = {}  # share -> its namespaces
        self._lru: dict[str, OrderedDict[ShardKey, None]] = {}  # share -> its objects, least recently used first

    # -- the index's events ------------------------------------------------------------------------------------
    def added(self, key: ShardKey, size: int, replaced: int = 0) -> None:
        self._ns_bytes[key.namespace] = self._ns_bytes.get(key.namespace, 0) + size - replaced
        share = self._share_of.get(key.namespace)
        if share is not None:
            self._bytes[share[0]] += size - replaced
            lru = self._lru[share[0]]
            lru[key] = None
            lru.move_to_end(key)

    def dropped(self, key: ShardKey, size: int) -> None:
        left = self._ns_bytes[key.namespace] - size
        if left:
            self._ns_bytes[key.namespace] = left
        else:
            del self._ns_bytes[key.namespace]
        share = self._share_of.get(key.namespace)
        if share is not None:
            self._bytes[share[0]] -= size
            self._lru[share[0]].pop(key, None)

    def used(self, key: ShardKey) -> None:
        share = self._share_of.get(key.namespace)
        if share is not None:
            self._lru[share[0]].move_to_end(key)

    def reset(self) -> None:
        """The index is being rebuilt (a rescan): every object is :meth:`added` again, least recent first."""
        self._ns_bytes.clear()
        for lru in self._lru.values():
            lru.clear()
        self._bytes = dict.fromkeys(self._bytes, 0)

    # -- shares ------------------------------------------------------------------------------------------------
    def set(self, namespace: str, share: str | None, quota_bytes: int, keys: Iterable[ShardKey]) -> None:
        """Count ``namespace`` against ``share`` (None: none); ``keys`` are the index's, least recent first."""
        self.set_many({namespace: (share, quota_bytes)}, keys)

    def set_many(self, shares: Mapping[str, tuple[str | None, int]], keys: Iterable[ShardKey], *,
                 learned: bool = False) -> None:
        """:meth:`set` for each namespace of ``shares`` (namespace -> share and quota), with one walk of ``keys``;
        ``learned``: from other processes (bounded: the least recently learned are forgotten past ``_KEPT``)."""
        order = list(keys)
        touched: set[str] = set()
        for namespace, (share, quota_bytes) in shares.items():
            self._leave(namespace, touched)
            if share is not None:
                self._share_of[namespace] = (share, quota_bytes)
                self._members.setdefault(share, set()).add(namespace)
                self._bytes[share] = self._bytes.get(share, 0) + self._ns_bytes.get(namespace, 0)
                touched.add(share)
                if learned:
                    self._learned[namespace] = None
        # Never one holding objects: its share would stop counting them (the index bounds how many those are).
        if len(self._learned) > _KEPT:
            for namespace in [ns for ns in self._learned if not self._ns_bytes.get(ns)]:
                if len(self._learned) <= _KEPT:
                    break
                self._leave(namespace, touched)
        for share in touched:
            if self._members.get(share):
                self._lru[share] = self._ordered(share, order)
            else:
                self._members.pop(share, None)
                self._lru.pop(share, None)
                self._bytes.pop(share, None)

    def _leave(self, namespace: str, touched: builtins.set[str]) -> None:  # (`set`: the method)
        self._learned.pop(namespace, None)
        old = self._share_of.pop(namespace, None)
        if old is not None:
            self._members[old[0]].discard(namespace)
            self._bytes[old[0]] -= self._ns_bytes.get(namespace, 0)
            touched.add(old[0])

    def _ordered(self, share: str, order: list[ShardKey]) -> OrderedDict[ShardKey, None]:
        members = self._members.get(share, set())
        return OrderedDict((k, None) for k in order if k.namespace in members)

    def bytes(self, share: str) -> int:
        return self._bytes.get(share, 0)

    def with_files(self, namespaces: Iterable[str]) -> builtins.set[str]:
        """Those of ``namespaces`` that hold objects in the index."""
        return {ns for ns in namespaces if self._ns_bytes.get(ns)}

    def share_of(self, namespace: str) -> tuple[str, int] | None:
        """``namespace``'s share and its quota in bytes (None: it counts against none)."""
        return self._share_of.get(namespace)

    def keys(self, share: str) -> list[ShardKey]:
        """The share's objects, least recently used first."""
        return list(self._lru.get(share, ()))

    def excess(self) -> dict[str, int]:
        """Each share's bytes past its quota (0 or less: within it)."""
        quotas = dict(self._share_of.values())
        return {share: self.bytes(share) - quota for share, quota in quotas.items()}

    def refuses(self, key: ShardKey, size: int, size_of: Callable[[ShardKey], int],
                used_at: Callable[[ShardKey], float], since: float) -> bool:
        """Whether a new object ``key`` of ``size`` bytes must not be written: its share would stay over its quota
        with every object not used since ``since`` evicted."""
        found = self._share_of.get(key.namespace)
        if found is None:
            return False
        share, quota = found
        lru = self._lru[share]
        if key in lru:
            return False  # written again: it counts already
        if self.bytes(share) + size <= quota:
            return False  # it fits without evicting anything
        # every entry, not the recent end only: a rescan adds another process's files there with their old times
        recent = size
        for other in lru:
            if used_at(other) >= since:
                recent += size_of(other)
                if recent > quota:
                    return True
        return False

    def victims(self, namespace: str, size_of: Callable[[ShardKey], int], used_at: Callable[[ShardKey], float],
                since: float, incoming: ShardKey | None = None, size: int = 0) -> list[ShardKey]:
        """What to evict, least recently used first, to bring ``namespace``'s share back under its quota (with
        ``incoming``, an object of ``size`` bytes about to be written, counted): never an object used since
        ``since``, nor ``incoming`` itself."""
        found = self._share_of.get(namespace)
        if found is None:
            return []
        share, quota = found
        lru = self._lru[share]
        over = self.bytes(share) - quota
        if incoming is not None:
            over += size - (size_of(incoming) if incoming in lru else 0)
        out = []
        for key in lru:
            if over <= 0:
                break
            # (a rescan's entries are out of order: every one is looked at)
            if key != incoming and used_at(key) < since:
                out.append(key)
                over -= size_of(key)
        return out
