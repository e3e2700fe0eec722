"""An append-only audit log of what removed stored KV: who, what, when, how many objects and bytes. Never prompt
content: only tier names, namespace ids, ages and counts.

One JSON object a line. Each line carries the SHA-256 of the line before it (``prev``; the first line's is 64
zeros), so a line edited, removed or inserted afterwards breaks the chain, which :func:`verify` finds. Writers
take an exclusive ``flock`` on the file, so two processes appending at once keep the chain whole; each line is
written with one ``write`` and ``fsync``ed before the call returns.
"""

from __future__ import annotations

import datetime
import fcntl
import getpass
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

GENESIS = "0" * 64
_TAIL_READ = 1 << 16  # bytes read back from the end to find the last line (a line is far shorter)


def _digest(line: bytes) -> str:
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


class AuditLog:
    """Appends records to ``path`` (created owner-only if missing)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def record(self, action: str, **fields: Any) -> dict[str, Any]:
        """Append one record; returns it. Raises ConfigError when the log cannot be written (the caller's action
        should then not be taken silently)."""
        entry: dict[str, Any] = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "who": {"user": _user(), "uid": os.getuid(), "host": socket.gethostname(), "pid": os.getpid()},
            "action": action, **fields}
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(f"audit_log: cannot open {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            entry["prev"] = _last_digest(fd)
            line = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
            os.write(fd, line)
            os.fsync(fd)
        except OSError as exc:
            raise ConfigError(f"audit_log: cannot append to {self.path}: {exc.strerror}") from None
        finally:
            os.close(fd)  # releases the lock
        return entry


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (e.g. in a container)
        return str(os.getuid())


def _last_digest(fd: int) -> str:
    size = os.fstat(fd).st_size
    if size == 0:
        return GENESIS
    start = max(0, size - _TAIL_READ)
    tail = os.pread(fd, size - start, start)
    lines = tail.rstrip(b"\n").split(b"\n")
    return _digest(lines[-1])


def verify(path: str | os.PathLike[str]) -> tuple[int, str | None]:
    """How many records ``path`` holds, and the first break in its chain (None when whole)."""
    prev = GENESIS
    count = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                entry = json.loads(line)
            except ValueError:
                return count, f"line {number} is not JSON"
            if not isinstance(entry, dict) or entry.get("prev") != prev:
                return count, f"line {number} does not follow line {number - 1} (edited, removed or inserted)"
            prev = _digest(line)
            count += 1
    return count, None
