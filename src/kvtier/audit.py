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
not a regular file is opened for reading or writing (a FIFO would block, a link would lead elsewhere). A crash
mid-append leaves an unfinished last line: :func:`verify` reports it, and the next record cuts it (saying how many
bytes it cut) and keeps the chain. Whoever can rewrite both files can rebuild a consistent chain: ship the log
off the host for that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
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
        raise ConfigError(f"audit_log: cannot open {path}: {exc.strerror}") from None
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
        with self._opened():  # refused now, before the caller removes anything
            pass

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

    def record(self, action: str, **fields: Any) -> dict[str, Any]:
        """Append one record; returns it. Raises ConfigError when the log cannot be written."""
        entry: dict[str, Any] = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "who": {"user": _user(), "uid": os.geteuid(), "host": socket.gethostname(), "pid": os.getpid()},
            "action": action, **fields}
        with self._opened() as (dir_fd, fd):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                count, prev, torn = _tail(fd)
                if torn:
                    entry["torn_tail_cut"] = torn  # the chain says what a crash left and this append removed
                entry["prev"] = prev
                line = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
                _write_all(fd, line)
                os.fsync(fd)
                self._remove_stale_temps(dir_fd)
                _write_head(dir_fd, self.head.name, count + 1, _digest(line))
            except OSError as exc:
                raise ConfigError(f"audit_log: cannot append to {self.path}: {exc.strerror}") from None
        return entry

    def _remove_stale_temps(self, dir_fd: int) -> None:
        """Heads a crashed writer left half-written: under the log's lock no writer is writing one."""
        for name in os.listdir(dir_fd):
            if self._temp.fullmatch(name):
                with contextlib.suppress(FileNotFoundError):
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


def _tail(fd: int) -> tuple[int, str, int]:
    """How many whole lines the log holds, the last one's digest, and how many bytes of an unfinished line (a
    crash mid-append) followed them: those are cut, so the next line follows the last whole record."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0)
    end = data.rfind(b"\n") + 1
    if end < size:
        os.ftruncate(fd, end)
    lines = data[:end].split(b"\n")[:-1]
    return len(lines), (_digest(lines[-1]) if lines else GENESIS), size - end


def _write_head(dir_fd: int, name: str, count: int, digest: str) -> None:
    """Replace the head through a temp file of a fresh name: nothing planted under a fixed name is opened."""
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
    os.fsync(dir_fd)


def _untrusted(info: os.stat_result, where: str) -> str | None:
    """Why a file another user made or may rewrite is not evidence (None when it is)."""
    if not stat.S_ISREG(info.st_mode):
        return f"{where} is not a regular file"
    if info.st_uid not in _trusted():
        return f"{where} is owned by uid {info.st_uid}, not by uid {os.geteuid()} or root"
    if info.st_mode & 0o022:
        return f"{where} is writable by group or other (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _open_evidence(dir_fd: int, name: str, where: str) -> tuple[int | None, str | None]:
    """``name`` opened for reading, or why it is not evidence; (None, None) when it does not exist."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, f"{where} is a symbolic link"
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
    end = data.rfind(b"\n") + 1
    notes = []
    if end < len(data):
        whole = data[:end].count(b"\n")
        notes.append(f"an unfinished last line of {len(data) - end} bytes after record {whole} (a crash "
                     "mid-append): the next record cuts it")
    before = prev = GENESIS
    count = 0
    for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            return Verdict(count, f"line {number} is not a record", tuple(notes))
        if not isinstance(entry, dict) or entry.get("prev") != prev:
            return Verdict(count, f"line {number} does not follow line {number - 1} (edited, removed or inserted)",
                           tuple(notes))
        before, prev = prev, _digest(line)
        count += 1
    if head_problem is not None:
        return Verdict(count, head_problem, tuple(notes))
    if head is None:
        return Verdict(count, None if count == 0 else f"its head ({head_where}) is missing", tuple(notes))
    if head == {"records": count - 1, "last": before}:
        notes.append("its head trails by one record (a crash between an append and the head's update): the next "
                     "record updates it")
    elif head != {"records": count, "last": prev}:
        return Verdict(count, f"it ends after {count} records, its head says {head['records']}: its end was "
                              "edited, cut or appended to outside kvtier", tuple(notes))
    return Verdict(count, None, tuple(notes))
