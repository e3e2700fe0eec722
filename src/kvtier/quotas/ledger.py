"""Share ledgers of a filesystem tier: how the processes sharing one directory count each tenant share together.

:class:`~kvtier.quotas.index.IndexShares` counts a share from the tier's index; this module tells the tier when
another process changed the share's files, and which namespaces every process counts against which share. Two small
files per share in ``ROOT/.shares`` (0600, never followed if a link, refused unless a regular file of this uid):
``<digest of the share>.lock``, only ever locked, never replaced; and the ledger, ``<digest of the share>``::

    <16 hex digits: a token, drawn anew at every change of the share's files or namespaces>
    <20 digits: the share's quota in bytes, as the last process to add a namespace configured it>
    <namespace>                       (one line per namespace counted against the share)

A put into a share holds ``flock(LOCK_EX)`` on the lock file (and a thread lock: a flock belongs to an open file,
which a process's threads share) from its quota check to its rename. Before its first change (an eviction, the
rename, a new line) it writes a token no process saw, and after the last one it draws the token it then knows: a
process killed in between leaves a token the others do not know. A holder that finds a token it did not draw
(or the ledger replaced) lists the share's namespaces on disk again before it counts, so the count is the
directory's, whichever process wrote each file; it reads the ledger again only when the token changed. A removal
outside a put (TTL, a purge, capacity, a bad file) draws a new token without the lock: if a concurrent put's token
overwrites it, that process counts the removed file until the share changes again, an over-count (the share then
holds less than its quota, never more).

A namespace joins the ledger at its first put into the share, under the lock the put holds anyway (telling the
tier of a share takes no lock). The ledger stays small: once it names twice as many namespaces as at its last
compaction (and at least :data:`_COMPACT_MIN`), the holder rewrites it with only the namespaces that hold files
(a live namespace has a file in the share, so they number at most the share's files). A rewrite (compaction, a
purge's removal) is written aside and renamed over the ledger, so a crash leaves the old ledger or the new, never
a mix; the others notice the new file at their next hold. If a ledger of namespaces that all hold files reaches
:data:`_MAX_BYTES`, a new namespace's put is refused rather than the ledger growing.
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
from collections.abc import Callable, Iterator

from kvtier.errors import TierError

_TOKEN_LEN = 16
_QUOTA_AT, _QUOTA_LEN = _TOKEN_LEN + 1, 20
_HEADER_LEN = _QUOTA_AT + _QUOTA_LEN + 1
_MAX_BYTES = 4 * 2**20  # some 120,000 namespaces with files: past this a new namespace is refused
_COMPACT_MIN = 256  # namespaces a ledger names before its first compaction
_LOCK_SUFFIX, _NEW_SUFFIX = ".lock", ".new"  # the share's lock file; a rewrite's file before its rename
_NAME = re.compile(r"[0-9a-f]{32}")  # a share digest (a ledger) or a namespace id (a line)
_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO must not hang us


@dataclasses.dataclass
class Hold:
    """What a put holding a ledger learns (``stale``: another process changed the share since this one last
    counted it; the put clears it once it has counted the share again) and says (``changed``: it removed or wrote
    one of the share's files, or changed the ledger: set by :meth:`Ledger.changing`)."""

    stale: bool
    changed: bool = False


class Ledger:
    """One share's ledger file, open for as long as the tier is."""

    def __init__(self, dir_fd: int, sid: str, uid: int, *, create: bool) -> None:
        self.sid = sid
        self.quota = 0
        self.namespaces: frozenset[str] = frozenset()
        self._dir_fd, self._uid = dir_fd, uid
        self._lock = threading.Lock()  # one holder per process
        self._fd_lock = threading.Lock()  # the descriptor, which a holder moves to a replaced ledger
        self._seen = b""  # the token this process last drew or listed the share at
        self._loaded = b""  # the token of the content last read
        self._expect = b""  # the token the holder found or last wrote
        self._lost = False  # a removal's token was overwritten during this hold
        self._holding = self._touched = False  # a put of this process holds it; a file went meanwhile
        self._compact_at = _COMPACT_MIN
        self._fd = _open(dir_fd, sid, uid, create=create)
        try:
            self._lock_fd = _open(dir_fd, sid + _LOCK_SUFFIX, uid, create=True)
        except BaseException:
            os.close(self._fd)
            raise
        if os.fstat(self._fd).st_size < _HEADER_LEN:  # new (or torn by a crash): write the header
            with self._flocked():
                self._current_locked()
        self.reload()

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lock_fd = -1

    def _token(self) -> bytes:
        with self._fd_lock:
            return os.pread(self._fd, _TOKEN_LEN, 0)

    def _write_token(self, token: bytes) -> None:
        with self._fd_lock:
            os.pwrite(self._fd, token, 0)

    def _replaced(self) -> bool:
        """Whether the ledger at the path is no longer the file this process has open (a compaction replaced it)."""
        try:
            st = os.stat(self.sid, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        with self._fd_lock:
            mine = os.fstat(self._fd)
        return (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev)

    def _current_locked(self) -> bool:
        """Holding the flock: the descriptor on the ledger at the path (made anew if gone), with a header; True
        when it had to move or the header was missing (the content is then new to this process)."""
        moved = self._replaced()
        if moved:
            fd = _open(self._dir_fd, self.sid, self._uid, create=True)
            with self._fd_lock:
                os.close(self._fd)
                self._fd = fd
        if os.fstat(self._fd).st_size < _HEADER_LEN:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, _new_token() + b"\n" + b"0".zfill(_QUOTA_LEN) + b"\n", 0)
            moved = True
        return moved

    def stale(self) -> bool:
        """Whether another process changed the share since this one last looked (no lock: a hint)."""
        return self._replaced() or self._token() != self._seen

    def touch(self) -> None:
        """Say that one of the share's files went, without the lock (see the module docstring); while a put of
        this process holds the share, its new token at the end says it."""
        if self._holding:
            self._touched = True
        else:
            self._write_token(_new_token())

    @contextlib.contextmanager
    def _flocked(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def held(self) -> Iterator[Hold]:
        """The share to this caller alone, across threads and processes, until the block ends."""
        with self._lock, self._flocked():
            moved = self._current_locked()
            found = self._token()
            hold = Hold(stale=moved or found != self._seen)
            if moved or found != self._loaded:
                self._read()
            self._expect, self._lost = found, False
            ok, self._holding, self._touched = False, True, False
            try:
                yield hold
                ok = True
            finally:
                self._holding = False
                counted = ok and not hold.stale  # else the next holder of this process counts the share again
                if hold.changed or self._touched:
                    # A removal's token landed meanwhile (see touch): leave it unseen, so the share is listed again.
                    mine = not self._lost and self._token() == self._expect
                    drawn = _new_token()
                    self._write_token(drawn)
                    self._loaded = drawn if ok else b""  # no other process changed the content meanwhile
                    if counted and mine:
                        self._seen = drawn
                elif counted:
                    self._seen = found

    def changing(self, hold: Hold) -> None:
        """Before the hold's first change: a token no process knows, so that one killed before its last token
        still tells the others the share changed."""
        if hold.changed:
            return
        if self._token() != self._expect:
            self._lost = True
        self._expect = _new_token()
        self._write_token(self._expect)
        hold.changed = True

    def joined(self, hold: Hold, namespace: str, quota: int, with_files: Callable[[frozenset[str]], set[str]]) -> bool:
        """Count ``namespace`` against the share in every process, with this process's quota, for a caller that
        holds the ledger; ``with_files`` names those of some namespaces that hold files (for a compaction). False:
        the ledger is full of namespaces that hold files, and ``namespace`` is not one of them."""
        if quota != self.quota:
            self.changing(hold)
            with self._fd_lock:
                os.pwrite(self._fd, str(quota).encode().zfill(_QUOTA_LEN), _QUOTA_AT)
            self.quota = quota
        line = namespace.encode() + b"\n"
        if len(self.namespaces) >= self._compact_at or os.fstat(self._fd).st_size + len(line) > _MAX_BYTES:
            kept = frozenset(with_files(self.namespaces)) | ({namespace} & self.namespaces)
            self._compact_at = max(_COMPACT_MIN, 2 * len(kept))
            self._rewrite(hold, kept)
        if namespace in self.namespaces:
            return True
        if os.fstat(self._fd).st_size + len(line) > _MAX_BYTES:
            return False
        self.changing(hold)
        with self._fd_lock:
            os.pwrite(self._fd, line, os.fstat(self._fd).st_size)
        self.namespaces = self.namespaces | {namespace}
        return True

    def leave(self, namespace: str) -> None:
        """Stop counting ``namespace`` (purged) against the share; the ledger names it no more."""
        with self.held() as hold:
            if namespace in self.namespaces:
                self._rewrite(hold, self.namespaces - {namespace})

    def _rewrite(self, hold: Hold, namespaces: frozenset[str]) -> None:
        """Replace the ledger by one naming ``namespaces``: written aside, then renamed over it (a crash leaves
        one or the other, never a mix; the other processes move to it at their next hold)."""
        self.changing(hold)
        content = b"".join([self._expect, b"\n", str(self.quota).encode().zfill(_QUOTA_LEN), b"\n",
                            *(ns.encode() + b"\n" for ns in sorted(namespaces))])
        new = self.sid + _NEW_SUFFIX
        with contextlib.suppress(FileNotFoundError):
            os.unlink(new, dir_fd=self._dir_fd)  # a crashed rewrite's (under the flock: no live one)
        fd = os.open(new, _FLAGS | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self._dir_fd)
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view):]
            os.rename(new, self.sid, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(new, dir_fd=self._dir_fd)
            raise
        with self._fd_lock:
            os.close(self._fd)
            self._fd = fd
        self.namespaces = namespaces

    def reload(self) -> None:
        """Read the quota and namespaces again if the ledger changed since (no lock: a ledger replaced since is
        read at its path; the descriptor moves to it at the next hold)."""
        if not self._replaced():
            if self._token() != self._loaded:
                self._read()
            return
        try:
            fd = _open(self._dir_fd, self.sid, self._uid, create=False)
        except FileNotFoundError:
            return
        try:
            self._parse(fd)
        finally:
            os.close(fd)

    def _read(self) -> None:
        with self._fd_lock:
            self._loaded = self._parse(self._fd)

    def _parse(self, fd: int) -> bytes:
        """Read the quota and namespaces (a torn line, from a crash, is skipped); the token read with them."""
        data = os.pread(fd, max(os.fstat(fd).st_size, _HEADER_LEN), 0)
        lines = data.decode("ascii", "replace").split("\n")
        with contextlib.suppress(IndexError, ValueError):
            self.quota = int(lines[1])
        self.namespaces = frozenset(line for line in lines[2:] if _NAME.fullmatch(line))
        return data[:_TOKEN_LEN]


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
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
                return fd
            os.close(fd)
        os.unlink(name, dir_fd=dir_fd)  # not a ledger we wrote: whoever put it there may not steer the count
    raise OSError(errno.EEXIST, "keeps being replaced by something that is not a ledger", name)
