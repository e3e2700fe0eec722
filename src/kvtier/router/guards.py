"""What bounds a client's hold on the router (``limits`` in the config), in the router's one event loop.

- :class:`WorkerPool`: a request's CPU work (parsing its body, tokenizing, keying) runs on a few threads, not on
  the event loop; at most ``workers`` run and ``queue`` wait, and one more is turned away at once
  (:class:`PoolFull`: a small body is routed without a prediction, a larger one refused), never queued.
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
import concurrent.futures
import os
import resource
import stat
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from kvtier.errors import ConfigError
from kvtier.router.config import Limits

T = TypeVar("T")
# Descriptors a router needs beside its client connections: one upstream connection per client request being
# proxied, plus health checks, scrapes, KV-event sockets, the tokenizer's files, logs.
_SPARE_DESCRIPTORS = 64


class PoolFull(Exception):
    """Every worker is busy and the queue is full: the request is not queued (a small one is routed without a
    prediction, a larger one answered 429)."""


class WorkerPool:
    """Threads for a request's CPU work. The tokenizers release the GIL while they encode (measured: the event
    loop's longest pause was 0.2 s while a thread tokenized 8 MiB for 11 s), so threads keep the loop answering."""

    def __init__(self, workers: int, queue: int) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvtier-router-prompt")
        self._limit = workers + queue
        self._pending = 0  # submitted and not finished, work a client abandoned included
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker; raises :class:`PoolFull` at once when ``workers + queue`` are pending."""
        with self._lock:
            if self._pending >= self._limit:
                raise PoolFull
            self._pending += 1
        future = self._executor.submit(fn, *args)
        # counted until the work ends, not until its caller stops waiting: a client that leaves frees no worker
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class BodyTooLarge(Exception):
    pass


class BudgetSpent(Exception):
    """The bodies being read router-wide hold ``max_inflight_body_bytes``: this one is refused (503)."""


class BodyBudget:
    """Bytes of request bodies held router-wide, from their first inflated chunk until their request's
    :class:`Charge` is released. Used on the event loop only (no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def charge(self) -> Charge:
        return Charge(self)


class Charge:
    """One request's share of a :class:`BodyBudget`; :meth:`release` (idempotent) gives it all back."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget, self.bytes = budget, 0

    def add(self, n: int) -> None:
        """Raises :class:`BudgetSpent` (charging nothing) when ``n`` more bytes would not fit."""
        if self._budget.held + n > self._budget.limit:
            raise BudgetSpent
        self._budget.held += n
        self.bytes += n

    def release(self) -> None:
        self._budget.held -= self.bytes
        self.bytes = 0


async def read_body(request: web.Request, limits: Limits, charge: Charge) -> bytes:
    """The request's body, inflated, each chunk charged to ``charge`` as it comes (released by the caller, when
    the body is done with or dropped). Raises :class:`BodyTooLarge` past ``max_body_bytes`` (inflated),
    :class:`BudgetSpent` past the router-wide budget and :class:`TimeoutError` when it takes longer than
    ``body_s``."""
    cap = limits.max_body_bytes
    if request.content_length is not None and request.content_length > cap:
        raise BodyTooLarge  # compressed or not, what is sent is at most what it inflates to
    body = bytearray()
    async with asyncio.timeout(limits.body_s):
        while chunk := await request.content.readany():
            if len(body) + len(chunk) > cap:
                raise BodyTooLarge
            charge.add(len(chunk))
            body += chunk
    return bytes(body)


def handler_args(limits: Limits) -> dict[str, object]:
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
        if self._server is not None and self._server.sockets:  # type: ignore[attr-defined]
            return int(self._server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
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

    def idle(self) -> bool:
        """No request is being handled or waits to be (its headers not complete yet, or between requests).
        aiohttp's RequestHandler exposes this only through its own fields: a version without them counts as busy
        (never evicted), which is the cap as it was."""
        return (getattr(self._inner, "_request_in_progress", True) is False
                and not getattr(self._inner, "_messages", True))

    def close(self) -> None:
        """As aiohttp's keep-alive timer closes an idle connection."""
        self._inner.force_close()  # type: ignore[attr-defined]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
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
        transport.abort()  # a reset at once: the descriptor is closed now, not after a lingering close


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
