"""The filesystem tier's index: what files the directory holds, in least recently used order, and their bytes.

No I/O and no lock: the tier holds its lock around every call, as it does for the directory walks that feed it.
The creation time, which drives the TTL, is the header's ``created`` (a read never extends it); last use is the
file's mtime, so LRU order survives restarts. Counting each tenant share's files is the index's too
(:class:`kvtier.quotas.index.IndexShares`), so a share's count moves with every file added or dropped.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable

from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas.index import IndexShares


@dataclasses.dataclass(slots=True)
class FileEntry:
    size: int  # the file's path follows from its key, so 100,000 entries hold no strings
    created: float
    last_used: float


@dataclasses.dataclass(frozen=True)
class Evictions:
    """Files to remove to bring the directory down to its low watermark, least recently used first.
    ``reserved``: those inside shares within their quotas (the quotas add up to more than the capacity)."""

    unreserved: list[ShardKey]
    reserved: list[ShardKey]


class FileIndex:
    """Every indexed file by key (least recently used first), the head ranges of each chunk, the bytes they hold,
    and the tenant shares counted over them. ``ttl_seconds``: past it a file is expired."""

    def __init__(self, ttl_seconds: float | None) -> None:
        self.files: OrderedDict[ShardKey, FileEntry] = OrderedDict()  # a real LRU: every read reorders it
        self.used = 0
        self.shares = IndexShares()  # per-tenant quotas (set_share)
        self._by_chunk: dict[tuple[str, str], set[HeadRange]] = {}
        self._ttl = ttl_seconds

    def add(self, key: ShardKey, info: FileEntry) -> None:
        old = self.files.pop(key, None)
        if old is not None:
            self.used -= old.size  # one file per key: a replaced file's bytes are gone from disk too
        self.files[key] = info
        self._by_chunk.setdefault((key.namespace, key.chunk), set()).add(key.heads)
        self.used += info.size
        self.shares.added(key, info.size, old.size if old else 0)

    def drop(self, key: ShardKey) -> FileEntry | None:
        info = self.files.pop(key, None)
        if info is None:
            return None
        self.used -= info.size
        self.shares.dropped(key, info.size)
        heads = self._by_chunk.get((key.namespace, key.chunk))
        if heads is not None:
            heads.discard(key.heads)
            if not heads:
                del self._by_chunk[(key.namespace, key.chunk)]
        return info

    def used_now(self, key: ShardKey, now: float) -> int:
        """Record a read of ``key`` (held): the most recently used now. Its indexed size."""
        info = self.files[key]
        self.files.move_to_end(key)
        self.shares.used(key)
        info.last_used = now
        return info.size

    def heads(self, namespace: str, chunk: str) -> list[HeadRange]:
        return list(self._by_chunk.get((namespace, chunk), ()))

    def expired(self, info: FileEntry, now: float) -> bool:
        return self._ttl is not None and now - info.created > self._ttl

    def expired_keys(self, now: float) -> list[ShardKey]:
        if self._ttl is None:
            return []
        return [k for k, info in self.files.items() if self.expired(info, now)]

    def snapshot(self, namespace: str | None) -> list[tuple[ShardKey, FileEntry]]:
        """Copies of the entries (of ``namespace``, or all), least recently used first."""
        return [(k, dataclasses.replace(v)) for k, v in self.files.items()
                if namespace is None or k.namespace == namespace]

    def replace(self, found: Iterable[tuple[ShardKey, FileEntry]], started: float) -> None:
        """The index a walk of the directory that began at ``started`` found; entries added since it began are
        kept (the walk may have passed their directory first), reads since the last walk too."""
        found = list(found)
        for key, info in found:
            known = self.files.get(key)
            if known is not None:
                info.last_used = max(info.last_used, known.last_used)  # reads since the last walk
        fresh = [(k, v) for k, v in self.files.items() if v.last_used >= started]
        self.files.clear()
        self._by_chunk.clear()
        self.used = 0
        self.shares.reset()
        for key, info in sorted(found + fresh, key=lambda kf: kf[1].last_used):
            self.add(key, info)

    def size_of(self, key: ShardKey) -> int:
        return self.files[key].size

    def used_at(self, key: ShardKey) -> float:
        return self.files[key].last_used

    def evictions(self, target: float, excess: dict[str, int]) -> Evictions:
        """Which files to remove to bring the bytes down to ``target``, least recently used first. A quota is a
        reservation: files in no share, and shares' files past their quota (``excess``: bytes past it, by share
        id), go first; a share within its quota loses files only when those are not enough."""
        used = self.used
        unreserved: list[ShardKey] = []
        for key, info in self.files.items():
            if used <= target:
                return Evictions(unreserved, [])
            found = self.shares.share_of(key.namespace)
            if found is not None:
                if excess.get(found[0], 0) <= 0:
                    continue
                excess[found[0]] -= info.size
            unreserved.append(key)
            used -= info.size
        chosen = set(unreserved)
        reserved: list[ShardKey] = []
        for key, info in self.files.items():
            if used <= target:
                break
            if key not in chosen:
                reserved.append(key)
                used -= info.size
        return Evictions(unreserved, reserved)
