"""What ``kvtier serve`` and ``kvtier doctor`` both ask of this host (whether a directory can be written, how much
memory is available) and how both show where a tier keeps its objects."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from kvtier.config import redact_url


def existing_base(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists: where a directory that is not there yet would be made."""
    base = path
    while not os.path.lexists(base) and base != base.parent:
        base = base.parent
    return base


def unwritable(path: Path) -> str | None:
    """Why this user cannot keep files in the directory ``path`` (made when missing), or None.

    Tried for real (a temporary file made and removed in ``path``, or in the ancestor it would be made in), not
    with ``os.access``: root passes every mode check but not a read-only or special filesystem.
    """
    base = existing_base(path)
    if not base.is_dir():
        return f"{base} is not a directory"
    try:
        fd, name = tempfile.mkstemp(prefix=".kvtier-probe-", dir=base)
    except OSError as exc:
        where = "it" if base == path else f"{base}, where it would be made,"
        return f"{where} is not writable by uid {os.geteuid()} ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(name)
    return None




def tier_location(options: Mapping[str, object]) -> str:
    """Where a tier (its options as configured) keeps its objects, as shown: its path, its URL without a password,
    or its bucket."""
    for name in ("path", "url", "bucket", "endpoint"):
        value = options.get(name)
        if isinstance(value, str) and value:
            return redact_url(value) if "://" in value else value
    return "its configured place"
