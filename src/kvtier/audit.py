"""An append-only audit log of what removed stored KV: who, what, when, how many objects and bytes. Never prompt
content: only tier names, namespace ids, ages and counts.

One JSON object a line. Each line carries the SHA-256 of the line before it (``prev``; the first line's is 64
zeros), so a line edited, removed or inserted afterwards breaks the chain, which :func:`verify` finds. The
chain's head (how many lines, and the last line's digest) is kept beside the log in ``<log>.head``, so an edited,
cut or deleted end of the log is found too. Writers take an exclusive ``flock`` on the log, so processes
appending at once keep the chain whole; each line is written whole and ``fsync``ed before the call returns.
Whoever can rewrite both files can rebuild a consistent chain: ship the log off the host for that.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import pwd
import socket
import stat
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

GENESIS = "0" * 64


def _digest(line: bytes) -> str:
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


def open_log(path: str | os.PathLike[str]) -> int:
    """The log's file descriptor, opened for appending: created owner-only, never through a symlink, and refused
    when it is not a regular file of this user's that only this user can read and write."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
        os.close(open_log(self.path))  # refused now, before the caller removes anything

    def record(self, action: str, **fields: Any) -> dict[str, Any]:
        """Append one record; returns it. Raises ConfigError when the log cannot be written."""
        entry: dict[str, Any] = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "who": {"user": _user(), "uid": os.geteuid(), "host": socket.gethostname(), "pid": os.getpid()},
            "action": action, **fields}
        fd = open_log(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            count, prev = _tail(fd)
            entry["prev"] = prev
            line = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
            _write_all(fd, line)
            os.fsync(fd)
            _write_head(self.head, count + 1, _digest(line))
        except OSError as exc:
            raise ConfigError(f"audit_log: cannot append to {self.path}: {exc.strerror}") from None
        finally:
            os.close(fd)  # releases the lock
        return entry


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name  # not $USER, which the caller sets
    except KeyError:  # no passwd entry for this uid (e.g. in a container)
        return str(os.geteuid())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _tail(fd: int) -> tuple[int, str]:
    """How many whole lines the log holds, and the last one's digest. A line left unfinished by a crash is ended
    first (it stays in the log, and fails verification as what it is)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0, GENESIS
    data = os.pread(fd, size, 0)
    if not data.endswith(b"\n"):
        _write_all(fd, b"\n")
        data += b"\n"
    lines = data.rstrip(b"\n").split(b"\n")
    return len(lines), _digest(lines[-1])


def _write_head(path: Path, count: int, digest: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        _write_all(fd, json.dumps({"records": count, "last": digest}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def verify(path: str | os.PathLike[str]) -> tuple[int, str | None]:
    """How many records ``path`` holds, and the first break in its chain or at its end (None when whole)."""
    prev = GENESIS
    count = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # not half an append, and the head that goes with what is read
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        try:
            head = json.loads(Path(f"{path}.head").read_text())
        except (OSError, ValueError):
            head = None
    finally:
        os.close(fd)
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            return count, f"line {number} is not a record"
        if not isinstance(entry, dict) or entry.get("prev") != prev:
            return count, f"line {number} does not follow line {number - 1} (edited, removed or inserted)"
        prev = _digest(line)
        count += 1
    if head is None:
        return count, f"its head ({path}.head) is missing or unreadable"
    if head != {"records": count, "last": prev}:
        return count, (f"it ends after {count} records, its head says {head.get('records')}: its end was edited, "
                       "cut or appended to outside kvtier")
    return count, None
