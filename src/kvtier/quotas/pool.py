"""The DRAM pool's tenant shares (:class:`~kvtier.dram.DramPool`), in pages: plain data kept under the pool's lock.

An entry counts against the share its namespace had when it was reserved, from its reservation on (a read ahead
and a concurrent put reserve before they commit) until its abort or its removal from the index; it joins its
share's LRU at its commit. An entry being written, read or cascaded (pinned) is in use: never evicted to make
room, so a new entry that only such entries leave no room for is refused (:func:`kvtier.quotas.victims` cannot
cover it). A namespace set to another share keeps its entries counted where they were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvtier.keys import ShardKey
from kvtier.quotas import Share, Usage, victims
from kvtier.recent import RecentMap

_KEPT = 65536  # namespaces whose tenant share the pool remembers (the store sets it again when it meets one anew)


class PoolShares:
    """Which namespaces count against which share (the quota in pages), and per share its pages and entries."""

    def __init__(self, page_bytes: int) -> None:
        self._page_bytes = page_bytes
        self._of: RecentMap[str, Share] = RecentMap(_KEPT)
        self._usage: Usage[ShardKey] = Usage()

    def set(self, namespace: str, share: str | None, quota_bytes: int) -> None:
        if share is None:
            self._of.pop(namespace)
        else:
            self._of[namespace] = Share(share, quota_bytes // self._page_bytes)

    def of(self, namespace: str) -> Share | None:
        return self._of.get(namespace)

    def bytes(self, share: str) -> int:
        return self._usage.units(share) * self._page_bytes

    # -- an entry's events (share None: it counts against none) ------------------------------------------------
    def charge(self, share: str | None, pages: int) -> None:
        """Reserved (``pages`` > 0), or aborted (< 0)."""
        if share is not None:
            self._usage.charge(share, pages)

    def committed(self, share: str | None, key: ShardKey) -> None:
        if share is not None:
            self._usage.add(share, key)

    def touched(self, share: str | None, key: ShardKey) -> None:
        if share is not None:
            self._usage.touch(share, key)

    def removed(self, share: str | None, key: ShardKey, pages: int) -> None:
        """A committed entry left the index."""
        if share is not None:
            self._usage.discard(share, key)
            self._usage.charge(share, -pages)

    def fit(self, share: Share, need: int, pages_of: Callable[[ShardKey], int],
            evictable: Callable[[ShardKey], bool]) -> list[ShardKey] | None:
        """What to evict of ``share``'s own least recently used entries to make room for ``need`` more pages inside
        it (its reservations count); None when the evictable ones are not enough (evict nothing then)."""
        out, over = victims(self._usage.oldest(share.name), self._usage.units(share.name) + need - share.quota,
                            pages_of, evictable)
        return None if over > 0 else out

    def mismatch(self, entries: Iterable[tuple[str | None, int]]) -> bool:
        """Whether the committed ``entries`` (each one's share and pages) disagree with the count (a leak: the
        pool's audit, with no reservation pending)."""
        held: dict[str, int] = {}
        for share, pages in entries:
            if share is not None:
                held[share] = held.get(share, 0) + pages
        return held != self._usage.totals()
