"""The filesystem tier: one file per shard under a root directory, crash-safe and re-indexed on start.

Several processes may share one directory: each indexes it on start and finds chunks that others wrote later
when a lookup reaches them. Layout: ``ROOT/<namespace>/<chunk[:2]>/<chunk>.<heads>.<created>.kv``; temp files live in ``ROOT/.tmp`` named
after the writing process, so a restarted store removes only the leftovers of dead writers. Files are 0600 in
0700 directories. A write goes to a temp file (fsync'd when ``durability: fsync``) and is renamed into place,
so a reader sees a whole file or none; a crash leaves at most a temp file. Last use is the file's mtime, so
LRU order survives restarts; the creation time in the name drives the TTL.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from kvtier.errors import ConfigError, TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.tiers.base import TIERS, Buffer, StoredObject, Tier

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP_DIR = ".tmp"


@dataclasses.dataclass(frozen=True)
class FilesystemOptions:
    path: str
    capacity_bytes: int | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    ttl_seconds: float | None = None
    durability: Literal["none", "fsync"] = "none"

    def check(self, field: str) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(f"{field}.low_watermark/high_watermark: need 0 < low <= high <= 1, got "
                              f"{self.low_watermark} and {self.high_watermark}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ConfigError(f"{field}.capacity_bytes: must be positive, got {self.capacity_bytes}")
        if self.ttl_seconds is not None and self.ttl_seconds <= 0:
            raise ConfigError(f"{field}.ttl_seconds: must be positive, got {self.ttl_seconds}")


@dataclasses.dataclass
class _File:
    path: str  # a str, not a Path: building 100,000 Path objects dominated re-indexing
    size: int
    created: float
    last_used: float


def _mkdir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _unlink_quietly(path: Path) -> None:
    """Remove a file if possible; on a read-only or vanished directory there is nothing more to do."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@TIERS.register("filesystem")
class FilesystemTier(Tier):
    """Shards as files on a local filesystem (NVMe, or any POSIX filesystem with atomic rename)."""

    Options = FilesystemOptions
    persistent = True

    def __init__(self, name: str, options: FilesystemOptions) -> None:
        super().__init__(name, options)
        self.root = Path(options.path).expanduser()
        self._lock = threading.Lock()
        self._files: OrderedDict[ShardKey, _File] = OrderedDict()  # least recently used first
        self._by_chunk: dict[tuple[str, str], set[HeadRange]] = {}
        self._used = 0
        self.evictions = 0
        self.expired = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.root, 0o700)
            _mkdir(self.root / _TMP_DIR)
        except OSError as exc:
            raise TierError(f"{name}: cannot use directory {self.root}: {exc}") from exc
        self.removed_temp_files = self._clean_temp()
        self._reindex()
        with self._lock:
            self._expire_locked(time.time())
            self._enforce_capacity_locked()

    # -- start-up ----------------------------------------------------------------------------------------------
    def _clean_temp(self) -> int:
        removed = 0
        with os.scandir(self.root / _TMP_DIR) as it:
            for entry in it:
                pid = entry.name.partition(".")[0]
                if pid.isdigit() and _pid_alive(int(pid)):
                    continue  # a live process (this one included: another tier instance) may be writing it
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def _reindex(self) -> None:
        found: list[tuple[ShardKey, _File]] = []
        for ns_entry in os.scandir(self.root):
            if not ns_entry.is_dir() or ns_entry.name == _TMP_DIR:
                continue
            for sub in os.scandir(ns_entry.path):
                if not sub.is_dir():
                    continue
                for f in os.scandir(sub.path):
                    parsed = self._parse_name(ns_entry.name, f.name)
                    if parsed is None:
                        continue
                    key, created = parsed
                    try:
                        st = f.stat()
                    except FileNotFoundError:
                        continue
                    found.append((key, _File(f.path, st.st_size, created, st.st_mtime)))
        found.sort(key=lambda kf: kf[1].last_used)
        with self._lock:
            for key, info in found:
                self._add_locked(key, info)

    @staticmethod
    def _parse_name(namespace: str, name: str) -> tuple[ShardKey, float] | None:
        if not name.endswith(_SUFFIX):
            return None
        parts = name[:-len(_SUFFIX)].split(".")
        if len(parts) != 3:
            return None
        try:
            heads = HeadRange.parse(parts[1])
            created = int(parts[2]) / 1000
            bytes.fromhex(parts[0])
            bytes.fromhex(namespace)
        except ValueError:
            return None
        return ShardKey(namespace, parts[0], heads), created

    # -- index -------------------------------------------------------------------------------------------------
    def _add_locked(self, key: ShardKey, info: _File) -> None:
        old = self._files.pop(key, None)
        if old is not None:
            self._used -= old.size
        self._files[key] = info
        self._by_chunk.setdefault((key.namespace, key.chunk), set()).add(key.heads)
        self._used += info.size

    def _drop_locked(self, key: ShardKey) -> _File | None:
        info = self._files.pop(key, None)
        if info is None:
            return None
        self._used -= info.size
        heads = self._by_chunk.get((key.namespace, key.chunk))
        if heads is not None:
            heads.discard(key.heads)
            if not heads:
                del self._by_chunk[(key.namespace, key.chunk)]
        return info

    def _expired(self, info: _File, now: float) -> bool:
        return self.options.ttl_seconds is not None and now - info.created > self.options.ttl_seconds

    def _expire_locked(self, now: float) -> None:
        if self.options.ttl_seconds is None:
            return
        for key in [k for k, info in self._files.items() if self._expired(info, now)]:
            self._remove_locked(key)
            self.expired += 1

    def _enforce_capacity_locked(self) -> None:
        cap = self.options.capacity_bytes
        if cap is None or self._used <= cap * self.options.high_watermark:
            return
        target = cap * self.options.low_watermark
        while self._used > target and self._files:
            self._remove_locked(next(iter(self._files)))
            self.evictions += 1

    def _remove_locked(self, key: ShardKey) -> bool:
        info = self._drop_locked(key)
        if info is None:
            return False
        try:
            os.unlink(info.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("%s: cannot remove %s: %s", self.name, info.path, exc)
        return True

    # -- the tier interface ------------------------------------------------------------------------------------
    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        with self._lock:
            if key in self._files:
                return
        now = time.time()
        ns_dir = self.root / key.namespace
        sub_dir = ns_dir / key.chunk[:2]
        final = sub_dir / f"{key.chunk}.{key.heads}.{int(now * 1000)}{_SUFFIX}"
        tmp = self.root / _TMP_DIR / f"{os.getpid()}.{uuid.uuid4().hex}.part"
        size = 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb", buffering=0) as f:
                for part in parts:
                    size += f.write(part)
                if self.options.durability == "fsync":
                    os.fsync(f.fileno())
            _mkdir(ns_dir)
            _mkdir(sub_dir)
            os.rename(tmp, final)
            if self.options.durability == "fsync":
                dir_fd = os.open(sub_dir, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except BaseException as exc:
            _unlink_quietly(tmp)
            if isinstance(exc, OSError):
                raise TierError(f"{self.name}: cannot write {key.name}: "
                                f"{errno.errorcode.get(exc.errno or 0, '')} {exc}") from exc
            raise
        with self._lock:
            self._add_locked(key, _File(str(final), size, now, now))
            self._expire_locked(now)
            self._enforce_capacity_locked()

    def get(self, key: ShardKey) -> Buffer | None:
        now = time.time()
        with self._lock:
            info = self._files.get(key)
            if info is None:
                return None
            if self._expired(info, now):
                self._remove_locked(key)
                self.expired += 1
                return None
            self._files.move_to_end(key)
            info.last_used = now
        try:
            with open(info.path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf = np.empty(size, dtype=np.uint8)  # unlike bytearray, not zero-filled first
                got = f.readinto(buf)
                try:
                    os.utime(f.fileno())  # record the use: LRU order survives a restart
                except OSError:
                    pass  # e.g. a read-only filesystem: still a good read, only the order is not saved
        except FileNotFoundError:
            with self._lock:
                self._drop_locked(key)
            return None
        except OSError as exc:
            raise TierError(f"{self.name}: cannot read {info.path}: {exc}") from exc
        return memoryview(buf)[:got]

    def delete(self, key: ShardKey) -> bool:
        with self._lock:
            return self._remove_locked(key)

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
        try:
            entries = list(os.scandir(self.root / namespace / chunk[:2]))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise TierError(f"{self.name}: cannot list {self.root / namespace / chunk[:2]}: {exc}") from exc
        heads = []
        with self._lock:
            for entry in entries:
                if not entry.name.startswith(chunk):
                    continue
                parsed = self._parse_name(namespace, entry.name)
                if parsed is None or parsed[0].chunk != chunk:
                    continue
                key, created = parsed
                if key not in self._files:
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    self._add_locked(key, _File(entry.path, st.st_size, created, st.st_mtime))
                heads.append(key.heads)
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
        return {"evictions": self.evictions, "expired": self.expired, "removed_temp_files": self.removed_temp_files}
