"""The stored format: one Redis hash per chunk, ``<key_prefix><namespace>:<chunk>``; each shard in that hash
under fields ``<heads>:<i>/<n>``, the object cut into ``n`` segments of at most ``segment_bytes``.

A shard is complete when every one of its ``n`` segments is present; fields that are not exactly kvtier's are
ignored.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvtier.keys import HeadRange
from kvtier.tiers.base import Buffer

# A shard's field: ``<heads>:<i>/<n>`` in ASCII digits (``int()`` alone would also take " 1", "+1" or "١").
_FIELD = re.compile(rb"([0-9]+-[0-9]+of[0-9]+):([0-9]{1,9})/([0-9]{1,9})")
HEX32 = re.compile(r"[0-9a-f]{32}")
FIELD_MAX = 64  # bytes of a field name get_into reads itself; one of ours is ``<a>-<b>of<n>:<i>/<n>``


def segments(parts: Sequence[Buffer], size: int) -> list[bytes | memoryview]:
    """Cut the concatenation of ``parts`` into pieces of at most ``size`` bytes, copying only where parts join."""
    out: list[bytes | memoryview] = []
    pending: list[memoryview] = []
    pending_len = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            take = min(len(view), size - pending_len)
            pending.append(view[:take])
            pending_len += take
            view = view[take:]
            if pending_len == size:
                out.append(pending[0] if len(pending) == 1 else b"".join(pending))
                pending, pending_len = [], 0
    if pending or not out:
        out.append(pending[0] if len(pending) == 1 else b"".join(pending))
    return out


def parse_field(field: bytes) -> tuple[HeadRange, int, int] | None:
    """``(heads, i, n)`` of a shard's field name, or None for a field that is not exactly one of ours."""
    match = _FIELD.fullmatch(field)
    if match is None:
        return None
    i, n = int(match[2]), int(match[3])
    if not 0 <= i < n:  # else a set of n fields could miss segment 0..n-1 and still count as complete
        return None
    try:
        return HeadRange.parse(match[1].decode("ascii")), i, n
    except ValueError:
        return None


def complete(fields: Sequence[bytes]) -> dict[HeadRange, list[bytes]]:
    """The shards whose every segment is present: head range -> field names in segment order."""
    seen: dict[tuple[HeadRange, int], dict[int, bytes]] = {}
    for field in fields:
        parsed = parse_field(field)
        if parsed is not None:
            heads, i, n = parsed
            seen.setdefault((heads, n), {})[i] = field
    return {heads: [segs[i] for i in range(n)] for (heads, n), segs in seen.items() if len(segs) == n}


def wrong_type(reply: object) -> bool:
    """Whether a reply is the server's WRONGTYPE error: the key holds a string, list, ... not a hash."""
    return isinstance(reply, Exception) and str(reply).startswith("WRONGTYPE")


def escape_glob(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
