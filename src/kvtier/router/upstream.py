"""The router's HTTP/1.1 client for the requests it sends engines (:class:`Upstreams`).

A proxied request's every step runs cold on a small machine (the engine's answer comes tens of milliseconds later,
after the caches forgot the code): the fewer the steps, the less the router adds (docs/benchmarks.md, "The router's
own client"). It does what sending a completion needs and no more: one ``POST`` with a body of known length (to the
engine URL's path and the request's), an answer framed by ``Content-Length``, ``chunked`` or the connection's end
(RFC 9112 6.3), ``1xx`` answers skipped, connections kept per origin while idle for under :data:`IDLE_S` (uvicorn,
vLLM's server, closes them at 5 s; older ones are closed as others are kept, and an engine's when it leaves) and
reused only when the last answer was read to its end with nothing after it. A connection dropped is aborted, with
whatever of the request is unsent. TLS (``https://``) verifies the engine's certificate. An answer broken or
framed in a way it does not read (a transfer coding other than ``chunked``, two lengths, a head over
:data:`MAX_HEAD` bytes, lines not ending in CRLF, a header line folded or with a control character) raises
:class:`UpstreamError`; redirects are the caller's to refuse (nothing is followed).
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import time
import urllib.parse
from collections import deque

from multidict import CIMultiDict, CIMultiDictProxy

from kvtier.router.guards import timeout

MAX_HEAD = 64 * 1024  # an answer's status line and headers, or a chunk's size line and the trailers
IDLE_S = 2.0  # a kept connection idle this long is closed, not reused
KEPT = 64  # idle connections kept per origin
_READ = 256 * 1024  # the most an answer's reader returns at once
_HIGH = 1024 * 1024  # bytes buffered from an engine before the socket stops being read
_STATUS = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9]{2})(?: [^\r\n\x00]*)?")
_TOKEN_CHARS = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"  # a header's name (RFC 9110 5.6.2)
_CONTROL = r"[\x00-\x08\x0a-\x1f\x7f]"  # not in a header's value (a tab is)
_TOKEN, _BAD_VALUE = re.compile(_TOKEN_CHARS.encode()), re.compile(_CONTROL.encode())  # read
_SEND_TOKEN, _SEND_BAD = re.compile(_TOKEN_CHARS), re.compile(_CONTROL)  # sent
_BARE_LF = re.compile(rb"(?<!\r)\n")
_TARGET = re.compile(r"/[\x21-\x7e]*")
_FRAMED = frozenset({"host", "content-length", "transfer-encoding", "connection"})  # set here, not by callers


class UpstreamError(Exception):
    """The engine's answer failed: the connection broke before its end, or it is not an answer read here."""


class ConnectionLost(UpstreamError):
    """The connection could not be made, or broke before the answer's head arrived whole."""


class _Connection(asyncio.Protocol):
    """One connection to an engine: the bytes it sent, waited on by the one answer reading them."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.ended = False  # the engine closed (or the connection broke)
        self.broken = False  # it broke (reset, not closed)
        self.idle_since = 0.0
        self.epoch = 0  # of its origin when it was opened (Upstreams.forget)
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not an asyncio.Transport subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH and not self._paused and self.transport is not None:
            self.transport.pause_reading()
            self._paused = True
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.broken = exc is not None
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _more(self) -> None:
        """Wait for bytes or the end (the caller checked there are none buffered it can use)."""
        if self._paused and self.transport is not None:  # it waits for more than is buffered: read on
            self.transport.resume_reading()
            self._paused = False
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self, n: int) -> bytes:
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        if self._paused and len(self.buffer) < _HIGH // 2 and self.transport is not None:
            self.transport.resume_reading()
            self._paused = False
        return data

    async def until(self, separator: bytes, what: str, lost: type[UpstreamError] = UpstreamError) -> bytes:
        """The bytes up to and including ``separator`` (at most :data:`MAX_HEAD` of them). Lines end in CRLF: an
        LF without its CR before ``separator`` raises."""
        start = 0
        while True:
            at = self.buffer.find(separator, start)
            # (each byte scanned once: from where the last scan ended, less the CR an LF may follow)
            if _BARE_LF.search(self.buffer, max(0, start - 1), at if at >= 0 else len(self.buffer)):
                raise UpstreamError(f"{what} with lines that do not end in CRLF")
            if at >= 0 and at <= MAX_HEAD:
                return self.take(at + len(separator))
            if len(self.buffer) > MAX_HEAD:
                raise UpstreamError(f"{what} over {MAX_HEAD} bytes")
            if self.ended:
                raise lost(f"the connection ended within {what}")
            start = max(0, len(self.buffer) - len(separator) + 1)
            await self._more()

    async def some(self, n: int) -> bytes:
        """Up to ``n`` bytes, as soon as there are any; empty at the connection's end."""
        while not self.buffer:
            if self.ended:
                return b""
            await self._more()
        return self.take(min(n, len(self.buffer)))

    def close(self) -> None:
        """Drop the connection at once, with whatever of the request is unsent (an engine that stopped reading
        would otherwise hold it)."""
        if self.transport is not None:
            self.transport.abort()
        self.ended = True

    @property
    def reusable(self) -> bool:
        return not self.ended and not self.buffer and self.transport is not None and not self.transport.is_closing()


class Answer:
    """An engine's answer: its status and headers, and its body as it comes (:meth:`readany`, :meth:`read`).
    :meth:`release` after reading it to the end keeps the connection for the next request; :meth:`close` drops it
    (which aborts the request in vLLM)."""

    def __init__(self, upstreams: Upstreams, origin: str, conn: _Connection, status: int,
                 headers: CIMultiDictProxy[str], framing: str, length: int, keep: bool) -> None:
        self.status = status
        self.headers = headers
        self._upstreams = upstreams
        self._origin = origin
        self._conn: _Connection | None = conn
        self._framing = framing  # length | chunked | close | none
        self._left = length  # of the body (length) or of the chunk being read (chunked)
        self._keep = keep
        self._crlf = False  # a chunk's data was read, its CRLF not yet (read with the next chunk's size)
        self._done = framing == "none" or (framing == "length" and length == 0)

    @property
    def content_type(self) -> str:
        """The media type, lowercase and without parameters (``application/octet-stream`` when not given)."""
        value = self.headers.get("Content-Type", "")
        return value.split(";", 1)[0].strip().lower() or "application/octet-stream"

    async def readany(self) -> bytes:
        """The body's next bytes, as soon as there are any; empty at its end. Raises :class:`UpstreamError` when the
        connection breaks before the end or the chunked framing is broken."""
        conn = self._conn
        if self._done or conn is None:
            return b""
        if self._framing == "close":
            data = await conn.some(_READ)
            if not data and conn.broken:
                raise UpstreamError("the connection broke before the answer's end")
            self._done = not data
            return data
        if self._framing == "chunked" and self._left == 0:
            if self._crlf and await conn.until(b"\r\n", "a chunk's end") != b"\r\n":
                raise UpstreamError("a chunk longer than its size")
            self._crlf = True
            self._left = await self._chunk_size(conn)
            if self._left == 0:
                await self._trailers(conn)
                self._done = True
                return b""
        data = await conn.some(min(self._left, _READ))
        if not data:
            raise UpstreamError(f"the connection ended {self._left} bytes before the answer's end")
        self._left -= len(data)
        if self._left == 0 and self._framing == "length":
            self._done = True
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while part := await self.readany():
            parts.append(part)
        return b"".join(parts)

    @staticmethod
    async def _chunk_size(conn: _Connection) -> int:
        line = await conn.until(b"\r\n", "a chunk's size line")
        size = line[:-2].split(b";", 1)[0].strip(b" \t")
        if not size or len(size) > 15 or not all(c in b"0123456789abcdefABCDEF" for c in size):
            raise UpstreamError(f"a chunk size that is not 1 to 15 hexadecimal digits: {line[:40]!r}")
        return int(size, 16)

    @staticmethod
    async def _trailers(conn: _Connection) -> None:
        read = 0
        while (line := await conn.until(b"\r\n", "the trailers")) != b"\r\n":
            read += len(line)
            if read > MAX_HEAD:
                raise UpstreamError(f"trailers over {MAX_HEAD} bytes")

    def release(self) -> None:
        """Done with the answer: its connection is kept when the body was read to its end, else closed."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep and conn.reusable:
            self._upstreams.keep(self._origin, conn)
        else:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class Upstreams:
    """Connections to engines, kept per origin (scheme, host, port) while idle (:data:`IDLE_S`, :data:`KEPT`)."""

    def __init__(self) -> None:
        self._idle: dict[str, deque[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False
        self._epochs: dict[str, int] = {}  # per origin, how many times it was forgotten

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str],
                   connect_s: float) -> Answer:
        """``POST`` ``body`` to ``url`` (the engine's base URL) + ``path`` (a request target: ``/`` and visible
        ASCII) with ``headers`` (end-to-end ones: ``Host``, ``Content-Length``, ``Transfer-Encoding`` and
        ``Connection`` are set here); the answer once its head has come. Raises :class:`ConnectionLost` when the
        connection could not be made within ``connect_s`` or broke before the head, :class:`UpstreamError` for an
        answer not read here, ValueError for a request that cannot be sent (a control character in a header, a
        target that is not one, credentials in ``url``)."""
        if self._closed:
            raise UpstreamError("the router is stopping")
        parts = urllib.parse.urlsplit(url)
        if parts.username is not None or parts.password is not None:
            raise ValueError("an engine URL with credentials (user:password@): they are not sent")
        if parts.query or parts.fragment:
            raise ValueError("an engine URL with a query or fragment")
        authority = _authority(parts)
        request = _request_head(authority, parts.path.rstrip("/") + path, headers, len(body))
        origin = f"{parts.scheme}://{authority}"
        kept = self._reuse(origin)
        if kept is None:
            conn = await self._connect(parts, connect_s)
            conn.epoch = self._epochs.get(origin, 0)
        else:
            conn = kept
        try:
            assert conn.transport is not None
            conn.transport.writelines((request, body))
            return await self._head(origin, conn)
        except ConnectionLost as exc:
            conn.close()
            if kept is not None:  # a kept connection the engine closed as it was reused: not the engine's failure
                raise UpstreamError(f"a kept connection ended: {exc}") from exc
            raise
        except BaseException:
            conn.close()
            raise

    def keep(self, origin: str, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, deque())
        now = time.monotonic()
        while idle and (now - idle[0].idle_since >= IDLE_S or not idle[0].reusable):  # the oldest first
            idle.popleft().close()
        if self._closed or len(idle) >= KEPT or conn.epoch != self._epochs.get(origin, 0):
            conn.close()  # (opened before its engine left: not kept after)
            return
        conn.idle_since = now
        idle.append(conn)

    def prune(self) -> None:
        """Close the connections kept past :data:`IDLE_S`, to every origin (one no request goes to any more too)."""
        now = time.monotonic()
        for origin, idle in list(self._idle.items()):
            while idle and now - idle[0].idle_since >= IDLE_S:
                idle.popleft().close()
            if not idle:
                del self._idle[origin]

    def forget(self, url: str) -> None:
        """Close the connections kept to ``url``'s origin (an engine that left the fleet), and never keep one
        opened before (its requests in flight end on theirs)."""
        parts = urllib.parse.urlsplit(url)
        origin = f"{parts.scheme}://{_authority(parts)}"
        self._epochs[origin] = self._epochs.get(origin, 0) + 1
        for conn in self._idle.pop(origin, ()):
            conn.close()

    def _reuse(self, origin: str) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recent: the others age out
            if conn.reusable and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, parts: urllib.parse.SplitResult, connect_s: float) -> _Connection:
        host = parts.hostname or ""
        tls = None
        if parts.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        port = parts.port or (443 if tls else 80)
        loop = asyncio.get_running_loop()
        try:
            async with timeout(connect_s):
                transport, conn = await loop.create_connection(_Connection, host, port, ssl=tls,
                                                               server_hostname=host if tls else None)
        except asyncio.TimeoutError:
            raise ConnectionLost(f"no connection within {connect_s} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectionLost(f"cannot connect: {type(exc).__name__}: {exc}") from exc
        conn.transport = transport  # (uvloop returns before it calls connection_made)
        return conn

    async def _head(self, origin: str, conn: _Connection) -> Answer:
        while True:
            head = await conn.until(b"\r\n\r\n", "the answer's head", ConnectionLost)
            lines = head[:-4].split(b"\r\n")
            status = _STATUS.fullmatch(lines[0])
            if status is None:
                raise UpstreamError(f"not an HTTP/1.x status line: {lines[0][:60]!r}")
            code = int(status[2])
            if code == 101:
                raise UpstreamError("the engine switched protocols unasked")
            if code >= 200:
                break  # (1xx: an interim answer; the final one follows)
        fields: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
                raise UpstreamError(f"a malformed header line: {line[:60]!r}")
            fields.add(name.decode("ascii"), value.strip(b" \t").decode("utf-8", "replace"))
        headers = CIMultiDictProxy(fields)
        framing, length, keep = _framing(code, headers)
        keep = keep and status[1] == b"1"
        return Answer(self, origin, conn, code, headers, framing, length, keep)

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _authority(parts: urllib.parse.SplitResult) -> str:
    """``host:port`` of a URL (an IPv6 address in brackets), without credentials."""
    host = parts.hostname or ""
    return (f"[{host}]" if ":" in host else host) + ("" if parts.port is None else f":{parts.port}")


def _request_head(authority: str, path: str, headers: dict[str, str], length: int) -> bytes:
    if not _TARGET.fullmatch(path):
        raise ValueError(f"not a request target: {path[:60]!r}")
    lines = [f"POST {path} HTTP/1.1", f"Host: {authority}"]
    for name, value in headers.items():
        if name.lower() in _FRAMED:
            continue
        if not _SEND_TOKEN.fullmatch(name) or _SEND_BAD.search(value):
            raise ValueError(f"a header that cannot be sent: {name[:60]!r}")
        lines.append(f"{name}: {value}")
    lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _framing(status: int, headers: CIMultiDictProxy[str]) -> tuple[str, int, bool]:
    """How the answer's body is framed (RFC 9112 6.3): (``none``, ``length``, ``chunked`` or ``close``, its length
    for ``length``, whether the connection may carry another request after it)."""
    tokens = {t.strip().lower() for v in headers.getall("Connection", ()) for t in v.split(",")}
    keep = "close" not in tokens
    if status in (204, 304):
        return "none", 0, keep
    codings = [t.strip().lower() for v in headers.getall("Transfer-Encoding", ()) for t in v.split(",") if t.strip()]
    if codings:
        if codings != ["chunked"]:
            raise UpstreamError(f"a transfer coding not read here: {', '.join(codings)[:60]}")
        return "chunked", 0, keep and "Content-Length" not in headers
    lengths = {n.strip() for v in headers.getall("Content-Length", ()) for n in v.split(",")}
    if not lengths:
        return "close", 0, False
    length = lengths.pop()
    if lengths or not length.isdigit() or not length.isascii() or len(length) > 15:
        raise UpstreamError("a Content-Length that is not one number")
    return "length", int(length), keep
