"""The filesystem tier: one file per shard under a root directory, crash-safe and re-indexed on start.

The parts: where files lie and which are trusted (:mod:`.layout`), how one is written whole or not at all
(:mod:`.writes`) and read (:mod:`.reads`), what the directory holds (:mod:`.index`) and how it is found on disk
(:mod:`.walk`). This module ties them to the tier interface, and decides what to evict.

Capacity and TTL hold for the directory: with either set, a put walks the directory again every
``rescan_seconds`` (on the cascade worker's thread), so what other processes wrote counts and may be evicted too.

Tenant shares (``set_share``) are the directory's: each has a ledger in ``ROOT/.shares``
(:mod:`kvtier.quotas.ledger`) naming its namespaces and quota, and a put into a share checks the quota,
evicts the share's least recently used files and renames its own into place under the ledger's lock, after
counting the share from the directory again if another process changed it (only the chunk directories whose
mtime changed since this process last listed them: :class:`.walk.ListedDirs`). So processes and writer threads
on one directory hold a share to its quota together. A quota is also a reservation against ``capacity_bytes``:
capacity eviction takes files in no share, and shares' files past their quota, before any file of a share within
its quota (those go only when the quotas add up to more than the capacity, counted as ``reserved_evictions``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from kvtier import frame, quotas
from kvtier.errors import QuotaFull, TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas import share_id
from kvtier.quotas.ledger import Hold, Ledger, Ledgers
from kvtier.tiers.base import TIERS, Buffer, StoredObject, Tier
from kvtier.tiers.filesystem import reads, walk, writes
from kvtier.tiers.filesystem.index import FileEntry, FileIndex
from kvtier.tiers.filesystem.layout import MAX_OBJECT_BYTES, SHARES_DIR, Layout, header_created, raised_as_tier_error, \
    reason, unlink_quietly
from kvtier.tiers.filesystem.options import FilesystemOptions

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@TIERS.register("filesystem")
class FilesystemTier(Tier):
    """Shards as files on a local filesystem (NVMe, or any POSIX filesystem with atomic rename)."""

    Options = FilesystemOptions
    persistent = True
    local = True
    ranged_reads = True
    # A get's shards read and verified ahead on reading threads while the caller copies (a 32-chunk get from the
    # page cache, 189 MB: 69 -> 55 ms); a load by layers reads them a layer at a time instead (ranged_reads).
    read_ahead = True
    shares = True

    def __init__(self, name: str, options: FilesystemOptions) -> None:
        super().__init__(name, options)
        self.root = Path(os.path.realpath(os.path.expanduser(options.path)))
        self._lock = threading.Lock()
        self._index = FileIndex(options.ttl_seconds)  # under self._lock
        self._disk = Layout(name, self.root, min(MAX_OBJECT_BYTES, options.capacity_bytes or MAX_OBJECT_BYTES))
        self._fsync = options.durability == "fsync"
        self.evictions = 0
        self.share_evictions = 0  # of those, inside a tenant's share
        self.share_refused = 0  # writes refused: the tenant's share held only recent files
        self.reserved_evictions = 0  # capacity evictions inside a share within its quota (quotas past capacity)
        self.expired = 0
        self._ledgers: Ledgers | None = None
        self._listed = walk.ListedDirs()  # chunk directories of shares, as last listed
        self._next_rescan = time.monotonic() + (options.rescan_seconds or 0.0)
        try:
            self._disk.open()
            self._ledgers = Ledgers(self._disk.shares_fd, self._disk.uid, f"{self.root}/{SHARES_DIR}")
            self.removed_temp_files = writes.clean_temp(self._disk)
            self._reindex()
            with self._lock:
                self._learn_shares_locked()
                self._expire_locked(time.time())
                self._enforce_capacity_locked()
        except BaseException as exc:
            self.close()
            if isinstance(exc, OSError):
                raise TierError(f"{name}: cannot use directory {self.root}: {reason(exc)}") from exc
            raise

    def close(self) -> None:
        if self._ledgers is not None:
            self._ledgers.close()
        self._disk.close()

    # -- writes ------------------------------------------------------------------------------------------------
    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        views = [writes.bytes_view(p) for p in parts]
        size, now = sum(len(v) for v in views), time.time()
        with self._lock:
            found = self._index.shares.share_of(key.namespace)
            self._refuse_if_full_locked(key, size, now)  # spares the write; the check that counts is at the commit
        assert self._ledgers is not None
        ledger = None if found is None else self._ledgers.of(found[0])
        created = header_created(views[0][:frame.MAX_HEADER_LEN], now) if views else None
        fd, tmp = -1, None
        try:
            fd, tmp = self._create_temp()
            writes.write_all(fd, views, fsync=self._fsync)
            if ledger is None:
                self._rename_into_place(tmp, key)
                tmp = None
                with self._lock:
                    self._index.add(key, FileEntry(size, now if created is None else created, now))
            else:
                with ledger.held() as hold:
                    self._commit_into_share(key, tmp, size, created, ledger, hold)
                    tmp = None
        except BaseException as exc:
            if tmp is not None:
                unlink_quietly(tmp, self._disk.tmp_fd)
            if isinstance(exc, OSError):
                raise TierError(f"{self.name}: cannot write {key.name}: {reason(exc)}") from exc
            raise
        finally:
            if fd >= 0:
                os.close(fd)  # releases the writer's lock, after the rename
        self._rescan_if_due()
        with self._lock:
            self._expire_locked(now)
            self._enforce_capacity_locked()

    def _create_temp(self) -> tuple[int, str]:
        return writes.create_temp(self._disk)

    def _rename_into_place(self, tmp: str, key: ShardKey) -> None:
        writes.rename_into_place(self._disk, tmp, key, fsync=self._fsync)

    def _commit_into_share(self, key: ShardKey, tmp: str, size: int, created: float | None, ledger: Ledger,
                           hold: Hold) -> None:
        """Holding the share's ledger (no other put of the share, in any process, between check and rename): count
        the share from the directory if another process changed it, then refuse the file, or evict the share's
        least recently used files to make room for it and rename it into place."""
        if hold.stale:
            self._recount_share(ledger)
            hold.stale = False
        shares = self._index.shares
        with self._lock:
            found = shares.share_of(key.namespace)
        # The namespace's first put into the share (or the first since a purge or a compaction took it out).
        if found is not None and not ledger.joined(hold, key.namespace, found[1], self._with_files):
            with self._lock:
                self.share_refused += 1
            raise QuotaFull(f"{self.name}: not writing {key.name}: its tenant's share names as many namespaces "
                            "holding files as its ledger can hold")
        now = time.time()
        with self._lock:
            self._refuse_if_full_locked(key, size, now)
            victims = shares.victims(key.namespace, self._index.size_of, self._index.used_at,
                                     now - quotas.RECENT_SECONDS, key, size)
            ledger.changing(hold)  # before the evictions and the rename: a kill between them still tells the others
            for victim in victims:
                self._remove_locked(victim)
                self.evictions += 1
                self.share_evictions += 1
        self._rename_into_place(tmp, key)
        with self._lock:
            self._index.add(key, FileEntry(size, now if created is None else created, now))

    def _with_files(self, namespaces: frozenset[str]) -> set[str]:
        with self._lock:
            return self._index.shares.with_files(namespaces)

    def _refuse_if_full_locked(self, key: ShardKey, size: int, now: float) -> None:
        if self._index.shares.refuses(key, size, self._index.size_of, self._index.used_at,
                                      now - quotas.RECENT_SECONDS):
            self.share_refused += 1
            raise QuotaFull(f"{self.name}: not writing {key.name}: its tenant's share is full of files used "
                            f"in the last {quotas.RECENT_SECONDS:g} s")

    # -- reads -------------------------------------------------------------------------------------------------
    def get(self, key: ShardKey) -> Buffer | None:
        return self._get(key, reads.whole)

    def head(self, key: ShardKey, nbytes: int) -> bytes | None:
        """Not a use: a look at the headers (``kvtier cache ls --codecs``) leaves the LRU order as it was."""
        return self._get(key, reads.head(nbytes), use=False)

    def get_into(self, key: ShardKey, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
        """One ``readv`` into a small header buffer and the caller's payload buffers (e.g. DRAM pages): no read
        buffer, no copy after it."""
        return self._get(key, reads.into(self.name, key, header_len, payload))

    def open_ranges(self, key: ShardKey, header_len: int, payload_len: int) -> reads.FileRanges | None:
        """The shard's file kept open (a descriptor of its own, the header read) for reads of its payload in
        pieces: a load that copies each layer as it is read (its use is recorded now, as a read's is)."""
        return self._get(key, reads.ranges(self.name, key, header_len, payload_len))

    def _get(self, key: ShardKey, read: reads.Reader[_T], use: bool = True) -> _T | None:
        """``read(fd, its status, the size indexed)`` on the key's file, or None when it is not there (dropped
        from the index) or not a file we read (removed); recorded as a use of it unless ``use`` is false."""
        now = time.time()
        with self._lock:
            if self._live_locked(key, now) is None:
                return None
            indexed = self._index.used_now(key, now) if use else self._index.size_of(key)
        try:
            data = reads.read_shard(self._disk, key, indexed, read, use)
        except OSError as exc:
            raise TierError(f"{self.name}: cannot read {key.name}: {reason(exc)}") from exc
        if data is None:
            with self._lock:
                self._index.drop(key)
        return data

    def exists(self, key: ShardKey) -> bool:
        """Whether the index holds ``key`` unexpired (no disk access but to remove an expired file, as ``get``
        does: the cascade asks before every write)."""
        with self._lock:
            return self._live_locked(key, time.time()) is not None

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        with self._lock:
            found = [self._index.heads(namespace, c) for c in chunks]
        # Another process (a vLLM worker, a second engine on this host) may have written chunks since this
        # tier indexed the directory: look on disk for the first chunk the index lacks. A prefix ends at its
        # first missing chunk, so one directory listing per lookup is enough.
        for i, chunk in enumerate(chunks):
            if not found[i]:
                found[i] = walk.scan_chunk(self._disk, namespace, chunk, self._knows, self._index_if_new)
                if not found[i]:
                    break
        if self.options.ttl_seconds is not None:
            now = time.time()
            with self._lock:
                files = self._index.files
                found = [[h for h in heads if (info := files.get(ShardKey(namespace, c, h))) is not None
                          and not self._index.expired(info, now)] for c, heads in zip(chunks, found)]
        return found

    def _knows(self, key: ShardKey) -> bool:
        with self._lock:
            return key in self._index.files

    def _index_if_new(self, key: ShardKey, info: FileEntry) -> None:
        with self._lock:
            if key not in self._index.files:  # another thread may have indexed it meanwhile
                self._index.add(key, info)

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        with self._lock:
            snapshot = self._index.snapshot(namespace)
        for key, info in snapshot:
            yield StoredObject(key, info.size, info.created, info.last_used)

    def used_bytes(self) -> int:
        return self._index.used

    def counters(self) -> dict[str, float]:
        return {"evictions": self.evictions, "share_evictions": self.share_evictions,
                "share_refused_writes": self.share_refused, "reserved_evictions": self.reserved_evictions,
                "expired": self.expired,
                "removed_temp_files": self.removed_temp_files, "rejected_files": self._disk.rejected_files}

    # -- removal -----------------------------------------------------------------------------------------------
    def delete(self, key: ShardKey) -> bool:
        with self._lock:
            return self._remove_locked(key)

    def remove_records(self, namespaces: Collection[str]) -> int:
        """The namespaces' directories (their names are namespace ids), where empty: a file written into one
        meanwhile keeps it, and a write whose directory went under it makes it again; then the share ledgers'
        lines naming them (a later put into the namespace writes its line again). Links and names that are not
        kvtier's are left alone."""
        removed = self._remove_ledger_lines(namespaces)
        for namespace in namespaces:
            with self._lock:
                removed += self._disk.remove_namespace(namespace)
        return removed

    def _remove_ledger_lines(self, namespaces: Collection[str]) -> int:
        assert self._ledgers is not None
        removed = 0
        with raised_as_tier_error(self.name, f"{self.root}/{SHARES_DIR}"):
            for ledger in self._ledgers.refresh():
                for namespace in set(namespaces) & ledger.namespaces:
                    ledger.leave(namespace)
                    removed += 1
        return removed

    def _remove_locked(self, key: ShardKey) -> bool:
        if self._index.drop(key) is None:
            return False
        found = self._index.shares.share_of(key.namespace)
        if found is not None and self._ledgers is not None and (ledger := self._ledgers.get(found[0])) is not None:
            ledger.touch()  # the other processes counting the share count it from the directory again
        try:
            self._disk.remove_file(key)
        except FileNotFoundError:
            pass
        except (OSError, TierError) as exc:  # the index forgets it either way; a later start retries
            log.warning("%s: cannot remove %s: %s", self.name, key.name, exc)
        return True

    def _live_locked(self, key: ShardKey, now: float) -> FileEntry | None:
        """``key``'s index entry; None when there is none, or it is past its TTL (then removed and counted)."""
        info = self._index.files.get(key)
        if info is not None and self._index.expired(info, now):
            self._remove_locked(key)
            self.expired += 1
            return None
        return info

    def _expire_locked(self, now: float) -> None:
        for key in self._index.expired_keys(now):
            self._remove_locked(key)
            self.expired += 1

    def _enforce_capacity_locked(self) -> None:
        """Down to the low watermark, least recently used first, files within their shares' quotas last
        (:meth:`FileIndex.evictions`); evicting those is counted as ``reserved_evictions`` and logged."""
        cap = self.options.capacity_bytes
        if cap is None or self._index.used <= cap * self.options.high_watermark:
            return
        target = cap * self.options.low_watermark
        self._learn_shares_locked()  # shares other processes started since: reserved too
        assert self._ledgers is not None
        # A share another process changed since this one looked counts as within its quota: this index may still
        # hold files that process removed.
        excess = {sid: over if (ledger := self._ledgers.get(sid)) is None or not ledger.stale() else 0
                  for sid, over in self._index.shares.excess().items()}
        plan = self._index.evictions(target, excess)
        for key in plan.unreserved:
            self._remove_locked(key)
            self.evictions += 1
        if plan.reserved and not self.reserved_evictions:
            log.warning("%s: evicting inside tenant shares within their quotas: the quotas add up to more than "
                        "%d bytes (capacity_bytes x low_watermark); counted as reserved_evictions", self.name,
                        int(target))
        for key in plan.reserved:
            self._remove_locked(key)
            self.evictions += 1
            self.reserved_evictions += 1

    # -- walks of the directory --------------------------------------------------------------------------------
    def _reindex(self) -> None:
        """Index every shard file under the root, replacing the index (one file per key, earlier names migrated).

        Entries this process added while the walk ran are kept: the walk may have passed their directory first.
        """
        started = time.time()
        found = walk.walk(self._disk)
        with self._lock:
            self._index.replace(found, started)

    def _rescan_if_due(self) -> None:
        """Walk the directory again now and then when a capacity or TTL applies: other processes sharing it
        (TP workers, other engines) write and remove files this index would not otherwise see, and the limits
        are the directory's, not this process's."""
        every = self.options.rescan_seconds
        if every is None or (self.options.capacity_bytes is None and self.options.ttl_seconds is None):
            return
        now = time.monotonic()
        with self._lock:
            if now < self._next_rescan:
                return
            self._next_rescan = now + every
        try:
            self._reindex()
            with self._lock:
                self._learn_shares_locked()
        except (OSError, TierError) as exc:  # the next put tries again; until then the index stays as it was
            log.warning("%s: cannot walk %s again: %s", self.name, self.root, exc)

    # -- tenant shares -----------------------------------------------------------------------------------------
    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        """Count ``namespace``'s files against the tenant share ``share`` of ``quota_bytes`` (None: no share), in
        every process sharing the directory (its ledger names the namespace from its first put into the share on:
        this runs on the store's request path, and takes no lock another process may hold); a put that would take
        the share past its quota evicts the share's own least recently used files (an isolated LRU), whichever
        process wrote them."""
        sid = None if share is None else share_id(share)
        with self._lock:  # a walk of the index, once per namespace
            self._index.shares.set(namespace, sid, quota_bytes, self._index.files)

    def share_bytes(self, share: str) -> int:
        with self._lock:
            return self._index.shares.bytes(share_id(share))

    def _learn_shares_locked(self) -> None:
        """Count the namespaces other processes' ledgers name against their shares (this process's own
        ``set_share`` wins where both name one)."""
        assert self._ledgers is not None
        shares = self._index.shares
        new: dict[str, tuple[str | None, int]] = {
            ns: (ledger.sid, ledger.quota) for ledger in self._ledgers.refresh() for ns in ledger.namespaces
            if shares.share_of(ns) is None}
        if new:
            shares.set_many(new, self._index.files, learned=True)

    def _recount_share(self, ledger: Ledger) -> None:
        """Another process changed the share: index its namespaces' files from the directory again (files gone
        leave the index, files new enter it), as the share is counted from the index."""
        shares = self._index.shares
        with self._lock:
            self._learn_shares_locked()
            counted: dict[str, set[ShardKey]] = {}
            for key in shares.keys(ledger.sid):
                counted.setdefault(key.namespace, set()).add(key)
        names = ledger.namespaces
        if len(names) > len(counted) + 64:  # most named, none indexed: one listing of the root spares their opens
            with os.scandir(self._disk.root_fd) as it:
                names = names & {e.name for e in it} | counted.keys()
        for namespace in names:
            self._recount_namespace(namespace, counted.get(namespace, set()))
        with self._lock:  # a namespace forgotten from the bounded table of learned ones, now holding files
            lost = {ns: (ledger.sid, ledger.quota) for ns in shares.with_files(names) if shares.share_of(ns) is None}
            if lost:
                shares.set_many(lost, self._index.files, learned=True)

    def _recount_namespace(self, namespace: str, counted: set[ShardKey]) -> None:
        """Index ``namespace``'s files (``counted``: those indexed) from the directory again, listing only the
        chunk directories changed since their last listing here."""
        found, unchanged = walk.namespace_files(self._disk, namespace, counted, self._listed)
        with self._lock:
            for key in counted - found.keys():
                if key.chunk[:2] not in unchanged:
                    self._index.drop(key)
            new = [(k, v) for k, v in found.items() if v is not None and k not in self._index.files]
            for key, info in sorted(new, key=lambda kv: kv[1].last_used):  # the share's LRU order
                self._index.add(key, info)
