"""Share ledgers of a filesystem tier: how the processes sharing one directory count each tenant share together.

:class:`~kvtier.tiers._shares.Shares` counts a share from the tier's index; this module tells the tier when another
process changed the share's files, and which namespaces every process counts against which share. One small file
per share, ``ROOT/.shares/<digest of the share>`` (0600, never followed if a link, refused unless a regular file
of this uid), holds::

    <16 hex digits: a token, drawn anew at every change of the share's files or namespaces>
    <20 digits: the share's quota in bytes, as the last process to add a namespace configured it>
    <namespace>                       (one line per namespace counted against the share)

A put into a share holds ``flock(LOCK_EX)`` on the share's ledger (and a thread lock: a flock belongs to an open
file, which a process's threads share) from its quota check to its rename, then draws a new token. A holder that
finds a token it neither drew nor saw lists the share's namespaces on disk again before it counts, so the count
is the directory's, whichever process wrote each file, at the cost of one listing of the share's directories
per put that follows another process's. A removal outside a put (TTL, a purge, capacity, a bad file) draws a
new token without the lock: if a concurrent put's token overwrites it, that process counts the removed file until
the share changes again, an over-count (the share then holds less than its quota, never more).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import re
import stat
import threading
from collections.abc import Iterator

from kvtier.errors import TierError

_TOKEN_LEN = 16
_QUOTA_AT, _QUOTA_LEN = _TOKEN_LEN + 1, 20
_HEADER_LEN = _QUOTA_AT + _QUOTA_LEN + 1
_MAX_BYTES = 4 * 2**20  # some 120,000 namespaces: a larger file is not ours
_NAME = re.compile(r"[0-9a-f]{32}")  # a share digest (a ledger) or a namespace id (a line)
_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO must not hang us


@dataclasses.dataclass
class Hold:
    """What a put holding a ledger learns (``stale``: another process changed the share since this one last
    counted it; the put clears it once it has counted the share again) and says (``changed``: it removed or wrote
    one of the share's files, or changed the ledger)."""

    stale: bool
    changed: bool = False


class Ledger:
    """One share's ledger file, open for as long as the tier is."""

    def __init__(self, dir_fd: int, sid: str, uid: int, *, create: bool) -> None:
        self.sid = sid
        self.quota = 0
        self.namespaces: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._seen = b""  # the token this process last drew or listed the share at
        self._holding = self._touched = False  # a put of this process holds it; a file went meanwhile
        self._fd = _open(dir_fd, sid, uid, create=create)
        if os.fstat(self._fd).st_size < _HEADER_LEN:  # new (or torn by a crash): write the header
            with self._flocked():
                if os.fstat(self._fd).st_size < _HEADER_LEN:
                    os.ftruncate(self._fd, 0)
                    os.pwrite(self._fd, _new_token() + b"\n" + b"0".zfill(_QUOTA_LEN) + b"\n", 0)
        self.reload()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def _token(self) -> bytes:
        return os.pread(self._fd, _TOKEN_LEN, 0)

    def stale(self) -> bool:
        """Whether another process changed the share since this one last looked (no lock: a hint)."""
        return self._token() != self._seen

    def touch(self) -> None:
        """Say that one of the share's files went, without the lock (see the module docstring); while a put of
        this process holds the share, its new token at the end says it."""
        if self._holding:
            self._touched = True
        else:
            os.pwrite(self._fd, _new_token(), 0)

    @contextlib.contextmanager
    def _flocked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def held(self) -> Iterator[Hold]:
        """The share to this caller alone, across threads and processes, until the block ends."""
        with self._lock, self._flocked():
            found = self._token()
            hold = Hold(stale=found != self._seen)
            if hold.stale:
                self.reload()
            ok, self._holding, self._touched = False, True, False
            try:
                yield hold
                ok = True
            finally:
                self._holding = False
                counted = ok and not hold.stale  # else the next holder of this process counts the share again
                if hold.changed or self._touched:
                    drawn = _new_token()
                    # A removal's token landed meanwhile (see touch): leave it unseen, so the share is listed again.
                    mine = self._token() == found
                    os.pwrite(self._fd, drawn, 0)
                    if counted and mine:
                        self._seen = drawn
                elif counted:
                    self._seen = found

    def join(self, namespace: str, quota: int) -> None:
        """Count ``namespace`` against the share in every process, with this process's quota."""
        if namespace in self.namespaces and quota == self.quota:
            return
        with self.held() as hold:
            self.joined(hold, namespace, quota)

    def joined(self, hold: Hold, namespace: str, quota: int) -> None:
        """:meth:`join` for a caller that holds the ledger already."""
        if namespace not in self.namespaces:
            os.lseek(self._fd, 0, os.SEEK_END)
            os.write(self._fd, namespace.encode() + b"\n")
            hold.changed = True
        if quota != self.quota:
            os.pwrite(self._fd, str(quota).encode().zfill(_QUOTA_LEN), _QUOTA_AT)
            hold.changed = True
        self.reload()

    def leave(self, namespace: str) -> None:
        """Stop counting ``namespace`` (purged) against the share; the ledger names it no more."""
        with self.held() as hold:
            self.reload()
            if namespace not in self.namespaces:
                return
            head = os.pread(self._fd, _HEADER_LEN, 0)
            rest = b"".join(ns.encode() + b"\n" for ns in sorted(self.namespaces - {namespace}))
            os.pwrite(self._fd, head + rest, 0)
            os.ftruncate(self._fd, len(head) + len(rest))
            hold.changed = True
            self.reload()

    def reload(self) -> None:
        """Read the quota and namespaces again (a torn line, from a crash, is skipped)."""
        lines = os.pread(self._fd, _MAX_BYTES, 0).decode("ascii", "replace").split("\n")
        with contextlib.suppress(IndexError, ValueError):
            self.quota = int(lines[1])
        self.namespaces = frozenset(line for line in lines[2:] if _NAME.fullmatch(line))


class Ledgers:
    """The ledgers in one ``.shares`` directory (open as ``dir_fd``, checked by the tier)."""

    def __init__(self, dir_fd: int, uid: int, where: str) -> None:
        self._dir_fd, self._uid, self._where = dir_fd, uid, where
        self._open: dict[str, Ledger] = {}
        self._lock = threading.Lock()
        self._listed = -1  # the directory's mtime at the last listing

    def of(self, sid: str) -> Ledger:
        """The share's ledger, created if new."""
        with self._lock:
            ledger = self._open.get(sid)
            if ledger is None:
                ledger = self._open[sid] = self._opened(sid, create=True)
            return ledger

    def get(self, sid: str) -> Ledger | None:
        with self._lock:
            return self._open.get(sid)

    def refresh(self) -> list[Ledger]:
        """Every share's ledger, the directory listed again if a share was added since, each re-read if changed."""
        with self._lock:
            mtime = os.fstat(self._dir_fd).st_mtime_ns
            if mtime != self._listed:
                with os.scandir(self._dir_fd) as it:
                    names = [e.name for e in it if _NAME.fullmatch(e.name) and e.name not in self._open]
                for name in names:
                    with contextlib.suppress(FileNotFoundError):
                        self._open[name] = self._opened(name, create=False)
                self._listed = mtime
            ledgers = list(self._open.values())
        for ledger in ledgers:
            ledger.reload()
        return ledgers

    def _opened(self, sid: str, *, create: bool) -> Ledger:
        try:
            return Ledger(self._dir_fd, sid, self._uid, create=create)
        except FileNotFoundError:
            raise  # gone (or not a ledger, now removed) while not to be created
        except OSError as exc:
            raise TierError(f"cannot open share ledger {self._where}/{sid}: {exc.strerror}") from exc

    def close(self) -> None:
        with self._lock:
            for ledger in self._open.values():
                ledger.close()
            self._open.clear()


def _new_token() -> bytes:
    return os.urandom(_TOKEN_LEN // 2).hex().encode()


def _open(dir_fd: int, name: str, uid: int, *, create: bool) -> int:
    """A ledger's descriptor: only a regular file of ``uid`` that others cannot write (anything else in its place
    is removed, and made anew when ``create``)."""
    for _ in range(2):
        try:
            fd = os.open(name, _FLAGS | (os.O_CREAT if create else 0), 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
        else:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022 and st.st_size <= _MAX_BYTES:
                return fd
            os.close(fd)
        os.unlink(name, dir_fd=dir_fd)  # not a ledger we wrote: whoever put it there may not steer the count
    raise OSError(errno.EEXIST, "keeps being replaced by something that is not a ledger", name)
