"""Reads of a shard's file: at most one byte past the indexed size, straight into the caller's buffers.

A key fixes its object's size, so a longer file is damaged, and the store's check (the checksum in
:mod:`kvtier.frame`) only needs to see that. A file that is not one we read is a miss, removed and counted
(:meth:`Layout.reject`); reading records the use in the file's mtime, so LRU order survives a restart.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from kvtier.errors import ObjectError, TierError, WrongSize
from kvtier.keys import ShardKey
from kvtier.tiers.filesystem.layout import Layout, Rejected, file_name

_T = TypeVar("_T")
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
Reader = Callable[[int, os.stat_result, int], _T]  # read(fd, its status, the size indexed)


def read_fully(fd: int, buffers: Sequence[memoryview], pos: int | None = None) -> int:
    """Fill ``buffers`` in order from ``fd`` (``readv`` until they are full or the file ends; from byte ``pos``
    with ``preadv``, leaving the file's offset alone); bytes read."""
    total, left = 0, [b for b in buffers if len(b)]
    while left:
        # a DRAM entry of many extents: more buffers than one call takes
        n = os.readv(fd, left[:_IOV_MAX]) if pos is None else os.preadv(fd, left[:_IOV_MAX], pos + total)
        if n == 0:
            break
        total += n
        while left and n >= len(left[0]):
            n -= len(left[0])
            left.pop(0)
        if n:
            left[0] = left[0][n:]
    return total


def whole(fd: int, st: os.stat_result, indexed: int) -> memoryview:
    """The file in a new buffer (not zero-filled first), at most one byte past ``indexed``."""
    buf = np.empty(min(st.st_size, indexed + 1), dtype=np.uint8)
    view = buf.data
    return view[:read_fully(fd, [view])]


def head(nbytes: int) -> Reader[bytes]:
    """The file's first ``nbytes`` bytes (fewer where it is shorter)."""
    def read(fd: int, st: os.stat_result, indexed: int) -> bytes:
        buf = bytearray(min(nbytes, st.st_size))
        return bytes(buf[:read_fully(fd, [memoryview(buf)])])
    return read


def into(tier: str, key: ShardKey, header_len: int, payload: Sequence[memoryview]) -> Reader[bytes]:
    """A reader of one ``readv`` into a small header buffer and the caller's payload buffers (e.g. DRAM pages):
    no read buffer, no copy after it. It returns the header."""
    want = header_len + sum(len(part) for part in payload)

    def parts(fd: int, st: os.stat_result, indexed: int) -> bytes:
        header = bytearray(header_len)
        if st.st_size != want or read_fully(fd, [memoryview(header), *payload]) != want:
            raise WrongSize(f"{tier}: {key.name} is {st.st_size} bytes, expected {want}", st.st_size)
        return bytes(header)

    return parts


class FileRanges:
    """A shard's file kept open for reads of its payload in pieces (:meth:`Tier.open_ranges`)."""

    def __init__(self, tier: str, key: ShardKey, fd: int, header: bytes, payload_len: int) -> None:
        self._tier, self._key, self._fd = tier, key, fd
        self.header, self.payload_len = header, payload_len

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        want = sum(len(b) for b in buffers)
        if not 0 <= offset <= self.payload_len - want:
            raise ValueError(f"{want} bytes from {offset} are beyond the payload's {self.payload_len}")
        try:
            got = read_fully(self._fd, buffers, len(self.header) + offset)
        except OSError as exc:
            raise TierError(f"{self._tier}: cannot read {self._key.name}: {exc.strerror or exc}") from exc
        if got != want:
            raise ObjectError(f"{self._tier}: {self._key.name} ended {want - got} bytes early while it was read")

    def close(self) -> None:
        os.close(self._fd)


def ranges(tier: str, key: ShardKey, header_len: int, payload_len: int) -> Reader[FileRanges]:
    """A reader that reads the header and keeps the file open (a descriptor of its own) for the payload's pieces;
    a file of another size than ``header_len + payload_len`` is malformed."""

    def opened(fd: int, st: os.stat_result, indexed: int) -> FileRanges:
        header = os.pread(fd, header_len, 0)
        if st.st_size != header_len + payload_len or len(header) != header_len:
            raise WrongSize(f"{tier}: {key.name} is {st.st_size} bytes, expected {header_len + payload_len}",
                            st.st_size)
        return FileRanges(tier, key, os.dup(fd), header, payload_len)

    return opened


def read_shard(disk: Layout, key: ShardKey, indexed: int, read: Reader[_T], use: bool = True) -> _T | None:
    """``read`` on ``key``'s file; None when it is not there, or not a file we read (then removed). ``use``: its
    time of last use is set to now (the LRU order a restart finds)."""
    sub_fd = disk.open_sub(key.namespace, key.chunk[:2], create=False)
    if sub_fd is None:
        return None
    name = file_name(key)
    try:
        fd, st = disk.open_shard(sub_fd, name)
        try:
            data = read(fd, st, indexed)
            try:
                if use:
                    os.utime(fd)  # record the use: LRU order survives a restart
            except OSError:
                pass  # e.g. a read-only filesystem: still a good read, only the order is not saved
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except Rejected as exc:
        disk.reject(sub_fd, name, str(exc))
        return None
    finally:
        os.close(sub_fd)
    return data
