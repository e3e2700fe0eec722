"""What bounds a client's hold on the router (``limits`` in the config), in the router's one event loop.

- :class:`WorkerPool`: a request's CPU work (parsing its body, tokenizing, keying) runs on a few threads, not on
  the event loop (but a short completion's, :meth:`kvtier.router.reading.Reader.cheap`); at most ``workers`` run
  and ``queue`` wait, and one more is turned away at once (:class:`PoolFull`: a small body is routed without a
  prediction, a larger one refused), never queued.
- :func:`read_body`: the body within ``body_s`` and at most ``max_body_bytes`` once inflated (aiohttp inflates
  gzip and deflate as it reads, a chunk at a time, so a bomb is stopped at the cap, not inflated whole), each chunk
  charged to a :class:`BodyBudget` shared by every connection (``max_inflight_body_bytes``).
- :class:`CappedSite`: a TCP listener of at most ``max_connections``: at the cap, a new connection closes the oldest
  idle one (headers not complete, or between requests), and is closed itself as it is accepted (its descriptor
  not held) only when every one has a request in flight. Header deadlines are aiohttp's own keep-alive timer (see
  :func:`handler_args`).
- :func:`read_secret`: the engines' API key from a file or the environment, never from the config text.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import resource
import stat
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

from aiohttp import web

from kvtier.errors import ConfigError
from kvtier.router.config import Limits

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # its backport, which aiohttp (and so the router extra) installs below 3.11
    from async_timeout import timeout

T = TypeVar("T")
# Descriptors a router needs beside its client connections: one upstream connection per client request being
# proxied, plus health checks, scrapes, KV-event sockets, the tokenizer's files, logs.
_SPARE_DESCRIPTORS = 64


class PoolFull(Exception):
    """Every worker is busy and the queue is full: the request is not queued (a small one is routed without a
    prediction, a larger one answered 429)."""


class WorkerPool:
    """Threads for a request's CPU work. The tokenizers release the GIL while they encode (measured: the event
    loop's longest pause was 0.2 s while a thread tokenized 8 MiB for 11 s), so threads keep the loop answering.

    Work is handed to a thread only when one is free; up to ``queue`` requests wait for one here, on the loop, so
    that a client who leaves while waiting takes its arguments (its body) with it: the executor's own queue would
    keep a cancelled item, body and all, until a thread reached it. Used on the event loop only."""

    def __init__(self, workers: int, queue: int) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvtier-router-prompt")
        self._workers, self._queue = workers, queue
        self._running = 0  # on a thread, work a client abandoned included: it ends before its thread is free
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def pending(self) -> int:
        return self._running + len(self._waiting)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker; raises :class:`PoolFull` at once when ``workers`` run and ``queue`` wait."""
        loop = asyncio.get_running_loop()
        if self._running < self._workers:
            self._running += 1
        else:
            if len(self._waiting) >= self._queue:
                raise PoolFull
            turn = loop.create_future()
            self._waiting.append(turn)
            try:
                await turn  # a thread handed over by _free (the count stays)
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._free()  # handed a thread, and gone before taking it: the next one gets it
                else:
                    self._waiting.remove(turn)
                raise
        future = self._executor.submit(fn, *args)
        future.add_done_callback(lambda ignored: _call_soon(loop, self._free))
        return await asyncio.wrap_future(future)

    def _free(self) -> None:
        """A thread is free: the first request waiting takes it, or it is counted free."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._running -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """``fn`` on ``loop`` from a worker thread; nothing once the loop is closed (the router is stopping)."""
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass


class BodyTooLarge(Exception):
    pass


class BudgetSpent(Exception):
    """The bodies being read router-wide hold ``max_inflight_body_bytes``: this one is refused (503)."""


# The first bytes of each body are not charged: a small request is never refused for the budget, however many
# large ones hold it (max_connections of them at most: 32 MiB at the default 512).
FREE_BODY_BYTES = 64 * 1024


class BodyBudget:
    """Bytes of request bodies held router-wide, from their first inflated chunk until their request's
    :class:`Charge` is released (its answer is sent: a body is kept for retries on other engines), past the
    first :data:`FREE_BODY_BYTES` of each. Used on the event loop only (no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def charge(self) -> Charge:
        return Charge(self)


class Charge:
    """One request's share of a :class:`BodyBudget`; :meth:`release` (idempotent) gives it all back."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget, self.bytes, self._seen = budget, 0, 0

    def add(self, n: int) -> None:
        """Raises :class:`BudgetSpent` (charging nothing) when ``n`` more bytes would not fit."""
        charged = max(0, self._seen + n - max(FREE_BODY_BYTES, self._seen))
        if self._budget.held + charged > self._budget.limit:
            raise BudgetSpent
        self._seen += n
        self._budget.held += charged
        self.bytes += charged

    def release(self) -> None:
        self._budget.held -= self.bytes
        self.bytes = 0


async def read_body(request: web.Request, limits: Limits, charge: Charge) -> bytes:
    """The request's body, inflated, each chunk charged to ``charge`` as it comes (released by the caller, when
    the body is done with or dropped). Raises :class:`BodyTooLarge` past ``max_body_bytes`` (inflated),
    :class:`BudgetSpent` past the router-wide budget and :class:`asyncio.TimeoutError` when it takes longer than
    ``body_s``."""
    cap = limits.max_body_bytes
    if request.content_length is not None and request.content_length > cap:
        raise BodyTooLarge  # compressed or not, what is sent is at most what it inflates to
    body = bytearray()
    async with timeout(limits.body_s):
        while chunk := await request.content.readany():
            if len(body) + len(chunk) > cap:
                raise BodyTooLarge
            charge.add(len(chunk))
            body += chunk
    return bytes(body)


def handler_args(limits: Limits) -> dict[str, Any]:
    """aiohttp's per-connection options: its keep-alive timer runs from a connection's start and from each answer
    until the next request's headers are complete, and closes the connection when it fires: the header deadline.
    A body left unread after its answer (a refused one) closes the connection instead of being drained: aiohttp
    would read and inflate what the client sends for 10 s more."""
    return {"keepalive_timeout": limits.header_s, "lingering_time": 0, "handler_cancellation": True,
            "access_log": None}


class CappedSite(web.BaseSite):
    """A TCP listener for ``runner`` of at most ``cap`` connections, counted from their accept to their close. At
    the cap, a new connection takes the place of the oldest idle one (``on_evicted`` is called), else it is closed
    as it is accepted (``on_refused``): half-sent headers cannot lock out honest clients, nor are requests in flight
    cut for a newcomer."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, cap: int,
                 on_refused: Callable[[], None], on_evicted: Callable[[], None]) -> None:
        super().__init__(runner)
        self._host, self._port = host, port
        self.cap = cap
        self.open = 0
        self._on_refused, self._on_evicted = on_refused, on_evicted
        self._live: dict[_Counted, None] = {}  # open and not evicted, oldest first

    @property
    def port(self) -> int:
        """The bound port (the one asked for before :meth:`start`)."""
        server = self._server
        if server is not None and server.sockets:  # type: ignore[attr-defined]  # a Server, typed as its ABC
            return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]  # (the same)
        return self._port

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, self._host, self._port, backlog=self._backlog, reuse_address=True)

    def _protocol(self) -> asyncio.Protocol:
        if len(self._live) >= self.cap and not self._evict():
            self._on_refused()
            return _Refused()
        server = self._runner.server
        assert server is not None
        counted = _Counted(server(), self)
        self.open += 1
        self._live[counted] = None
        return counted

    def _evict(self) -> bool:
        """Close the oldest idle connection; False when every one has a request in flight. Scans past busy ones,
        at most ``cap`` of them, only when the listener is full."""
        for counted in self._live:
            if counted.idle():
                del self._live[counted]
                counted.close()
                self._on_evicted()
                return True
        return False

    def _lost(self, counted: _Counted) -> None:
        self.open -= 1
        self._live.pop(counted, None)


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, and the site's count of it."""

    def __init__(self, inner: asyncio.Protocol, site: CappedSite) -> None:
        self._inner, self._site = inner, site
        self._transport: asyncio.BaseTransport | None = None

    def idle(self) -> bool:
        """No request is being handled or waits to be (its headers not complete yet, or between requests): the
        test aiohttp's own keep-alive timer makes, its handler waiting for a message. Its waiter is done (or gone)
        from the moment a request's headers are parsed, before the request's task sets
        ``_request_in_progress``. aiohttp exposes this only through its own fields: a version without them counts
        as busy (never evicted), which is the cap as it was."""
        waiter = getattr(self._inner, "_waiter", None)
        return (isinstance(waiter, asyncio.Future) and not waiter.done()
                and not getattr(self._inner, "_messages", True))

    def close(self) -> None:
        """Reset now: a closed transport would wait to send what its client does not read, keeping the descriptor
        (and the cap it no longer counts against)."""
        abort = getattr(self._transport, "abort", None)  # a TCP transport's (uvloop's is no asyncio.WriteTransport)
        if abort is not None:
            abort()
        elif self._transport is not None:
            self._transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._site._lost(self)
        self._inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream server's connections are Transports, which abort: a reset at once, the descriptor closed
        # now, not after a lingering close
        cast(asyncio.Transport, transport).abort()


def descriptor_room(wanted: int) -> int:
    """Client connections the process's descriptor limit allows, up to ``wanted``: each may hold an upstream
    connection too. Raises the soft limit toward the hard one where that makes room."""
    need = 2 * wanted + _SPARE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - _SPARE_DESCRIPTORS) // 2))


def read_secret(source: str, field: str) -> str:
    """The secret ``source`` names: ``file:/absolute/path`` (a regular file of this user's or root's that no one
    else can read) or ``env:VARIABLE``. Errors name ``field`` and the source, never the secret."""
    kind, _, rest = source.partition(":")
    if kind == "env":
        value = os.environ.get(rest, "").strip()
        if not value:
            raise ConfigError(f"{field}: environment variable {rest} is not set")
        return value
    try:
        fd = os.open(rest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot open {rest}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{field}: {rest} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o077:
            raise ConfigError(f"{field}: {rest} refused: it must belong to this user (or root) with mode 0600 "
                              f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
        value = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if not value:
        raise ConfigError(f"{field}: {rest} is empty")
    return value
