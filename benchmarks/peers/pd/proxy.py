"""A two-hop proxy for vLLM's disaggregated prefill/decode: each request is prefilled on one engine, then decoded on
another that pulls the prompt's KV from the first (vLLM's ``NixlConnector`` in pull mode).

The protocol, per request (``/v1/completions``; ``/v1/chat/completions`` takes the same path):

1. Prefill hop: the client's body with ``max_tokens`` = 1 (and ``max_completion_tokens`` = 1 when the body has
   it), ``stream`` false, no ``stream_options`` nor ``min_tokens`` (vLLM refuses more than ``max_tokens``), and
   ``kv_transfer_params`` asking for a remote decode (:data:`PREFILL_PARAMS`). The prefill engine keeps the
   prompt's blocks and answers with the ``kv_transfer_params`` a decode engine needs to read them (engine id,
   block ids, side-channel host and port).
2. Decode hop: the client's body unchanged but for those ``kv_transfer_params``; its answer, streamed or not, is
   the client's. Both hops carry the same ``X-Request-Id``.

An upstream error (status >= 400) is returned to the client as the upstream sent it; an upstream that cannot be
reached, and a prefill answer without ``kv_transfer_params``, are a 502. :class:`PdProxy` runs on the caller's
event loop; :class:`ProxyThread` runs one on a loop of its own, for synchronous benchmarks. Each request's hop
times are kept as :class:`Handoff` records (the last :data:`KEEP` of them).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import threading
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from kvtier.testing.servers import free_port

PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
ROUTES = ("/v1/completions", "/v1/chat/completions")
KEEP = 10_000


@dataclasses.dataclass(frozen=True)
class Handoff:
    """One request's path through the proxy, in seconds from its arrival: the prefill hop's answer, the decode
    hop's first body bytes (for a streamed answer, its first chunk: the KV read and the first decode step), and
    the decode hop's end. ``kv_transfer_params`` is what the prefill engine handed to the decode engine."""

    request_id: str
    prefill_s: float
    decode_first_s: float
    decode_done_s: float
    kv_transfer_params: dict[str, Any]


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill hop's body for the client's ``body``: one token, not streamed, with a remote decode asked."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


class PdProxy:
    """The proxy on ``host:port`` (``port`` 0: a free one, chosen here), in front of the OpenAI-compatible servers at
    ``prefill_url`` and ``decode_url``."""

    def __init__(self, prefill_url: str, decode_url: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.host = host
        self.port = port or free_port()
        self.handoffs: collections.deque[Handoff] = collections.deque(maxlen=KEEP)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        # No total timeout: a decode of many tokens may take minutes. No connection limit: a benchmark's
        # concurrency is its own to choose.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
                                              connector=aiohttp.TCPConnector(limit=0))
        app = web.Application(client_max_size=64 * 2**20)
        for route in ROUTES:
            app.router.add_post(route, self._handle)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.json()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            return await self._two_hops(request, body, request_id, arrived)
        except aiohttp.ClientError as exc:  # an engine down or gone mid-answer: the client hears why
            if request.get("streaming"):  # too late for a status: aiohttp logs it and drops the connection
                raise
            return _error(502, f"pd proxy: {type(exc).__name__}: {exc}")

    async def _two_hops(self, request: web.Request, body: dict[str, Any], request_id: str,
                        arrived: float) -> web.StreamResponse:
        assert self._session is not None
        headers = {"X-Request-Id": request_id}
        async with self._session.post(self.prefill_url + request.path, json=prefill_body(body),
                                      headers=headers) as prefill:
            raw = await prefill.read()
            if prefill.status >= 400:
                return web.Response(status=prefill.status, body=raw, content_type=prefill.content_type)
        params = json.loads(raw).get("kv_transfer_params")
        if not params:
            return _error(502, "pd proxy: the prefill engine's answer has no kv_transfer_params (is it started "
                               "with a KV connector, kv_role kv_producer?)")
        prefilled = time.perf_counter()
        async with self._session.post(self.decode_url + request.path, json={**body, "kv_transfer_params": params},
                                      headers=headers) as decode:
            if decode.status >= 400 or not body.get("stream"):
                raw = await decode.read()
                first = done = time.perf_counter()
                reply: web.StreamResponse = web.Response(status=decode.status, body=raw,
                                                         content_type=decode.content_type)
            else:
                reply = web.StreamResponse(status=decode.status, headers={
                    "Content-Type": decode.headers.get("Content-Type", "text/event-stream")})
                request["streaming"] = True
                await reply.prepare(request)
                first = 0.0
                async for chunk in decode.content.iter_any():
                    first = first or time.perf_counter()
                    await reply.write(chunk)
                await reply.write_eof()
                done = time.perf_counter()
        self.handoffs.append(Handoff(request_id, prefilled - arrived, (first or done) - arrived, done - arrived,
                                     params))
        return reply


def _error(status: int, message: str) -> web.Response:
    """An error in the OpenAI servers' shape."""
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class ProxyThread:
    """A :class:`PdProxy` on an event loop in a thread of its own: ``start()`` returns once it listens on
    :attr:`port`, ``stop()`` closes it and joins the thread."""

    def __init__(self, prefill_url: str, decode_url: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.proxy = PdProxy(prefill_url, decode_url, host=host, port=port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pd-proxy", daemon=True)

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def handoffs(self) -> collections.deque[Handoff]:
        return self.proxy.handoffs

    def start(self) -> ProxyThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(timeout=30)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """Serve the proxy until SIGTERM: ``python -m benchmarks.peers.pd.proxy --prefill URL --decode URL --port N``
    (from the repository root), for a benchmark that wants it in a process of its own."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill engine's URL")
    parser.add_argument("--decode", required=True, help="the decode engine's URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)

    async def serve() -> None:
        await PdProxy(args.prefill, args.decode, host=args.host, port=args.port).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
