"""The filesystem tier: one file per shard under a root directory, crash-safe and re-indexed on start.

Layout: ``ROOT/<namespace>/<chunk[:2]>/<chunk>.<heads>.kv``, one name per shard key: two processes writing one
chunk replace each other's file (rename is atomic) instead of leaving two. A write goes to a temp file
``ROOT/.tmp/<pid>.<random>.part`` (fsync'd when ``durability: fsync``), renamed into place: a reader sees a
whole file or none. The writer holds ``flock(LOCK_EX)`` on its temp file until the rename, and start-up removes
only temp files it can lock, so a live writer in any PID namespace keeps its file. Several processes may share
one directory: each indexes it on start and finds chunks that others wrote later when a lookup reaches them.
The creation time, which drives the TTL, is the header's ``created`` (:mod:`kvtier.frame`; the first 96 bytes
are read when indexing), so a read never extends it; a file without a valid header (the store rejects it when
read) counts its mtime. Last use is the mtime (``get`` sets it), so LRU order survives restarts. Capacity
and TTL hold for the directory: with either set, a put walks the directory again every ``rescan_seconds`` (on
the cascade worker's thread), so what other processes wrote counts and may be evicted too. Files of the
earlier layout, ``<chunk>.<heads>.<created ms>.kv``, migrate on start: the newest per key is renamed, the rest go.

Tenant shares (``set_share``) are the directory's: each has a ledger in ``ROOT/.shares``
(:mod:`kvtier.quotas.ledger`) naming its namespaces and quota, and a put into a share checks the quota,
evicts the share's least recently used files and renames its own into place under the ledger's lock, after
counting the share from the directory again if another process changed it (only the chunk directories whose
mtime changed since this process last listed them: a timestamp step of at most 1 s is assumed). So processes
and writer threads on one directory hold a share to its quota together. A quota is also a reservation against
``capacity_bytes``: capacity eviction takes files in no share, and shares' files past their quota, before any
file of a share within its quota (those go only when the quotas add up to more than the capacity, counted as
``reserved_evictions``).

Trust. The configured path is resolved once at start (links in it, e.g. ``/tmp`` on macOS, are followed then)
and the root is held open; everything inside is reached from directory descriptors with ``O_NOFOLLOW``, so no
link inside the root is ever followed: a link as ``.tmp`` or ``.shares`` refuses the start, one as a namespace
or chunk directory is skipped, one with a shard's or a ledger's name is removed. The root and every directory in
it must belong to this process's uid and not be writable by group or other, else :class:`TierError` names it;
the tier never chmods a directory it did not create, and those it creates (missing parents of the root too)
are 0700 whatever the umask; files are 0600. Reads accept only regular files of at most ``min(8 GiB,
capacity_bytes)``; anything else (a FIFO, a link, a sparse giant) is a miss, removed and counted as
``rejected_files``. A read takes at most one byte past the indexed size: a key fixes its object's size, so a
longer file is damaged, and the store's check only needs to see that. Not defended: the root's parents are
trusted (whoever can rename them can redirect a later start), and so is every process of this uid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import logging
import math
import os
import re
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np

from kvtier import frame
from kvtier.errors import ConfigError, ObjectError, QuotaFull, TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier import quotas
from kvtier.quotas.ledger import Hold, Ledger, Ledgers
from kvtier.quotas import share_id
from kvtier.quotas.index import IndexShares
from kvtier.tiers.base import TIERS, Buffer, StoredObject, Tier

log = logging.getLogger(__name__)

_TMP_DIR = ".tmp"
_SHARES_DIR = ".shares"  # one ledger per tenant share (kvtier.quotas.ledger)
_TIMESTAMP_STEP_NS = 10**9  # a directory's mtime step on any local filesystem we run on (ext3: 1 s)
_TMP_NAME = re.compile(r"\d+\.[0-9a-f]{32}\.part")
# <chunk>.<heads>.kv, or the earlier <chunk>.<heads>.<created ms>.kv (group 3) that start-up migrates.
_FILE_NAME = re.compile(r"((?:[0-9a-f]{2})+)\.(\d+-\d+of\d+)(?:\.(\d+))?\.kv")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")  # a namespace directory (".tmp" is not one)
_SUB = re.compile(r"[0-9a-f]{2}")  # a chunk directory
_MAX_OBJECT_BYTES = 8 * 2**30  # far above any KV shard; a larger file is garbage, never worth allocating
_STALE_TEMP_SECONDS = 3600.0  # only where the filesystem has no locks: a temp file this old has no writer
_NO_LOCKS = (errno.EOPNOTSUPP, errno.ENOLCK)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO must not hang us


@dataclasses.dataclass(frozen=True)
class FilesystemOptions:
    path: str
    capacity_bytes: int | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    ttl_seconds: float | None = None
    durability: Literal["none", "fsync"] = "none"
    rescan_seconds: float | None = 60.0

    def check(self, field: str) -> None:
        if self.rescan_seconds is not None and self.rescan_seconds <= 0:
            raise ConfigError(f"{field}.rescan_seconds: must be positive or null, got {self.rescan_seconds}")
        if not self.path.strip():
            raise ConfigError(f"{field}.path: must name a directory, got an empty path")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(f"{field}.low_watermark/high_watermark: need 0 < low <= high <= 1, got "
                              f"{self.low_watermark} and {self.high_watermark}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ConfigError(f"{field}.capacity_bytes: must be positive, got {self.capacity_bytes}")
        if self.ttl_seconds is not None and self.ttl_seconds <= 0:
            raise ConfigError(f"{field}.ttl_seconds: must be positive, got {self.ttl_seconds}")


@dataclasses.dataclass(slots=True)
class _File:
    size: int  # the file's path follows from its key, so 100,000 entries hold no strings
    created: float
    last_used: float


_T = TypeVar("_T")
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


class _Rejected(Exception):
    """A file where a shard should be is not one we will read (its reason is the message)."""


@functools.lru_cache(maxsize=256)
def _parse_heads(text: str) -> HeadRange | None:
    """A file name's head range; cached, as a directory holds a handful of distinct ones 100,000 times."""
    try:
        return HeadRange.parse(text)
    except ValueError:
        return None


def _file_name(key: ShardKey) -> str:
    return f"{key.chunk}.{key.heads}.kv"


def _bytes_view(part: Buffer) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _read_fully(fd: int, buffers: list[memoryview]) -> int:
    """Fill ``buffers`` in order from ``fd`` (``readv`` until they are full or the file ends); bytes read."""
    total, left = 0, [b for b in buffers if len(b)]
    while left:
        n = os.readv(fd, left[:_IOV_MAX])  # a DRAM entry of many extents: more buffers than one call takes
        if n == 0:
            break
        total += n
        while left and n >= len(left[0]):
            n -= len(left[0])
            left.pop(0)
        if n:
            left[0] = left[0][n:]
    return total


def _header_created(head: bytes | memoryview, now: float) -> float | None:
    """The creation time in an object's header; None when the bytes are not a kvtier header."""
    try:
        created = frame.decode_header(head).created
    except frame.FrameError:
        return None
    # The header is checksummed, not signed: never let it postpone the TTL beyond now or forever.
    return min(created, now) if math.isfinite(created) else None


def _reason(exc: OSError) -> str:
    """What went wrong, naming the path when the error carries one."""
    if exc.errno == errno.ELOOP:
        why = "is a symbolic link, which the tier never follows inside its root"
    elif exc.errno == errno.ENOTDIR:
        why = "is not a directory"
    else:
        why = f"{errno.errorcode.get(exc.errno or 0, '')} {exc.strerror}"
    return f"{exc.filename}: {why}" if exc.filename else why


@contextlib.contextmanager
def _raised_as_tier_error(tier: str, where: str) -> Iterator[None]:
    """An OSError inside (a directory unreadable, a disk error) raised as a TierError naming ``where``."""
    try:
        yield
    except OSError as exc:
        raise TierError(f"{tier}: cannot remove {where}: {_reason(exc)}") from exc


def _unlink_quietly(name: str, dir_fd: int) -> None:
    """Remove a directory entry (a link itself, never its target) if possible; a vanished one is fine."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


@TIERS.register("filesystem")
class FilesystemTier(Tier):
    """Shards as files on a local filesystem (NVMe, or any POSIX filesystem with atomic rename)."""

    Options = FilesystemOptions
    persistent = True
    local = True
    shares = True

    def __init__(self, name: str, options: FilesystemOptions) -> None:
        super().__init__(name, options)
        self.root = Path(os.path.realpath(os.path.expanduser(options.path)))
        self._lock = threading.Lock()
        self._files: OrderedDict[ShardKey, _File] = OrderedDict()  # least recently used first
        self._by_chunk: dict[tuple[str, str], set[HeadRange]] = {}
        self._used = 0
        self._shares = IndexShares()  # per-tenant quotas (set_share), under self._lock
        self._max_object = min(_MAX_OBJECT_BYTES, options.capacity_bytes or _MAX_OBJECT_BYTES)
        self.evictions = 0
        self.share_evictions = 0  # of those, inside a tenant's share
        self.share_refused = 0  # writes refused: the tenant's share held only recent files
        self.reserved_evictions = 0  # capacity evictions inside a share within its quota (quotas past capacity)
        self.expired = 0
        self.rejected_files = 0
        self._uid = os.geteuid()
        self._root_fd = self._tmp_fd = self._shares_fd = -1
        self._ledgers: Ledgers | None = None
        self._sub_mtimes: dict[tuple[str, str], int] = {}  # chunk directories of shares, as last listed
        self._next_rescan = time.monotonic() + (options.rescan_seconds or 0.0)
        try:
            self._root_fd = self._open_root()
            self._tmp_fd = self._open_dir(self._root_fd, _TMP_DIR, f"{self.root}/{_TMP_DIR}", create=True)
            self._shares_fd = self._open_dir(self._root_fd, _SHARES_DIR, f"{self.root}/{_SHARES_DIR}", create=True)
            self._ledgers = Ledgers(self._shares_fd, self._uid, f"{self.root}/{_SHARES_DIR}")
            self.removed_temp_files = self._clean_temp()
            self._reindex()
            with self._lock:
                self._learn_shares_locked()
                self._expire_locked(time.time())
                self._enforce_capacity_locked()
        except BaseException as exc:
            self.close()
            if isinstance(exc, OSError):
                raise TierError(f"{name}: cannot use directory {self.root}: {_reason(exc)}") from exc
            raise

    def close(self) -> None:
        if self._ledgers is not None:
            self._ledgers.close()
        for fd in (self._root_fd, self._tmp_fd, self._shares_fd):
            if fd >= 0:
                os.close(fd)
        self._root_fd = self._tmp_fd = self._shares_fd = -1  # a stale number could name another directory later

    # -- directories -------------------------------------------------------------------------------------------
    def _open_root(self) -> int:
        """Open the root, creating missing directories one by one (0700 whatever the umask)."""
        base, missing = self.root, []
        while not os.path.lexists(base):
            missing.append(base.name)
            base = base.parent
        if not missing:
            return self._open_dir(None, str(self.root), str(self.root), create=False)
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # a parent: trusted, see above
        for name in reversed(missing):
            base = base / name
            try:
                child = self._open_dir(fd, name, str(base), create=True)
            finally:
                os.close(fd)
            fd = child
        return fd

    def _open_dir(self, parent_fd: int | None, name: str, where: str, *, create: bool) -> int:
        """Open directory ``name`` under ``parent_fd`` without following a link, creating it if asked.

        Raises :class:`TierError` when it belongs to another uid or others may write into it: whoever can
        write there decides what this tier reads, writes and deletes.
        """
        created = False
        try:
            if create:
                try:
                    os.mkdir(name, 0o700, dir_fd=parent_fd)
                    created = True
                except FileExistsError:
                    pass
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            code = exc.errno or 0
            # O_NOFOLLOW | O_DIRECTORY fails with ENOTDIR on a link to a directory: say which it was.
            if code == errno.ENOTDIR and stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                code = errno.ELOOP
            raise OSError(code, os.strerror(code), where) from exc  # the subclass follows the code
        try:
            if created:
                os.fchmod(fd, 0o700)  # the umask may have taken bits away; this one is ours to set
            st = os.fstat(fd)
            if st.st_uid != self._uid:
                raise TierError(f"{self.name}: refusing directory {where}: owned by uid {st.st_uid}, not by "
                                f"this process's uid {self._uid}")
            if st.st_mode & 0o022:
                raise TierError(f"{self.name}: refusing directory {where}: writable by group or other (mode "
                                f"{stat.S_IMODE(st.st_mode):o}); make it 0700 or choose another path")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_sub(self, namespace: str, sub: str, *, create: bool) -> int | None:
        """``ROOT/<namespace>/<sub>``; None when absent, or a link (never followed), and not to be created."""
        if not _HEX.fullmatch(namespace) or not _SUB.fullmatch(sub):  # e.g. "..": never a path out of the root
            raise TierError(f"{self.name}: {namespace!r}/{sub!r} is not a namespace id and chunk directory")
        try:
            ns_fd = self._open_dir(self._root_fd, namespace, f"{self.root}/{namespace}", create=create)
            try:
                return self._open_dir(ns_fd, sub, f"{self.root}/{namespace}/{sub}", create=create)
            finally:
                os.close(ns_fd)
        except OSError as exc:
            if create or exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise
            if exc.errno != errno.ENOENT:
                log.warning("%s: skipping %s", self.name, _reason(exc))
            return None

    # -- start-up ----------------------------------------------------------------------------------------------
    def _clean_temp(self) -> int:
        """Remove temp files no live writer holds: only ours by name, only regular files, only if we lock them."""
        removed = 0
        with os.scandir(self._tmp_fd) as it:
            names = [e.name for e in it if _TMP_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False)]
        for name in names:
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=self._tmp_fd)
            except OSError:
                continue  # gone, or swapped for a link since the listing: not ours to touch
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer, in this PID namespace or any other
                except OSError as exc:  # a filesystem without locks: only the file's age can tell
                    if exc.errno not in _NO_LOCKS or time.time() - os.fstat(fd).st_mtime < _STALE_TEMP_SECONDS:
                        continue
                os.unlink(name, dir_fd=self._tmp_fd)  # under our lock: see _create_temp
                removed += 1
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        return removed

    def _reindex(self) -> None:
        """Index every shard file under the root, replacing the index (one file per key, earlier names migrated).

        Entries this process added while the walk ran are kept: the walk may have passed their directory first.
        """
        started = time.time()
        found: list[tuple[ShardKey, _File]] = []
        for ns, ns_fd in self._subdirs(self._root_fd, str(self.root), _HEX):
            for sub, sub_fd in self._subdirs(ns_fd, f"{self.root}/{ns}", _SUB):
                found += self._index_dir(ns, sub, sub_fd)
        with self._lock:
            for key, info in found:
                known = self._files.get(key)
                if known is not None:
                    info.last_used = max(info.last_used, known.last_used)  # reads since the last walk
            fresh = [(k, v) for k, v in self._files.items() if v.last_used >= started]
            self._files.clear()
            self._by_chunk.clear()
            self._used = 0
            self._shares.reset()
            for key, info in sorted(found + fresh, key=lambda kf: kf[1].last_used):
                self._add_locked(key, info)

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

    def _subdirs(self, parent_fd: int, where: str, names: re.Pattern[str]) -> Iterator[tuple[str, int]]:
        """The directories under ``parent_fd`` named like ours, each open while the caller uses it."""
        with os.scandir(parent_fd) as it:
            entries = [e for e in it if names.fullmatch(e.name)]
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                log.warning("%s: skipping %s/%s: not a directory (links are never followed)", self.name,
                            where, entry.name)
                continue
            try:
                fd = self._open_dir(parent_fd, entry.name, f"{where}/{entry.name}", create=False)
            except FileNotFoundError:  # removed since it was listed (a purge's, once empty)
                continue
            try:
                yield entry.name, fd
            finally:
                os.close(fd)

    def _index_dir(self, namespace: str, sub: str, sub_fd: int) -> list[tuple[ShardKey, _File]]:
        """Index one chunk directory, leaving one file per key (the newest; earlier-layout names migrate)."""
        by_key: dict[ShardKey, list[str]] = {}
        with os.scandir(sub_fd) as it:
            for entry in it:
                key = self._parse_name(namespace, entry.name)
                if key is None or key.chunk[:2] != sub:
                    continue
                if entry.is_file(follow_symlinks=False):
                    by_key.setdefault(key, []).append(entry.name)
                elif not entry.is_dir(follow_symlinks=False):
                    self._reject(sub_fd, entry.name, "not a regular file")
        found = []
        for key, names in by_key.items():
            stats = [(name, info) for name in names if (info := self._stat(sub_fd, name)) is not None]
            if not stats:
                continue
            newest, info = max(stats, key=lambda ni: ni[1].created)
            final = _file_name(key)
            if newest != final:
                try:
                    os.rename(newest, final, src_dir_fd=sub_fd, dst_dir_fd=sub_fd)
                except FileNotFoundError:
                    continue  # another process starting beside us migrated this key first
            for name, _ in stats:
                if name not in (newest, final):
                    _unlink_quietly(name, sub_fd)
            found.append((key, info))
        return found

    def _open_shard(self, dir_fd: int, name: str) -> tuple[int, os.stat_result]:
        """A descriptor and the status of a shard file; :class:`_Rejected` when it is not one we would read."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link, a socket; not EMFILE, EIO...
                raise _Rejected(_reason(exc)) from exc
            raise
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size <= self._max_object:
            return fd, st
        os.close(fd)
        raise _Rejected("not a regular file" if not stat.S_ISREG(st.st_mode) else
                        f"{st.st_size} bytes, more than the {self._max_object} a shard may have")

    def _stat(self, dir_fd: int, name: str) -> _File | None:
        """Size and times of a shard file, or None (and removed, when it is not one we would read)."""
        try:
            fd, st = self._open_shard(dir_fd, name)
        except FileNotFoundError:
            return None
        except _Rejected as exc:
            self._reject(dir_fd, name, str(exc))
            return None
        try:
            created = _header_created(os.pread(fd, frame.MAX_HEADER_LEN, 0), time.time())
        finally:
            os.close(fd)
        return _File(st.st_size, st.st_mtime if created is None else created, st.st_mtime)

    def _reject(self, dir_fd: int, name: str, reason: str) -> None:
        log.warning("%s: removing %s (%s)", self.name, name, reason)
        _unlink_quietly(name, dir_fd)
        with self._lock:
            self.rejected_files += 1

    @staticmethod
    def _parse_name(namespace: str, name: str) -> ShardKey | None:
        match = _FILE_NAME.fullmatch(name)
        if match is None:
            return None
        heads = _parse_heads(match[2])
        return None if heads is None else ShardKey(namespace, match[1], heads)

    # -- index -------------------------------------------------------------------------------------------------
    def _add_locked(self, key: ShardKey, info: _File) -> None:
        old = self._files.pop(key, None)
        if old is not None:
            self._used -= old.size  # one file per key: a replaced file's bytes are gone from disk too
        self._files[key] = info
        self._by_chunk.setdefault((key.namespace, key.chunk), set()).add(key.heads)
        self._used += info.size
        self._shares.added(key, info.size, old.size if old else 0)

    def _drop_locked(self, key: ShardKey) -> _File | None:
        info = self._files.pop(key, None)
        if info is None:
            return None
        self._used -= info.size
        self._shares.dropped(key, info.size)
        heads = self._by_chunk.get((key.namespace, key.chunk))
        if heads is not None:
            heads.discard(key.heads)
            if not heads:
                del self._by_chunk[(key.namespace, key.chunk)]
        return info

    def _expired(self, info: _File, now: float) -> bool:
        return self.options.ttl_seconds is not None and now - info.created > self.options.ttl_seconds

    def _live_locked(self, key: ShardKey, now: float) -> _File | None:
        """``key``'s index entry; None when there is none, or it is past its TTL (then removed and counted)."""
        info = self._files.get(key)
        if info is not None and self._expired(info, now):
            self._remove_locked(key)
            self.expired += 1
            return None
        return info

    def _expire_locked(self, now: float) -> None:
        if self.options.ttl_seconds is None:
            return
        for key in [k for k, info in self._files.items() if self._expired(info, now)]:
            self._remove_locked(key)
            self.expired += 1

    # -- tenant shares -----------------------------------------------------------------------------------------
    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        """Count ``namespace``'s files against the tenant share ``share`` of ``quota_bytes`` (None: no share), in
        every process sharing the directory (its ledger names the namespace from its first put into the share on:
        this runs on the store's request path, and takes no lock another process may hold); a put that would take
        the share past its quota evicts the share's own least recently used files (an isolated LRU), whichever
        process wrote them."""
        sid = None if share is None else share_id(share)
        with self._lock:
            self._shares.set(namespace, sid, quota_bytes, self._files)  # a walk of the index, once per namespace

    def share_bytes(self, share: str) -> int:
        with self._lock:
            return self._shares.bytes(share_id(share))

    def _learn_shares_locked(self) -> None:
        """Count the namespaces other processes' ledgers name against their shares (this process's own
        ``set_share`` wins where both name one)."""
        assert self._ledgers is not None
        new: dict[str, tuple[str | None, int]] = {
            ns: (ledger.sid, ledger.quota) for ledger in self._ledgers.refresh() for ns in ledger.namespaces
            if self._shares.share_of(ns) is None}
        if new:
            self._shares.set_many(new, self._files, learned=True)

    def _recount_share(self, ledger: Ledger) -> None:
        """Another process changed the share: index its namespaces' files from the directory again (files gone
        leave the index, files new enter it), as the share is counted from the index."""
        with self._lock:
            self._learn_shares_locked()
            counted: dict[str, set[ShardKey]] = {}
            for key in self._shares.keys(ledger.sid):
                counted.setdefault(key.namespace, set()).add(key)
        names = ledger.namespaces
        if len(names) > len(counted) + 64:  # most named, none indexed: one listing of the root spares their opens
            with os.scandir(self._root_fd) as it:
                names = names & {e.name for e in it} | counted.keys()
        for namespace in names:
            self._recount_namespace(namespace, counted.get(namespace, set()))
        with self._lock:  # a namespace forgotten from the bounded table of learned ones, now holding files
            lost = {ns: (ledger.sid, ledger.quota) for ns in self._shares.with_files(names)
                    if self._shares.share_of(ns) is None}
            if lost:
                self._shares.set_many(lost, self._files, learned=True)

    def _recount_namespace(self, namespace: str, counted: set[ShardKey]) -> None:
        """Index ``namespace``'s files (``counted``: those indexed) from the directory again, listing only the
        chunk directories changed since their last listing here."""
        where = f"{self.root}/{namespace}"
        found: dict[ShardKey, _File | None] = {}  # None: indexed already
        unchanged: set[str] = set()
        try:
            ns_fd = self._open_dir(self._root_fd, namespace, where, create=False)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise
            ns_fd = -1  # gone (purged), or not ours to follow: none of its files count
        if ns_fd >= 0:
            try:
                for sub, sub_fd in self._subdirs(ns_fd, where, _SUB):
                    if self._listed_sub(namespace, sub, sub_fd):
                        unchanged.add(sub)
                        continue
                    with os.scandir(sub_fd) as it:
                        names = [e.name for e in it if e.is_file(follow_symlinks=False)]
                    for name in names:
                        key = self._parse_name(namespace, name)
                        if key is not None and name == _file_name(key):
                            found[key] = None if key in counted else self._stat(sub_fd, name)
            finally:
                os.close(ns_fd)
        with self._lock:
            for key in counted - found.keys():
                if key.chunk[:2] not in unchanged:
                    self._drop_locked(key)
            new = [(k, v) for k, v in found.items() if v is not None and k not in self._files]
            for key, info in sorted(new, key=lambda kv: kv[1].last_used):  # the share's LRU order
                self._add_locked(key, info)

    def _listed_sub(self, namespace: str, sub: str, sub_fd: int) -> bool:
        """Whether a chunk directory is as this process last listed it: its mtime is the one seen then, and was
        older than that listing by more than a filesystem's timestamp step, so no change since can share it (as
        git tells a racily clean file). Else it is about to be listed: its mtime is kept when that is safe."""
        mtime, now = os.fstat(sub_fd).st_mtime_ns, time.time_ns()
        if self._sub_mtimes.get((namespace, sub)) == mtime:
            return True
        if now - mtime > _TIMESTAMP_STEP_NS:
            self._sub_mtimes[(namespace, sub)] = mtime
        else:
            self._sub_mtimes.pop((namespace, sub), None)
        return False

    def _enforce_capacity_locked(self) -> None:
        """Down to the low watermark, least recently used first. A quota is a reservation: files in no share, and
        shares' files past their quota, go first; a share within its quota loses files only when those are not
        enough (its quotas add up to more than the capacity: counted as ``reserved_evictions`` and logged)."""
        cap = self.options.capacity_bytes
        if cap is None or self._used <= cap * self.options.high_watermark:
            return
        target = cap * self.options.low_watermark
        self._learn_shares_locked()  # shares other processes started since: reserved too
        assert self._ledgers is not None
        # A share another process changed since this one looked counts as within its quota: this index may still
        # hold files that process removed.
        excess = {sid: over if (ledger := self._ledgers.get(sid)) is None or not ledger.stale() else 0
                  for sid, over in self._shares.excess().items()}
        for key in list(self._files):
            if self._used <= target:
                return
            found = self._shares.share_of(key.namespace)
            if found is not None:
                if excess.get(found[0], 0) <= 0:
                    continue
                excess[found[0]] -= self._files[key].size
            self._remove_locked(key)
            self.evictions += 1
        if self._used > target and not self.reserved_evictions:
            log.warning("%s: evicting inside tenant shares within their quotas: the quotas add up to more than "
                        "%d bytes (capacity_bytes x low_watermark); counted as reserved_evictions", self.name,
                        int(target))
        while self._used > target and self._files:
            self._remove_locked(next(iter(self._files)))
            self.evictions += 1
            self.reserved_evictions += 1

    def _remove_locked(self, key: ShardKey) -> bool:
        if self._drop_locked(key) is None:
            return False
        found = self._shares.share_of(key.namespace)
        if found is not None and self._ledgers is not None and (ledger := self._ledgers.get(found[0])) is not None:
            ledger.touch()  # the other processes counting the share count it from the directory again
        try:
            sub_fd = self._open_sub(key.namespace, key.chunk[:2], create=False)
            if sub_fd is not None:
                try:
                    os.unlink(_file_name(key), dir_fd=sub_fd)
                finally:
                    os.close(sub_fd)
        except FileNotFoundError:
            pass
        except (OSError, TierError) as exc:  # the index forgets it either way; a later start retries
            log.warning("%s: cannot remove %s: %s", self.name, key.name, exc)
        return True

    # -- the tier interface ------------------------------------------------------------------------------------
    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        views = [_bytes_view(p) for p in parts]
        size, now = sum(len(v) for v in views), time.time()
        with self._lock:
            found = self._shares.share_of(key.namespace)
            self._refuse_if_full_locked(key, size, now)  # spares the write; the check that counts is at the commit
        assert self._ledgers is not None
        ledger = None if found is None else self._ledgers.of(found[0])
        created = _header_created(views[0][:frame.MAX_HEADER_LEN], now) if views else None
        fd, tmp = -1, None
        try:
            fd, tmp = self._create_temp()
            for view in views:
                while view:
                    view = view[os.write(fd, view):]
            if self.options.durability == "fsync":
                os.fsync(fd)
            if ledger is None:
                self._rename_into_place(tmp, key)
                tmp = None
                with self._lock:
                    self._add_locked(key, _File(size, now if created is None else created, now))
            else:
                with ledger.held() as hold:
                    self._commit_into_share(key, tmp, size, created, ledger, hold)
                    tmp = None
        except BaseException as exc:
            if tmp is not None:
                _unlink_quietly(tmp, self._tmp_fd)
            if isinstance(exc, OSError):
                raise TierError(f"{self.name}: cannot write {key.name}: {_reason(exc)}") from exc
            raise
        finally:
            if fd >= 0:
                os.close(fd)  # releases the writer's lock, after the rename
        self._rescan_if_due()
        with self._lock:
            self._expire_locked(now)
            self._enforce_capacity_locked()

    def _rename_into_place(self, tmp: str, key: ShardKey) -> None:
        for attempt in range(2):  # again once, if a purge removed the directory (empty) under us
            try:
                sub_fd = self._open_sub(key.namespace, key.chunk[:2], create=True)
                assert sub_fd is not None
                try:
                    os.rename(tmp, _file_name(key), src_dir_fd=self._tmp_fd, dst_dir_fd=sub_fd)
                    if self.options.durability == "fsync":
                        os.fsync(sub_fd)
                finally:
                    os.close(sub_fd)
                return
            except FileNotFoundError:
                if attempt:
                    raise

    def _commit_into_share(self, key: ShardKey, tmp: str, size: int, created: float | None, ledger: Ledger,
                           hold: Hold) -> None:
        """Holding the share's ledger (no other put of the share, in any process, between check and rename): count
        the share from the directory if another process changed it, then refuse the file, or evict the share's
        least recently used files to make room for it and rename it into place."""
        if hold.stale:
            self._recount_share(ledger)
            hold.stale = False
        with self._lock:
            found = self._shares.share_of(key.namespace)
        # The namespace's first put into the share (or the first since a purge or a compaction took it out).
        if found is not None and not ledger.joined(hold, key.namespace, found[1], self._with_files):
            with self._lock:
                self.share_refused += 1
            raise QuotaFull(f"{self.name}: not writing {key.name}: its tenant's share names as many namespaces "
                            "holding files as its ledger can hold")
        now = time.time()
        with self._lock:
            self._refuse_if_full_locked(key, size, now)
            victims = self._shares.victims(key.namespace, self._size_of, self._used_at,
                                           now - quotas.RECENT_SECONDS, key, size)
            ledger.changing(hold)  # before the evictions and the rename: a kill between them still tells the others
            for victim in victims:
                self._remove_locked(victim)
                self.evictions += 1
                self.share_evictions += 1
        self._rename_into_place(tmp, key)
        with self._lock:
            self._add_locked(key, _File(size, now if created is None else created, now))

    def _with_files(self, namespaces: frozenset[str]) -> set[str]:
        with self._lock:
            return self._shares.with_files(namespaces)

    def _refuse_if_full_locked(self, key: ShardKey, size: int, now: float) -> None:
        if self._shares.refuses(key, size, self._size_of, self._used_at, now - quotas.RECENT_SECONDS):
            self.share_refused += 1
            raise QuotaFull(f"{self.name}: not writing {key.name}: its tenant's share is full of files used "
                            f"in the last {quotas.RECENT_SECONDS:g} s")

    def _size_of(self, key: ShardKey) -> int:
        return self._files[key].size

    def _used_at(self, key: ShardKey) -> float:
        return self._files[key].last_used

    def _create_temp(self) -> tuple[int, str]:
        """A new temp file, locked for as long as it is being written."""
        for _ in range(3):
            name = f"{os.getpid()}.{uuid.uuid4().hex}.part"
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self._tmp_fd)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError as exc:
                    if exc.errno not in _NO_LOCKS:  # without locks, start-up cleanup goes by age instead
                        raise
                # Another process's cleanup may have locked and removed it between our open and flock.
                if os.fstat(fd).st_nlink:
                    return fd, name
            except BaseException:
                _unlink_quietly(name, self._tmp_fd)
                os.close(fd)
                raise
            os.close(fd)
        raise TierError(f"{self.name}: temp files in {self.root / _TMP_DIR} keep vanishing before they are locked")

    def get(self, key: ShardKey) -> Buffer | None:
        def whole(fd: int, st: os.stat_result, indexed: int) -> memoryview:
            buf = np.empty(min(st.st_size, indexed + 1), dtype=np.uint8)  # not zero-filled first
            view = buf.data
            return view[:_read_fully(fd, [view])]

        return self._get(key, whole)

    def get_into(self, key: ShardKey, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
        """One ``readv`` into a small header buffer and the caller's payload buffers (e.g. DRAM pages): no read
        buffer, no copy after it."""
        want = header_len + sum(len(part) for part in payload)

        def parts(fd: int, st: os.stat_result, indexed: int) -> bytes:
            header = bytearray(header_len)
            if st.st_size != want or _read_fully(fd, [memoryview(header), *payload]) != want:
                raise ObjectError(f"{self.name}: {key.name} is {st.st_size} bytes, expected {want}")
            return bytes(header)

        return self._get(key, parts)

    def _get(self, key: ShardKey, read: Callable[[int, os.stat_result, int], _T]) -> _T | None:
        """``read(fd, its status, the size indexed)`` on the key's file, or None when it is not there (dropped
        from the index) or not a file we read (removed)."""
        now = time.time()
        with self._lock:
            info = self._live_locked(key, now)
            if info is None:
                return None
            self._files.move_to_end(key)
            self._shares.used(key)
            info.last_used = now
            indexed = info.size
        try:
            data = self._read(key, indexed, read)
        except OSError as exc:
            raise TierError(f"{self.name}: cannot read {key.name}: {_reason(exc)}") from exc
        if data is None:
            with self._lock:
                self._drop_locked(key)
        return data

    def _read(self, key: ShardKey, indexed: int, read: Callable[[int, os.stat_result, int], _T]) -> _T | None:
        sub_fd = self._open_sub(key.namespace, key.chunk[:2], create=False)
        if sub_fd is None:
            return None
        name = _file_name(key)
        try:
            fd, st = self._open_shard(sub_fd, name)
            try:
                data = read(fd, st, indexed)
                try:
                    os.utime(fd)  # record the use: LRU order survives a restart
                except OSError:
                    pass  # e.g. a read-only filesystem: still a good read, only the order is not saved
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        except _Rejected as exc:
            self._reject(sub_fd, name, str(exc))
            return None
        finally:
            os.close(sub_fd)
        return data

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
            if not _HEX.fullmatch(namespace):
                continue
            where = f"{self.root}/{namespace}"
            with self._lock, _raised_as_tier_error(self.name, where):
                try:
                    ns_fd = self._open_dir(self._root_fd, namespace, where, create=False)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):  # gone, or not ours to follow
                        continue
                    raise
                try:
                    with os.scandir(ns_fd) as it:
                        subs = [e.name for e in it if _SUB.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
                    for sub in subs:
                        self._rmdir_if_empty(ns_fd, sub, f"{where}/{sub}")
                finally:
                    os.close(ns_fd)
                removed += self._rmdir_if_empty(self._root_fd, namespace, where)
        return removed

    def _remove_ledger_lines(self, namespaces: Collection[str]) -> int:
        assert self._ledgers is not None
        removed = 0
        with _raised_as_tier_error(self.name, f"{self.root}/{_SHARES_DIR}"):
            for ledger in self._ledgers.refresh():
                for namespace in set(namespaces) & ledger.namespaces:
                    ledger.leave(namespace)
                    removed += 1
        return removed

    def _rmdir_if_empty(self, parent_fd: int, name: str, where: str) -> int:
        """1 if the directory was removed; 0 if it is not empty (a file written meanwhile) or gone already;
        TierError on anything else."""
        try:
            os.rmdir(name, dir_fd=parent_fd)
            return 1
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                return 0
            raise TierError(f"{self.name}: cannot remove {where}: {_reason(exc)}") from exc

    def exists(self, key: ShardKey) -> bool:
        """Whether the index holds ``key`` unexpired (no disk access but to remove an expired file, as ``get``
        does: the cascade asks before every write)."""
        with self._lock:
            return self._live_locked(key, time.time()) is not None

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        with self._lock:
            found = [list(self._by_chunk.get((namespace, c), ())) for c in chunks]
        # Another process (a vLLM worker, a second engine on this host) may have written chunks since this
        # tier indexed the directory: look on disk for the first chunk the index lacks. A prefix ends at its
        # first missing chunk, so one directory listing per lookup is enough.
        for i, chunk in enumerate(chunks):
            if not found[i]:
                found[i] = self._scan_chunk(namespace, chunk)
                if not found[i]:
                    break
        if self.options.ttl_seconds is not None:
            now = time.time()
            with self._lock:
                found = [[h for h in heads if (info := self._files.get(ShardKey(namespace, c, h))) is not None
                          and not self._expired(info, now)] for c, heads in zip(chunks, found)]
        return found

    def _scan_chunk(self, namespace: str, chunk: str) -> list[HeadRange]:
        """Index the files of one chunk found on disk (written by another process since start)."""
        if not _HEX.fullmatch(namespace) or not _HEX.fullmatch(chunk):
            return []
        sub_fd = self._open_sub(namespace, chunk[:2], create=False)
        if sub_fd is None:
            return []
        heads = []
        try:
            with os.scandir(sub_fd) as it:
                names = [e.name for e in it if e.name.startswith(chunk) and e.is_file(follow_symlinks=False)]
            for name in names:
                key = self._parse_name(namespace, name)
                if key is None or key.chunk != chunk or name != _file_name(key):
                    continue  # an earlier-layout name: only start-up migrates those
                with self._lock:
                    known = key in self._files
                if not known and (info := self._stat(sub_fd, name)) is not None:
                    with self._lock:
                        if key not in self._files:  # another thread may have indexed it meanwhile
                            self._add_locked(key, info)
                    known = True
                if known:
                    heads.append(key.heads)
        except OSError as exc:
            raise TierError(f"{self.name}: cannot list {self.root / namespace / chunk[:2]}: {_reason(exc)}") \
                from exc
        finally:
            os.close(sub_fd)
        return heads

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        with self._lock:
            snapshot = [(k, dataclasses.replace(v)) for k, v in self._files.items()
                        if namespace is None or k.namespace == namespace]
        for key, info in snapshot:
            yield StoredObject(key, info.size, info.created, info.last_used)

    def used_bytes(self) -> int:
        return self._used

    def counters(self) -> dict[str, float]:
        return {"evictions": self.evictions, "share_evictions": self.share_evictions,
                "share_refused_writes": self.share_refused, "reserved_evictions": self.reserved_evictions,
                "expired": self.expired,
                "removed_temp_files": self.removed_temp_files, "rejected_files": self.rejected_files}
