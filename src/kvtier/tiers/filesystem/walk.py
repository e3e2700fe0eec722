"""Walks of the filesystem tier's directory: what files it holds, found on disk, for the index.

Several processes may share one directory: each walks it on start (and, with a capacity or TTL, again every
``rescan_seconds``), and finds chunks that others wrote later when a lookup reaches them. A walk leaves one file
per key: files of the earlier layout migrate (the newest per key is renamed, the rest go). A file without a
valid header (the store rejects it when read) counts its mtime as its creation time.

The walks return plain entries; the tier applies them to its index under its lock.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

from kvtier import frame
from kvtier.errors import TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.tiers.filesystem.index import FileEntry
from kvtier.tiers.filesystem.layout import HEX, SUB, Layout, Rejected, file_name, header_created, parse_name, \
    reason, unlink_quietly

_TIMESTAMP_STEP_NS = 10**9  # a directory's mtime step on any local filesystem we run on (ext3: 1 s)
Found = list[tuple[ShardKey, FileEntry]]


def stat_shard(disk: Layout, dir_fd: int, name: str) -> FileEntry | None:
    """Size and times of a shard file, or None (and removed, when it is not one we would read)."""
    try:
        fd, st = disk.open_shard(dir_fd, name)
    except FileNotFoundError:
        return None
    except Rejected as exc:
        disk.reject(dir_fd, name, str(exc))
        return None
    try:
        created = header_created(os.pread(fd, frame.MAX_HEADER_LEN, 0), time.time())
    finally:
        os.close(fd)
    return FileEntry(st.st_size, st.st_mtime if created is None else created, st.st_mtime)


def walk(disk: Layout) -> Found:
    """Every shard file under the root (one per key, earlier names migrated)."""
    found: Found = []
    for ns, ns_fd in disk.subdirs(disk.root_fd, str(disk.root), HEX):
        for sub, sub_fd in disk.subdirs(ns_fd, f"{disk.root}/{ns}", SUB):
            found += _index_dir(disk, ns, sub, sub_fd)
    return found


def _index_dir(disk: Layout, namespace: str, sub: str, sub_fd: int) -> Found:
    """Index one chunk directory, leaving one file per key (the newest; earlier-layout names migrate)."""
    by_key: dict[ShardKey, list[str]] = {}
    with os.scandir(sub_fd) as it:
        for entry in it:
            key = parse_name(namespace, entry.name)
            if key is None or key.chunk[:2] != sub:
                continue
            if entry.is_file(follow_symlinks=False):
                by_key.setdefault(key, []).append(entry.name)
            elif not entry.is_dir(follow_symlinks=False):
                disk.reject(sub_fd, entry.name, "not a regular file")
    found = []
    for key, names in by_key.items():
        stats = [(name, info) for name in names if (info := stat_shard(disk, sub_fd, name)) is not None]
        if not stats:
            continue
        newest, info = max(stats, key=lambda ni: ni[1].created)
        final = file_name(key)
        if newest != final:
            try:
                os.rename(newest, final, src_dir_fd=sub_fd, dst_dir_fd=sub_fd)
            except FileNotFoundError:
                continue  # another process starting beside us migrated this key first
        for name, _ in stats:
            if name not in (newest, final):
                unlink_quietly(name, sub_fd)
        found.append((key, info))
    return found


def scan_chunk(disk: Layout, namespace: str, chunk: str, known: Callable[[ShardKey], bool],
               index: Callable[[ShardKey, FileEntry], None]) -> list[HeadRange]:
    """The head ranges of one chunk found on disk (written by another process since start): ``known`` says
    whether the index holds a key; those it lacks are handed to ``index``."""
    if not HEX.fullmatch(namespace) or not HEX.fullmatch(chunk):
        return []
    sub_fd = disk.open_sub(namespace, chunk[:2], create=False)
    if sub_fd is None:
        return []
    heads = []
    try:
        with os.scandir(sub_fd) as it:
            names = [e.name for e in it if e.name.startswith(chunk) and e.is_file(follow_symlinks=False)]
        for name in names:
            key = parse_name(namespace, name)
            if key is None or key.chunk != chunk or name != file_name(key):
                continue  # an earlier-layout name: only start-up migrates those
            found = known(key)
            if not found and (info := stat_shard(disk, sub_fd, name)) is not None:
                index(key, info)
                found = True
            if found:
                heads.append(key.heads)
    except OSError as exc:
        raise TierError(f"{disk.tier}: cannot list {disk.root / namespace / chunk[:2]}: {reason(exc)}") from exc
    finally:
        os.close(sub_fd)
    return heads


class ListedDirs:
    """The chunk directories of shares as this process last listed them (their mtimes), so a recount lists only
    those changed since (a timestamp step of at most 1 s is assumed)."""

    def __init__(self) -> None:
        self._mtimes: dict[tuple[str, str], int] = {}

    def unchanged(self, namespace: str, sub: str, sub_fd: int) -> bool:
        """Whether a chunk directory is as this process last listed it: its mtime is the one seen then, and was
        older than that listing by more than a filesystem's timestamp step, so no change since can share it (as
        git tells a racily clean file). Else it is about to be listed: its mtime is kept when that is safe."""
        mtime, now = os.fstat(sub_fd).st_mtime_ns, time.time_ns()
        if self._mtimes.get((namespace, sub)) == mtime:
            return True
        if now - mtime > _TIMESTAMP_STEP_NS:
            self._mtimes[(namespace, sub)] = mtime
        else:
            self._mtimes.pop((namespace, sub), None)
        return False


def namespace_files(disk: Layout, namespace: str, counted: set[ShardKey],
                    listed: ListedDirs) -> tuple[dict[ShardKey, FileEntry | None], set[str]]:
    """``namespace``'s files found on disk (``counted``: those indexed, found as None) and the chunk directories
    left unlisted, unchanged since their last listing here."""
    where = f"{disk.root}/{namespace}"
    found: dict[ShardKey, FileEntry | None] = {}  # None: indexed already
    unchanged: set[str] = set()
    try:
        ns_fd = disk.open_dir(disk.root_fd, namespace, where, create=False)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            raise
        return found, unchanged  # gone (purged), or not ours to follow: none of its files count
    try:
        for sub, sub_fd in disk.subdirs(ns_fd, where, SUB):
            if listed.unchanged(namespace, sub, sub_fd):
                unchanged.add(sub)
                continue
            with os.scandir(sub_fd) as it:
                names = [e.name for e in it if e.is_file(follow_symlinks=False)]
            for name in names:
                key = parse_name(namespace, name)
                if key is not None and name == file_name(key):
                    found[key] = None if key in counted else stat_shard(disk, sub_fd, name)
    finally:
        os.close(ns_fd)
    return found, unchanged
