"""The one-segment read of :meth:`RedisTier.get_into`: RESP replies read straight from a connection's socket,
a shard's bytes landing in the caller's buffers (e.g. DRAM pages) with no reply object and no copy after it.

What this path does not read itself (a redirection, a shard in several segments, an error reply other than
WRONGTYPE) is :class:`Unexpected`, and the tier reads it through redis-py's own path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.errors import ObjectError, WrongSize
from kvtier.keys import HeadRange
from kvtier.tiers.redis.fields import FIELD_MAX, complete


class Unexpected(Exception):
    """A reply :meth:`RedisTier.get_into` does not read itself (a redirection, a shard in several segments):
    redis-py's own path reads the shard. ``in_step``: both replies were read whole, the connection may serve the
    next call; otherwise it is dropped."""

    def __init__(self, reason: str, *, in_step: bool = False) -> None:
        super().__init__(reason)
        self.in_step = in_step


class Replies:
    """Reads the RESP replies of a pipelined call straight from a connection's socket: reply lines through a small
    buffer, a bulk string's bytes straight into the caller's buffers (redis-py parses a reply into a bytes object
    of its own, at about 1 GB/s here, to be copied again). Any surprise leaves the connection unusable: the
    caller drops it."""

    _LINE_MAX = 1 << 16

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()

    @property
    def drained(self) -> bool:
        """Nothing read beyond the replies taken: the connection is in step for its next call."""
        return not self._buf

    def _fill(self) -> None:
        data = self._sock.recv(self._LINE_MAX)
        if not data:
            raise ConnectionError("the server closed the connection")
        self._buf += data

    def line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > self._LINE_MAX:
                raise Unexpected("a reply line longer than 64 KiB")
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[:end + 2]
        return line

    def bulk(self, limit: int) -> bytes | None:
        """A bulk string, or None for a null or one longer than ``limit`` bytes (read past: not one of ours);
        an error reply is raised."""
        size = self.length(self.line(), b"$")
        if size is None:
            return None
        if size > limit:
            self._skip(size)
            return None
        while len(self._buf) < size + 2:
            self._fill()
        value = bytes(self._buf[:size])
        self._end(size)
        return value

    def _skip(self, size: int) -> None:
        scratch = memoryview(bytearray(min(size, self._LINE_MAX)))
        left = size - min(size, len(self._buf))
        del self._buf[:size - left]
        while left:
            got = self._sock.recv_into(scratch[:min(left, len(scratch))])
            if not got:
                raise ConnectionError("the server closed the connection")
            left -= got
        self.end()

    def length(self, line: bytes, kind: bytes) -> int | None:
        """The length a reply line announces (``$`` bulk, ``*`` array), None for a null (RESP2 or RESP3)."""
        if line.startswith(b"-"):
            reply = line[1:].decode("utf-8", "replace")
            if reply.startswith("WRONGTYPE"):
                raise ObjectError(reply)
            raise Unexpected(reply)  # MOVED, ASK, LOADING, ...: redis-py's path knows what to do
        if line == b"_" or line == kind + b"-1":
            return None
        if not line.startswith(kind) or not line[1:].isdigit():
            raise Unexpected(f"an unexpected reply {line[:40]!r}")
        return int(line[1:])

    def into(self, parts: Sequence[memoryview]) -> None:
        """Fill each of ``parts`` in turn from the reply: what the line buffer holds, then the socket."""
        for part in parts:
            part = part.cast("B")  # counted in bytes, as the reply's length is
            take = min(len(part), len(self._buf))
            part[:take] = self._buf[:take]
            del self._buf[:take]
            while take < len(part):
                got = self._sock.recv_into(part[take:])
                if not got:
                    raise ConnectionError("the server closed the connection")
                take += got

    def _end(self, size: int) -> None:
        if self._buf[size:size + 2] != b"\r\n":
            raise Unexpected("a bulk reply not ended by CRLF")
        del self._buf[:size + 2]

    def end(self) -> None:
        while len(self._buf) < 2:
            self._fill()
        self._end(0)


def stream(replies: Replies, heads: HeadRange, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
    """Read the replies of ``HKEYS <hash>`` and ``HGET <hash> <heads>:0/1``: the shard's header, its payload
    written into ``payload``; None when the hash holds no such shard."""
    count = replies.length(replies.line(), b"*") or 0
    fields = [replies.bulk(FIELD_MAX) for _ in range(count)]
    single = f"{heads}:0/1".encode()
    shard = complete([f for f in fields if f is not None]).get(heads)
    size = replies.length(replies.line(), b"$")
    if shard is None and size is None:
        return None
    if shard != [single] or size is None:
        raise Unexpected("not a shard of one segment", in_step=size is None)
    want = header_len + sum(part.nbytes for part in payload)
    if size != want:
        raise WrongSize(f"{size} bytes, expected {want}", size)
    header = bytearray(header_len)
    replies.into([memoryview(header), *payload])
    replies.end()
    return bytes(header)
