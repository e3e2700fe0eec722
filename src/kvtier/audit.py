"""An append-only audit log of what removed stored KV: who, what, when, how many objects and bytes. Never prompt
content: only tier names, namespace ids, ages and counts.

One JSON object a line. Each line carries the SHA-256 of the line before it (``prev``; the first line's is 64
zeros), so a line edited, removed or inserted afterwards breaks the chain, which :func:`verify` finds. The
chain's head (how many lines, and the last line's digest) is kept beside the log in ``<log>.head``, so an edited,
cut or deleted end of the log is found too. Writers take an exclusive ``flock`` on the log, so processes
appending at once keep the chain whole; each line is written whole and ``fsync``ed before the call returns.

Who can write the log's directory can delete the log and its head or put a forged pair in their place, so a
directory another user may write (group or other write, or another owner than this uid or root) is refused, by
writers and by :func:`verify` alike, and so are a log or head another user owns or may write. Nothing that is
not a regular file is opened for reading or writing (a FIFO would block, a link would lead elsewhere).

A writer appends only when the head counts the log's whole records, or trails them by one (a crash between an
append and the head's update); it brings the head up to them before it appends, so a crash mid-append leaves an
unfinished last line after records the head counts: :func:`verify` reports it, and the next record cuts it
(saying how many bytes it cut) and keeps the chain. Any other disagreement (a cut, an edited or a removed end, a
missing or untrusted head) is refused, by writers as by :func:`verify`, so no record rebuilds the head over it. A
record that fails leaves no line. Whoever can rewrite both files (this uid, root) can rebuild a consistent chain,
or append one record as if a crash had left it: ship the log off the host for that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import pwd
import re
import secrets
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

GENESIS = "0" * 64
_HEAD_MAX_BYTES = 4096  # a head is ~100 bytes: anything larger is not one of ours
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO opens at once, and is refused


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found: how many records the chain holds whole, its first break (None when whole), and
    notes on what a crash left that the next record mends."""

    records: int
    broken: str | None = None
    notes: tuple[str, ...] = ()


def _digest(line: bytes) -> str:
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


@dataclasses.dataclass(frozen=True)
class _Tail:
    """The log's whole records as the head sees them: how many, the digests of the last and the one before, where
    they end, and how many bytes of an unfinished line follow them."""

    records: int
    last: str
    before: str
    end: int
    torn: int


def _tail(data: bytes) -> _Tail:
    end = data.rfind(b"\n") + 1
    lines = data[:end].split(b"\n")[:-1]
    digests = [GENESIS, GENESIS] + [_digest(line) for line in lines[-2:]]
    return _Tail(len(lines), digests[-1], digests[-2], end, len(data) - end)


def _disagreement(tail: _Tail, head: dict[str, Any] | None, head_problem: str | None, head_where: str) -> str | None:
    """Why the head and the log's whole records disagree; None when it counts them all (or, with no head, there
    are none) or trails them by one record with nothing after it (a crash between an append and the head's
    update). A writer appends only when this is None: it never rebuilds a head over an end cut or removed."""
    if head_problem is not None:
        return head_problem
    if head is None:
        return None if tail.records == 0 else f"its head ({head_where}) is missing"
    if head == {"records": tail.records, "last": tail.last}:
        return None
    if tail.records >= 1 and head == {"records": tail.records - 1, "last": tail.before}:
        return None if not tail.torn else (f"an unfinished last line follows a record its head ({head_where}) "
                                           "does not count: not what one crash leaves")
    return (f"it ends after {tail.records} records, its head says {head['records']}: its end was edited, cut or "
            "appended to outside kvtier")


def _trusted() -> tuple[int, int]:
    return os.geteuid(), 0


def open_dir(path: str | os.PathLike[str]) -> int:
    """The log's directory, opened; refused (ConfigError) when another user may write into it."""
    where = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"audit_log: cannot open directory {where}: {exc.strerror}") from None
    info = os.fstat(fd)
    problem = None
    if info.st_uid not in _trusted():
        problem = f"owned by uid {info.st_uid}, not by this process's uid {os.geteuid()} or root"
    elif info.st_mode & 0o022:
        problem = f"writable by group or other (mode {stat.S_IMODE(info.st_mode):o}); make it 0700 or 0755"
    if problem is not None:
        os.close(fd)
        raise ConfigError(f"audit_log: refusing directory {where}: {problem}: whoever may write there can delete "
                          "or replace the log")
    return fd


def _open_log(dir_fd: int, path: Path) -> int:
    """The log's file descriptor, opened for appending: created owner-only, never through a symlink, and refused
    when it is not a regular file of this user's that only this user can read and write."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path.name, flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        kind = _not_regular(dir_fd, path.name, str(path))
        raise ConfigError(f"audit_log: {kind or f'cannot open {path}: {exc.strerror}'}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise ConfigError(f"audit_log: {path} must be a regular file owned by uid {os.geteuid()} with no group or "
                          f"other access (mode {stat.S_IMODE(info.st_mode):o})")
    return fd


class AuditLog:
    """Appends records to ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.head = Path(f"{path}.head")
        self._temp = re.compile(re.escape(self.head.name) + r"\.[0-9a-f]{16}\.tmp")
        with self._opened() as (dir_fd, fd):  # refused now, before the caller removes anything
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._agreed(dir_fd, fd)

    @contextlib.contextmanager
    def _opened(self) -> Iterator[tuple[int, int]]:
        dir_fd = open_dir(self.path)
        try:
            fd = _open_log(dir_fd, self.path)
            try:
                yield dir_fd, fd
            finally:
                os.close(fd)  # releases the lock
        finally:
            os.close(dir_fd)

    def _agreed(self, dir_fd: int, fd: int) -> tuple[_Tail, dict[str, Any] | None]:
        """The log's whole records and its head, read under the caller's lock; ConfigError when they disagree."""
        tail = _tail(os.pread(fd, os.fstat(fd).st_size, 0))
        head, problem = _read_head(dir_fd, self.head.name, str(self.head))
        why = _disagreement(tail, head, problem, str(self.head))
        if why is not None:
            raise ConfigError(f"audit_log: {self.path}: log and head disagree ({why}); run `kvtier cache audit`. "
                              "Nothing is appended to a log whose end cannot be checked")
        return tail, head

    def record(self, action: str, **fields: Any) -> dict[str, Any]:
        """Append one record; returns it. Raises ConfigError when the log cannot be written, or when it and its
        head disagree (see :func:`verify`); a record that fails leaves no line."""
        entry: dict[str, Any] = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "who": {"user": _user(), "uid": os.geteuid(), "host": socket.gethostname(), "pid": os.getpid()},
            "action": action, **fields}
        with self._opened() as (dir_fd, fd):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                tail, head = self._agreed(dir_fd, fd)
                self._remove_stale_temps(dir_fd)
                if tail.torn:  # a crash mid-append, after records the head counts
                    os.ftruncate(fd, tail.end)
                    entry["torn_tail_cut"] = tail.torn  # the chain says what a crash left and this append removed
                if head != {"records": tail.records, "last": tail.last}:
                    # missing (a new log) or a record behind: counted up first, so that a crash during this
                    # append leaves a head that counts every whole record (what lets the next record cut it)
                    _write_head(dir_fd, self.head.name, tail.records, tail.last)
                    os.fsync(dir_fd)
                entry["prev"] = tail.last
                line = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
                try:
                    _write_all(fd, line)
                    os.fsync(fd)
                    _write_head(dir_fd, self.head.name, tail.records + 1, _digest(line))
                except OSError:
                    with contextlib.suppress(OSError):  # the head does not count it: take the line back
                        os.ftruncate(fd, tail.end)
                        os.fsync(fd)
                    raise
                os.fsync(dir_fd)  # after the head's rename: a failure here leaves a whole record, not a torn one
            except OSError as exc:
                raise ConfigError(f"audit_log: cannot append to {self.path}: {exc.strerror}") from None
        return entry

    def _remove_stale_temps(self, dir_fd: int) -> None:
        """Heads a crashed writer left half-written: under the log's lock no writer is writing one. Only regular
        files are removed, and one that cannot be is left: a temp name is fresh each time, so none is in the way."""
        for name in os.listdir(dir_fd):
            if self._temp.fullmatch(name):
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.lstat(name, dir_fd=dir_fd).st_mode):
                        os.unlink(name, dir_fd=dir_fd)


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name  # not $USER, which the caller sets
    except KeyError:  # no passwd entry for this uid (e.g. in a container)
        return str(os.geteuid())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_head(dir_fd: int, name: str, count: int, digest: str) -> None:
    """Replace the head through a temp file of a fresh name: nothing planted under a fixed name is opened. The
    caller fsyncs the directory."""
    tmp = f"{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            _write_all(fd, json.dumps({"records": count, "last": digest}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _untrusted(info: os.stat_result, where: str) -> str | None:
    """Why a file another user made or may rewrite is not evidence (None when it is)."""
    if not stat.S_ISREG(info.st_mode):
        return f"{where} is not a regular file"
    if info.st_uid not in _trusted():
        return f"{where} is owned by uid {info.st_uid}, not by uid {os.geteuid()} or root"
    if info.st_mode & 0o022:
        return f"{where} is writable by group or other (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _not_regular(dir_fd: int, name: str, where: str) -> str | None:
    """What ``name`` is when it is there and not a regular file (a link, a socket: ENXIO, ELOOP), else None."""
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except OSError:
        return None
    if stat.S_ISLNK(mode):
        return f"{where} is a symbolic link"
    return None if stat.S_ISREG(mode) else f"{where} is not a regular file"


def _open_evidence(dir_fd: int, name: str, where: str) -> tuple[int | None, str | None]:
    """``name`` opened for reading, or why it is not evidence; (None, None) when it does not exist."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        kind = _not_regular(dir_fd, name, where)
        if kind is not None:
            return None, kind
        raise ConfigError(f"audit_log: cannot read {where}: {exc.strerror}") from None
    problem = _untrusted(os.fstat(fd), where)
    if problem is not None:
        os.close(fd)
        return None, problem
    return fd, None


def _read_head(dir_fd: int, name: str, where: str) -> tuple[dict[str, Any] | None, str | None]:
    """The head, or why it cannot be trusted (a missing head is (None, None))."""
    fd, problem = _open_evidence(dir_fd, name, where)
    if fd is None:
        return None, problem
    try:
        data = os.read(fd, _HEAD_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        head = json.loads(data)
    except ValueError:
        head = None
    if (not isinstance(head, dict) or set(head) != {"records", "last"} or not isinstance(head["records"], int)
            or len(data) > _HEAD_MAX_BYTES):
        return None, f"its head ({where}) is unreadable"
    return head, None


def verify(path: str | os.PathLike[str]) -> Verdict:
    """Check the log's chain and head. Raises ConfigError for a directory another user may write or an I/O
    error; a log or head another user owns or may write, or that is not a regular file, is a break."""
    try:
        return _verify(path)
    except OSError as exc:
        raise ConfigError(f"audit_log: cannot read {path}: {exc.strerror}") from None


def _verify(path: str | os.PathLike[str]) -> Verdict:
    head_where = f"{path}.head"
    dir_fd = open_dir(path)
    try:
        fd, problem = _open_evidence(dir_fd, Path(path).name, str(path))
        if fd is None:
            if problem is not None:
                return Verdict(0, problem)
            try:
                os.stat(Path(head_where).name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return Verdict(0)  # nothing recorded yet: only a user this process trusts could delete both
            return Verdict(0, f"the log is gone, its head ({head_where}) is not")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # not half an append, and the head that goes with what is read
            data = os.pread(fd, os.fstat(fd).st_size, 0)
            head, head_problem = _read_head(dir_fd, Path(head_where).name, head_where)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return _check(data, head, head_problem, head_where)


def _check(data: bytes, head: dict[str, Any] | None, head_problem: str | None, head_where: str) -> Verdict:
    whole = _tail(data)
    prev = GENESIS
    count = 0
    broken = None
    for number, line in enumerate(data[:whole.end].split(b"\n")[:-1], start=1):
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            broken = f"line {number} is not a record"
            break
        if not isinstance(entry, dict) or entry.get("prev") != prev:
            broken = f"line {number} does not follow line {number - 1} (edited, removed or inserted)"
            break
        prev = _digest(line)
        count += 1
    if broken is None:
        broken = _disagreement(whole, head, head_problem, head_where)
    notes = []
    if whole.torn:
        notes.append(f"an unfinished last line of {whole.torn} bytes after record {whole.records}" + (
            "" if broken else " (a crash mid-append): the next record cuts it"))
    if broken is None and head is not None and head != {"records": count, "last": prev}:
        notes.append("its head trails by one record (a crash between an append and the head's update): the next "
                     "record updates it")
    return Verdict(count, broken, tuple(notes))
