"""Per-tenant shares inside one tier's own index (a local disk: the filesystem tier): which namespaces
count against which share, the bytes each namespace holds, and each share's objects least recently used first.
Plain data, kept under the tier's lock; the tier asks :meth:`IndexShares.refuses` before a write and
:meth:`IndexShares.victims` after it, and removes what those name. Shares are named here as the tier keeps them
(:func:`kvtier.quotas.share_id`); how the processes sharing the directory agree on them is
:mod:`kvtier.quotas.ledger`.

A namespace counts against its share with every object it holds, whenever it joined (its share's order is
rebuilt from the index's). Objects used in the last :data:`kvtier.quotas.RECENT_SECONDS` are in use
(:mod:`kvtier.quotas`): never evicted to make room; when only such objects are left, a new one is refused."""

from __future__ import annotations

import builtins
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from kvtier.keys import ShardKey
from kvtier.quotas import Share, Usage, refuses, victims

_KEPT = 65536  # namespaces learned from other processes whose share is remembered (those the store set are kept)


class IndexShares:
    def __init__(self) -> None:
        self._ns_bytes: dict[str, int] = {}
        self._share_of: dict[str, Share] = {}  # namespace -> its share (quota in bytes)
        # Namespaces learned from other processes, least recent first: only these are forgotten past _KEPT, as the
        # store tells a tier each of its own namespaces' shares once (a flood of learned ones must not drop them).
        # Not a RecentMap: past the bound, only those holding no objects go (see set_many).
        self._learned: OrderedDict[str, None] = OrderedDict()
        self._usage: Usage[ShardKey] = Usage()  # per share: the bytes its namespaces hold, its objects
        self._members: dict[str, set[str]] = {}  # share -> its namespaces

    # -- the index's events ------------------------------------------------------------------------------------
    def added(self, key: ShardKey, size: int, replaced: int = 0) -> None:
        self._ns_bytes[key.namespace] = self._ns_bytes.get(key.namespace, 0) + size - replaced
        share = self._share_of.get(key.namespace)
        if share is not None:
            self._usage.charge(share.name, size - replaced)
            self._usage.add(share.name, key)

    def dropped(self, key: ShardKey, size: int) -> None:
        left = self._ns_bytes[key.namespace] - size
        if left:
            self._ns_bytes[key.namespace] = left
        else:
            del self._ns_bytes[key.namespace]
        share = self._share_of.get(key.namespace)
        if share is not None:
            self._usage.charge(share.name, -size)
            self._usage.discard(share.name, key)

    def used(self, key: ShardKey) -> None:
        share = self._share_of.get(key.namespace)
        if share is not None:
            self._usage.touch(share.name, key)

    def reset(self) -> None:
        """The index is being rebuilt (a rescan): every object is :meth:`added` again, least recent first."""
        self._ns_bytes.clear()
        self._usage.clear()

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
                self._share_of[namespace] = Share(share, quota_bytes)
                self._members.setdefault(share, set()).add(namespace)
                self._usage.charge(share, self._ns_bytes.get(namespace, 0))
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
            members = self._members.get(share)
            if members:
                self._usage.replace(share, (k for k in order if k.namespace in members))
            else:
                self._members.pop(share, None)
                self._usage.drop(share)

    def _leave(self, namespace: str, touched: builtins.set[str]) -> None:  # (`set`: the method)
        self._learned.pop(namespace, None)
        old = self._share_of.pop(namespace, None)
        if old is not None:
            self._members[old.name].discard(namespace)
            self._usage.charge(old.name, -self._ns_bytes.get(namespace, 0))
            touched.add(old.name)

    def bytes(self, share: str) -> int:
        return self._usage.units(share)

    def with_files(self, namespaces: Iterable[str]) -> builtins.set[str]:
        """Those of ``namespaces`` that hold objects in the index."""
        return {ns for ns in namespaces if self._ns_bytes.get(ns)}

    def share_of(self, namespace: str) -> Share | None:
        """``namespace``'s share and its quota in bytes (None: it counts against none)."""
        return self._share_of.get(namespace)

    def keys(self, share: str) -> list[ShardKey]:
        """The share's objects, least recently used first."""
        return list(self._usage.oldest(share))

    def excess(self) -> dict[str, int]:
        """Each share's bytes past its quota (0 or less: within it)."""
        quotas = dict(self._share_of.values())
        return {share: self.bytes(share) - quota for share, quota in quotas.items()}

    def refuses(self, key: ShardKey, size: int, size_of: Callable[[ShardKey], int],
                used_at: Callable[[ShardKey], float], since: float) -> bool:
        """Whether a new object ``key`` of ``size`` bytes must not be written: its share would stay over its quota
        with every object not used since ``since`` evicted."""
        share = self._share_of.get(key.namespace)
        if share is None or self._usage.holds(share.name, key):
            return False  # (written again: it counts already)
        if self.bytes(share.name) + size <= share.quota:
            return False  # it fits without evicting anything
        # every entry, not the recent end only: a rescan adds another process's files there with their old times
        in_use = (size_of(k) for k in self._usage.oldest(share.name) if used_at(k) >= since)
        return refuses(size, share.quota, in_use)

    def victims(self, namespace: str, size_of: Callable[[ShardKey], int], used_at: Callable[[ShardKey], float],
                since: float, incoming: ShardKey | None = None, size: int = 0) -> list[ShardKey]:
        """What to evict, least recently used first, to bring ``namespace``'s share back under its quota (with
        ``incoming``, an object of ``size`` bytes about to be written, counted): never an object used since
        ``since``, nor ``incoming`` itself."""
        share = self._share_of.get(namespace)
        if share is None:
            return []
        over = self.bytes(share.name) - share.quota
        if incoming is not None:
            over += size - (size_of(incoming) if self._usage.holds(share.name, incoming) else 0)
        # (a rescan's entries are out of order: every one is looked at)
        return victims(self._usage.oldest(share.name), over, size_of,
                       lambda k: k != incoming and used_at(k) < since)[0]
