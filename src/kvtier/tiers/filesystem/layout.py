"""The filesystem tier's directory: where each shard's file lies, and which directories and files it trusts.

Layout: ``ROOT/<namespace>/<chunk[:2]>/<chunk>.<heads>.kv``, one name per shard key: two processes writing one
chunk replace each other's file (rename is atomic) instead of leaving two. Temp files are in ``ROOT/.tmp``
(:mod:`.writes`), tenant share ledgers in ``ROOT/.shares`` (:mod:`kvtier.quotas.ledger`). Files of the
earlier layout, ``<chunk>.<heads>.<created ms>.kv``, migrate on start (:mod:`.walk`).

Trust. The configured path is resolved once at start (links in it, e.g. ``/tmp`` on macOS, are followed then)
and the root is held open; everything inside is reached from directory descriptors with ``O_NOFOLLOW``, so no
link inside the root is ever followed: a link as ``.tmp`` or ``.shares`` refuses the start, one as a namespace
or chunk directory is skipped, one with a shard's or a ledger's name is removed. The root and every directory in
it must belong to this process's uid and not be writable by group or other, else :class:`TierError` names it;
the tier never chmods a directory it did not create, and those it creates (missing parents of the root too)
are 0700 whatever the umask; files are 0600. Reads accept only regular files of at most ``min(8 GiB,
capacity_bytes)``; anything else (a FIFO, a link, a sparse giant) is a miss, removed and counted as
``rejected_files``. Not defended: the root's parents are trusted (whoever can rename them can redirect a later
start), and so is every process of this uid.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from kvtier import frame
from kvtier.errors import TierError
from kvtier.keys import HeadRange, ShardKey

log = logging.getLogger(__name__)

TMP_DIR = ".tmp"
SHARES_DIR = ".shares"  # one ledger per tenant share (kvtier.quotas.ledger)
# <chunk>.<heads>.kv, or the earlier <chunk>.<heads>.<created ms>.kv (group 3) that start-up migrates.
_FILE_NAME = re.compile(r"((?:[0-9a-f]{2})+)\.(\d+-\d+of\d+)(?:\.(\d+))?\.kv")
HEX = re.compile(r"(?:[0-9a-f]{2})+")  # a namespace directory (".tmp" is not one)
SUB = re.compile(r"[0-9a-f]{2}")  # a chunk directory
MAX_OBJECT_BYTES = 8 * 2**30  # far above any KV shard; a larger file is garbage, never worth allocating
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO must not hang us


class Rejected(Exception):
    """A file where a shard should be is not one we will read (its reason is the message)."""


@functools.lru_cache(maxsize=256)
def _parse_heads(text: str) -> HeadRange | None:
    """A file name's head range; cached, as a directory holds a handful of distinct ones 100,000 times."""
    try:
        return HeadRange.parse(text)
    except ValueError:
        return None


def file_name(key: ShardKey) -> str:
    return f"{key.chunk}.{key.heads}.kv"


def parse_name(namespace: str, name: str) -> ShardKey | None:
    """The key a file name in ``namespace`` stands for (this layout's or the earlier one's); None if not ours."""
    match = _FILE_NAME.fullmatch(name)
    if match is None:
        return None
    heads = _parse_heads(match[2])
    return None if heads is None else ShardKey(namespace, match[1], heads)


def header_created(head: bytes | memoryview, now: float) -> float | None:
    """The creation time in an object's header; None when the bytes are not a kvtier header."""
    try:
        created = frame.decode_header(head).created
    except frame.FrameError:
        return None
    # The header is checksummed, not signed: never let it postpone the TTL beyond now or forever.
    return min(created, now) if math.isfinite(created) else None


def reason(exc: OSError) -> str:
    """What went wrong, naming the path when the error carries one."""
    if exc.errno == errno.ELOOP:
        why = "is a symbolic link, which the tier never follows inside its root"
    elif exc.errno == errno.ENOTDIR:
        why = "is not a directory"
    else:
        why = f"{errno.errorcode.get(exc.errno or 0, '')} {exc.strerror}"
    return f"{exc.filename}: {why}" if exc.filename else why


@contextlib.contextmanager
def raised_as_tier_error(tier: str, where: str) -> Iterator[None]:
    """An OSError inside (a directory unreadable, a disk error) raised as a TierError naming ``where``."""
    try:
        yield
    except OSError as exc:
        raise TierError(f"{tier}: cannot remove {where}: {reason(exc)}") from exc


def unlink_quietly(name: str, dir_fd: int) -> None:
    """Remove a directory entry (a link itself, never its target) if possible; a vanished one is fine."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


class Layout:
    """One tier's root directory, held open, and the directories and files under it (``tier``: its name, in
    messages). ``rejected_files``: files found where a shard should be and removed, not being ones we read."""

    def __init__(self, tier: str, root: Path, max_object: int) -> None:
        self.tier = tier
        self.root = root
        self.max_object = max_object
        self.uid = os.geteuid()
        self.root_fd = self.tmp_fd = self.shares_fd = -1
        self.rejected_files = 0
        self._lock = threading.Lock()

    def open(self) -> None:
        """Open the root (creating what is missing), its temp and its ledgers' directories."""
        self.root_fd = self._open_root()
        self.tmp_fd = self.open_dir(self.root_fd, TMP_DIR, f"{self.root}/{TMP_DIR}", create=True)
        self.shares_fd = self.open_dir(self.root_fd, SHARES_DIR, f"{self.root}/{SHARES_DIR}", create=True)

    def close(self) -> None:
        for fd in (self.root_fd, self.tmp_fd, self.shares_fd):
            if fd >= 0:
                os.close(fd)
        self.root_fd = self.tmp_fd = self.shares_fd = -1  # a stale number could name another directory later

    def _open_root(self) -> int:
        """Open the root, creating missing directories one by one (0700 whatever the umask)."""
        base, missing = self.root, []
        while not os.path.lexists(base):
            missing.append(base.name)
            base = base.parent
        if not missing:
            return self.open_dir(None, str(self.root), str(self.root), create=False)
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # a parent: trusted, see above
        for name in reversed(missing):
            base = base / name
            try:
                child = self.open_dir(fd, name, str(base), create=True)
            finally:
                os.close(fd)
            fd = child
        return fd

    def open_dir(self, parent_fd: int | None, name: str, where: str, *, create: bool) -> int:
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
            if st.st_uid != self.uid:
                raise TierError(f"{self.tier}: refusing directory {where}: owned by uid {st.st_uid}, not by "
                                f"this process's uid {self.uid}")
            if st.st_mode & 0o022:
                raise TierError(f"{self.tier}: refusing directory {where}: writable by group or other (mode "
                                f"{stat.S_IMODE(st.st_mode):o}); make it 0700 or choose another path")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_sub(self, namespace: str, sub: str, *, create: bool) -> int | None:
        """``ROOT/<namespace>/<sub>``; None when absent, or a link (never followed), and not to be created."""
        if not HEX.fullmatch(namespace) or not SUB.fullmatch(sub):  # e.g. "..": never a path out of the root
            raise TierError(f"{self.tier}: {namespace!r}/{sub!r} is not a namespace id and chunk directory")
        try:
            ns_fd = self.open_dir(self.root_fd, namespace, f"{self.root}/{namespace}", create=create)
            try:
                return self.open_dir(ns_fd, sub, f"{self.root}/{namespace}/{sub}", create=create)
            finally:
                os.close(ns_fd)
        except OSError as exc:
            if create or exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise
            if exc.errno != errno.ENOENT:
                log.warning("%s: skipping %s", self.tier, reason(exc))
            return None

    def subdirs(self, parent_fd: int, where: str, names: re.Pattern[str]) -> Iterator[tuple[str, int]]:
        """The directories under ``parent_fd`` named like ours, each open while the caller uses it."""
        with os.scandir(parent_fd) as it:
            entries = [e for e in it if names.fullmatch(e.name)]
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                log.warning("%s: skipping %s/%s: not a directory (links are never followed)", self.tier,
                            where, entry.name)
                continue
            try:
                fd = self.open_dir(parent_fd, entry.name, f"{where}/{entry.name}", create=False)
            except FileNotFoundError:  # removed since it was listed (a purge's, once empty)
                continue
            try:
                yield entry.name, fd
            finally:
                os.close(fd)

    def open_shard(self, dir_fd: int, name: str) -> tuple[int, os.stat_result]:
        """A descriptor and the status of a shard file; :class:`Rejected` when it is not one we would read."""
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link, a socket; not EMFILE, EIO...
                raise Rejected(reason(exc)) from exc
            raise
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size <= self.max_object:
            return fd, st
        os.close(fd)
        raise Rejected("not a regular file" if not stat.S_ISREG(st.st_mode) else
                       f"{st.st_size} bytes, more than the {self.max_object} a shard may have")

    def reject(self, dir_fd: int, name: str, why: str) -> None:
        """Remove what lies where a shard should be and is not one we read; counted as ``rejected_files``."""
        log.warning("%s: removing %s (%s)", self.tier, name, why)
        unlink_quietly(name, dir_fd)
        with self._lock:
            self.rejected_files += 1

    def remove_file(self, key: ShardKey) -> None:
        """Unlink ``key``'s file, if there is one."""
        sub_fd = self.open_sub(key.namespace, key.chunk[:2], create=False)
        if sub_fd is not None:
            try:
                os.unlink(file_name(key), dir_fd=sub_fd)
            finally:
                os.close(sub_fd)

    def remove_namespace(self, namespace: str) -> int:
        """``ROOT/<namespace>`` and its chunk directories, where empty (1: the namespace's went); a link or a name
        that is not a namespace id is left alone."""
        if not HEX.fullmatch(namespace):
            return 0
        where = f"{self.root}/{namespace}"
        with raised_as_tier_error(self.tier, where):
            try:
                ns_fd = self.open_dir(self.root_fd, namespace, where, create=False)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):  # gone, or not ours to follow
                    return 0
                raise
            try:
                with os.scandir(ns_fd) as it:
                    subs = [e.name for e in it if SUB.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
                for sub in subs:
                    self.rmdir_if_empty(ns_fd, sub, f"{where}/{sub}")
            finally:
                os.close(ns_fd)
            return self.rmdir_if_empty(self.root_fd, namespace, where)

    def rmdir_if_empty(self, parent_fd: int, name: str, where: str) -> int:
        """1 if the directory was removed; 0 if it is not empty (a file written meanwhile) or gone already;
        TierError on anything else."""
        try:
            os.rmdir(name, dir_fd=parent_fd)
            return 1
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                return 0
            raise TierError(f"{self.tier}: cannot remove {where}: {reason(exc)}") from exc
