"""``kvtier router``: an OpenAI-compatible proxy in front of vLLM API servers (aiohttp, one event loop).

Per request: read the body (within ``limits``), tokenize the prompt as the engine will and key it on a worker
thread (:mod:`kvtier.router.guards`), ask the policy for engines in order, send the request to the first; one
that fails before its first byte (or redirects) is retried on the next. After the first byte the answer passes
through byte for byte, a streamed one in whole SSE events; an engine that fails or goes quiet mid-stream ends
the client's stream with an SSE ``error`` event (after the last whole event: a partial one is dropped). A client
that leaves closes the upstream connection, which aborts the request in vLLM. Beside the proxy: a KV-event
subscriber per engine, a health check, and a scrape of each engine's prefill counters for calibration, all sent
with the engines' API key when one is configured. With ``admin_listen``, ``/metrics`` and ``/health``'s
per-engine detail are served on that listener only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import signal
import time
import uuid
from collections.abc import Iterator, Mapping

import aiohttp
import zmq.asyncio
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier import tracing
from kvtier.metrics import sample_sum
from kvtier.router.config import EngineConfig, RouterConfig
from kvtier.router.events import Batch, Cleared, Feed, Removed, Stored
from kvtier.router.guards import (BodyBudget, BodyTooLarge, BudgetSpent, CappedSite, Charge, PoolFull, WorkerPool,
                                  descriptor_room, handler_args, read_body, read_secret)
from kvtier.router.index import LOCAL_PLACES, Place, PrefixIndex
from kvtier.router.metrics import LogOnce, RouterMetrics
from kvtier.router.policy import Decision, Router
from kvtier.router.prompts import Tokenizer
from kvtier.router.reading import Read, Reader, Unreadable
from kvtier.router.subscriber import Subscriber
from kvtier.router.wire import EventCutter, error_reply, forwarded, reply_headers, sse_error

log = logging.getLogger(__name__)

_USAGE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_LOST_AFTER = 3  # health checks failed in a row before an engine's entries are cleared
_ADMIN_CONNECTIONS = 32


class _Upstream(Exception):
    """An engine failed before its first byte: try the next one."""


# With every worker busy, a body up to this size is parsed on the event loop and routed without a prediction; a
# larger one is refused (429) rather than parsed there (json.loads of 32 KiB takes at most ~0.6 ms here, a
# hostile body of deep or huge numbers included)
BUSY_PARSE_BYTES = 32 * 1024
# An engine's restart and lost events are logged at most this often each (a forged publisher can repeat them)
WARN_EVERY_S = 60.0


class RouterApp:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        # the router's own calls to the engines (health, models, metrics) carry the engines' --api-key
        self._own_headers = ({"Authorization": "Bearer " + read_secret(config.engine_api_key, "engine_api_key")}
                             if config.engine_api_key is not None else {})
        self.metrics = RouterMetrics()
        self.metrics.declare([e.name for e in config.engines], [e.name for e in config.engines if e.kv_events])
        self.index = PrefixIndex(config.block_size, config.events.max_engine_blocks)
        self.router = Router(config, self.index)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer(config.tokenizer)
        self.urls = {e.name: e.url.rstrip("/") for e in config.engines}
        self.base_models: set[str] = set()
        self.max_model_len: int | None = None  # the engines' smallest, from their /v1/models
        self.pool = WorkerPool(config.limits.workers, config.limits.queue)
        self.bodies = BodyBudget(config.limits.max_inflight_body_bytes)
        self.reader = Reader(self.tokenizer, self.router,
                             LogOnce(self.metrics.unpredicted, "kvtier_router_unpredicted_requests", log))
        self._sites: dict[str, CappedSite] = {}
        self.subscribers: dict[str, Subscriber] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._prefill_counters: dict[str, tuple[float, float, float]] = {}
        self._failures: dict[str, int] = {}  # health checks failed in a row, per engine

    # --- lifecycle ------------------------------------------------------------------------------------------
    def web_app(self, admin: bool = False) -> web.Application:
        """The client listener's application; ``admin``: /metrics and /health's detail are the admin one's."""
        app = web.Application(client_max_size=self.config.limits.max_body_bytes)
        app.router.add_post("/v1/completions", self._proxy)
        app.router.add_post("/v1/chat/completions", self._proxy)
        app.router.add_get("/v1/models", self._models)
        # /health stays on the client listener (a load balancer's check), without the index's detail when an
        # admin listener serves that: blocks per engine would tell a client whether its prompt was cached
        app.router.add_get("/health", self._status if admin else self._health)
        if not admin:
            app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def admin_app(self) -> web.Application:
        app = web.Application(client_max_size=2**16)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def listen(self, host: str, port: int, admin: tuple[str, int] | None = None) -> list[web.AppRunner]:
        """Start the client listener on ``host:port`` (and the admin one); the runners, to clean up in order."""
        limits = self.config.limits
        cap = descriptor_room(limits.max_connections)
        if cap < limits.max_connections:
            log.warning("limits.max_connections is %d, but the descriptor limit (ulimit -n) leaves room for %d "
                        "client connections (each may hold one to an engine too): capped at %d",
                        limits.max_connections, cap, cap)
        listeners = [("client", host, port, cap, self.web_app(admin=admin is not None))]
        if admin is not None:
            listeners.append(("admin", *admin, _ADMIN_CONNECTIONS, self.admin_app()))
        runners = []
        for name, h, p, n, app in listeners:
            runner = web.AppRunner(app, **handler_args(limits))
            await runner.setup()
            runners.append(runner)
            site = CappedSite(runner, h, p, n, self.metrics.refused_connections.labels(name).inc,
                              self.metrics.evicted_connections.labels(name).inc)
            await site.start()
            self._sites[name] = site
            log.info("router %s listener on %s", name, site.name)
        return runners

    def port(self, listener: str = "client") -> int:
        return self._sites[listener].port

    async def _start(self, app: web.Application) -> None:
        # No Accept-Encoding of the client's own: engines answer uncompressed, which passes through as it is.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",))
        self._zmq = zmq.asyncio.Context()
        for engine in self.config.engines:
            if engine.kv_events is None:
                continue
            sub = self._subscriber(self._zmq, engine, engine.kv_events)
            self.subscribers[engine.name] = sub
            sub.start()
        # Health first: nothing is routed to an engine before it answered once.
        await asyncio.gather(*(self._check(name) for name in self.urls))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._health_loop()), loop.create_task(self._scrape_loop())]

    def _subscriber(self, ctx: zmq.asyncio.Context, engine: EngineConfig, events: str) -> Subscriber:
        """The subscriber to ``engine``'s KV events at ``events``, its callbacks bound to the engine's name."""
        name = engine.name
        feed = Feed(apply=lambda batch: self._apply(name, batch),
                    clear=lambda: self.index.clearing(name, LOCAL_PLACES),
                    on_gap=lambda missed: self.metrics.event_gaps.labels(name).inc(missed),
                    on_reset=lambda: self.metrics.event_resets.labels(name, "sequence").inc(),
                    warn=functools.partial(self._warn_feed, name, LogOnce(
                        None, "kvtier_router_event_resets and _gaps", log, logging.WARNING, WARN_EVERY_S)))
        return Subscriber(ctx, name, events, engine.kv_events_replay, feed,
                          bind=engine.kv_events_bind, limits=self.config.events,
                          block_size=self.config.block_size,
                          on_batch=lambda batch, ignored: self._arrived(name, batch),
                          on_error=lambda kind: self.metrics.event_errors.labels(name, kind).inc(),
                          on_replay=lambda: self.metrics.event_replays.labels(name).inc())

    @staticmethod
    def _warn_feed(name: str, limit: LogOnce, kind: str, message: str, *args: object) -> None:
        limit(kind, "engine %s: " + message, name, *args)

    async def _stop(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sub in self.subscribers.values():
            await sub.stop()
        if self._session is not None:
            await self._session.close()
        if self._zmq is not None:
            self._zmq.term()
        self.pool.close()

    # --- KV events ------------------------------------------------------------------------------------------
    def _arrived(self, engine: str, batch: Batch) -> None:
        self.metrics.event_lag.labels(engine).observe(max(0.0, time.time() - batch.ts))

    def _apply(self, engine: str, batch: Batch) -> Iterator[None]:
        """Apply a batch (or a piece of one: the feed splits large ones), yielding between slices of a clear."""
        for event in batch.events:
            if isinstance(event, Stored):
                self.index.stored(engine, event)
            elif isinstance(event, Removed):
                self.index.removed(engine, event)
            elif isinstance(event, Cleared):
                # vLLM's own cache only: kvtier's places stay
                yield from self.index.clearing(engine, (Place.ENGINE,))
                self.metrics.event_resets.labels(engine, "all_blocks_cleared").inc()
        if not batch.part:
            self.metrics.event_batches.labels(engine).inc()
        self.metrics.index_blocks.labels(engine).set(self.index.blocks(engine))

    # --- health and calibration -----------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await asyncio.gather(*(self._check(name) for name in self.urls))
                self.index.expire()
                counts = self.index.counts
                self.metrics.index_unusable.labels("orphan").set(counts.orphans)
                for reason, n in counts.skipped.items():
                    self.metrics.index_unusable.labels(reason).set(n)
            except Exception:  # the loop must outlive any one check's surprise
                log.exception("health check round failed")

    async def _check(self, name: str) -> None:
        """One /health check. An engine is routed to again at its first answer; it is lost (its entries in the
        index cleared) only after :data:`_LOST_AFTER` checks in a row fail, not at one slow answer."""
        assert self._session is not None
        state = self.router.engines[name]
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.config.health_interval_s * 2))
        try:
            async with self._session.get(self.urls[name] + "/health", timeout=timeout, headers=self._own_headers,
                                         allow_redirects=False) as reply:
                ok = reply.status == 200
        except Exception:  # noqa: BLE001 refused, reset, timed out, malformed: not healthy this time (counted)
            ok = False
        if ok:
            if not state.healthy:
                log.info("engine %s is up", name)
            state.healthy = True
            self._failures[name] = 0
            if not self.base_models:
                await self._learn_models(name, timeout)
        else:
            state.healthy = False
            self._failures[name] = self._failures.get(name, 0) + 1
            if self._failures[name] == _LOST_AFTER:
                self._lost(name, "health")
        self.metrics.healthy.labels(name).set(1 if ok else 0)

    async def _learn_models(self, name: str, timeout: aiohttp.ClientTimeout) -> None:
        """The engines' base model names (a request for another model is a LoRA adapter's) and their
        ``max_model_len`` (vLLM's /v1/models gives it): longer prompts are not keyed."""
        assert self._session is not None
        try:
            async with self._session.get(self.urls[name] + "/v1/models", timeout=timeout, headers=self._own_headers,
                                         allow_redirects=False) as reply:
                if reply.status != 200:
                    hint = " (engines started with --api-key need engine_api_key)" if reply.status == 401 else ""
                    log.warning("engine %s: /v1/models answered HTTP %d%s", name, reply.status, hint)
                    return
                data = (await reply.json()).get("data")
            base = [m for m in data if isinstance(m, Mapping) and isinstance(m.get("id"), str) and not m.get("parent")]
            self.base_models = {m["id"] for m in base}
            lengths = [m["max_model_len"] for m in base if type(m.get("max_model_len")) is int
                       and m["max_model_len"] > 0]
            self.max_model_len = min(lengths) if lengths else None
        except Exception as exc:  # noqa: BLE001 not fatal, logged: routed as base-model requests until it answers
            log.warning("engine %s: cannot read /v1/models (%s: %s)", name, type(exc).__name__, exc)

    def _lost(self, name: str, cause: str) -> None:
        """An engine stopped answering: nothing is routed there, and what it held in its own memory and on its
        host counts for nothing until its events say otherwise (a restarted engine starts empty). What it wrote
        to a shared tier stays credited: every other engine can still load it."""
        log.warning("engine %s lost (%s): its local index entries are cleared", name, cause)
        self.router.lost(name)
        sub = self.subscribers.get(name)
        if sub is not None:
            sub.feed.reset(counted=False)
        self.metrics.event_resets.labels(name, cause).inc()
        self.metrics.healthy.labels(name).set(0)
        self.metrics.index_blocks.labels(name).set(0)

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            results = await asyncio.gather(*(self._scrape(name) for name in self.router.healthy()),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, Exception):
                    log.warning("scraping an engine's /metrics failed: %s: %s", type(result).__name__, result)

    async def _scrape(self, name: str) -> None:
        """Prefill seconds per computed token from the engine's own counters, when exactly one request was
        prefilled since the last scrape (with several, their prefill times overlap and would add up)."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=5)
        try:
            async with self._session.get(self.urls[name] + "/metrics", timeout=timeout, headers=self._own_headers,
                                         allow_redirects=False) as reply:
                text = await reply.text()
        except (TimeoutError, aiohttp.ClientError):
            return
        seconds = sample_sum(text, "vllm:request_prefill_time_seconds_sum")
        count = sample_sum(text, "vllm:request_prefill_time_seconds_count")
        tokens = sample_sum(text, "vllm:request_prefill_kv_computed_tokens_sum")
        before = self._prefill_counters.get(name)
        self._prefill_counters[name] = (seconds, count, tokens)
        if before is not None and count - before[1] == 1 and tokens - before[2] >= self.config.block_size:
            state = self.router.engines[name]
            state.calibrate_prefill((seconds - before[0]) / (tokens - before[2]))

    # --- HTTP -----------------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        engines = {name: {"healthy": s.healthy, "in_flight": len(s.flights), "index_blocks": self.index.blocks(name),
                          "places": self.index.places(name)}
                   for name, s in self.router.engines.items()}
        status = 200 if any(e["healthy"] for e in engines.values()) else 503
        return web.json_response({"engines": engines}, status=status)

    async def _status(self, request: web.Request) -> web.Response:
        """The client listener's /health with an admin listener: up or not, nothing about the index."""
        up = bool(self.router.healthy())
        return web.json_response({"status": "ok" if up else "no healthy engine"}, status=200 if up else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        for name, state in self.router.engines.items():
            self.metrics.in_flight.labels(name).set(len(state.flights))
            self.metrics.decode_wait.labels(name).set(state.decode_s)
            self.metrics.prefill_rate.labels(name).set(self.router.prefill_rate(state))
        for name, site in self._sites.items():
            self.metrics.connections.labels(name).set(site.open)
        self.metrics.prompt_queue.set(self.pool.pending)
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        try:
            headers = forwarded(request.headers, "")
        except UnicodeEncodeError as exc:
            return self._refuse(400, "a request header is not UTF-8", "bad_header", str(exc))
        for name in self.router.healthy():
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.timeouts.first_byte_s,
                                                connect=self.config.timeouts.connect_s)
                async with self._session.get(self.urls[name] + "/v1/models", timeout=timeout,
                                             headers=headers, allow_redirects=False) as reply:
                    if 300 <= reply.status < 400:
                        continue  # a redirect is not passed on: its Location is the engine's business
                    return web.Response(status=reply.status, body=await reply.read(),
                                        content_type=reply.content_type)
            except (TimeoutError, aiohttp.ClientError):
                continue
        return error_reply(503, "no engine is healthy", "no_healthy_engine")

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        """:meth:`_route` in a span continuing the client's trace (its ``traceparent``), when tracing is on."""
        with tracing.span("kvtier.router.request", tracing.context_of(request.headers), path=request.path) as span:
            reply = await self._route(request)
            if span is not None:
                span.set_attribute("http.status_code", reply.status)
            return reply

    async def _route(self, request: web.Request) -> web.StreamResponse:
        try:
            headers = forwarded(request.headers, request.headers.get("X-Request-Id") or uuid.uuid4().hex)
        except UnicodeEncodeError as exc:  # aiohttp reads bytes that are not UTF-8 as surrogates: unsendable
            return self._refuse(400, "a request header is not UTF-8", "bad_header", str(exc))
        charge = self.bodies.charge()
        try:
            return await self._routed(request, headers, charge)
        finally:
            charge.release()  # answered, or the client gone: the body is no longer kept for a retry

    async def _routed(self, request: web.Request, headers: dict[str, str], charge: Charge) -> web.StreamResponse:
        request_id = headers["X-Request-Id"]
        read = await self._read(request, charge)
        if isinstance(read, web.Response):
            return read
        raw, prompt, keys, stream = read.raw, read.prompt, read.keys, read.stream
        del read
        with tracing.span("kvtier.router.decision", request_id=request_id,
                          prompt_tokens=None if prompt is None else len(prompt.tokens)) as span:
            decisions = self.router.decide(prompt, request.headers.get(self.config.session_header), keys)
            if span is not None:
                _describe(span, decisions)
        if not decisions:
            return error_reply(503, "no engine is healthy", "no_healthy_engine", retry_after=True)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %r: %s", request_id, "; ".join(
                f"{d.engine} {d.predicted_s:.3f}s (wait {d.wait_s:.3f}, load {d.load_s:.3f}, compute {d.uncached}, "
                f"{d.match})" for d in decisions))
        t0 = time.monotonic()
        for attempt, decision in enumerate(decisions[:1 + self.config.retries]):
            try:
                return await self._send(request, raw, headers, decision, keys, stream, t0)
            except _Upstream as exc:
                log.warning("request %r: engine %s failed before answering (%s)%s", request_id, decision.engine,
                            exc, "; trying the next" if attempt < self.config.retries else "")
                self.metrics.retries.labels(decision.engine).inc()
                self.metrics.requests.labels(decision.engine, decision.reason, "failed").inc()
        return error_reply(502, "every engine tried failed before answering", "upstream_unavailable", retry_after=True)

    async def _read(self, request: web.Request, charge: Charge) -> Read | web.Response:
        """The request's body read (within ``limits``, charged to ``charge``), parsed, its prompt tokenized and
        keyed on a worker; or the router's own answer refusing it."""
        limits = self.config.limits
        try:
            raw = await read_body(request, limits, charge)
        except BodyTooLarge:
            return self._refuse(413, f"the request body is over {limits.max_body_bytes} bytes "
                                "(limits.max_body_bytes, once inflated)", "body_too_large", unread=True)
        except BudgetSpent:
            return self._refuse(503, "the router holds as many request bodies as it may "
                                "(limits.max_inflight_body_bytes); retry", "body_budget", retry_after=True,
                                unread=True)
        except TimeoutError:
            return self._refuse(408, f"the request body took over {limits.body_s} s (limits.body_s)",
                                "body_timeout", unread=True)
        except (web.RequestPayloadError, HttpProcessingError) as exc:
            return self._refuse(400, "the request body cannot be read (its encoding is broken)", "bad_body",
                                type(exc).__name__)
        try:
            try:
                return await self.pool.run(self.reader, request.path, raw, self.base_models, self._longest_prompt())
            except PoolFull:
                if len(raw) > BUSY_PARSE_BYTES:
                    return self._refuse(429, "the router is busy reading other requests; retry", "busy",
                                        retry_after=True)
                # A prediction is an optimisation, answering is not: a small body is parsed here (a few
                # milliseconds on the loop at most) and routed unindexed, so a few slow prompts cannot turn every
                # client away
                return self.reader.unpredicted(raw, "busy")
        except Unreadable as exc:
            return self._refuse(400, str(exc), "bad_body")

    def _longest_prompt(self) -> int:
        """Prompt tokens the router keys: limits.max_prompt_tokens, and no more than the engines take."""
        cap = self.config.limits.max_prompt_tokens
        return cap if self.max_model_len is None else min(cap, self.max_model_len)

    def _refuse(self, status: int, message: str, reason: str, detail: str = "", retry_after: bool = False,
                unread: bool = False) -> web.Response:
        """The router's own answer to a request it will not route, counted by ``reason``. A body it stopped
        reading (``unread``: too large, too slow, over the budget) is not drained: the connection closes after
        the answer."""
        self.metrics.refused.labels(reason).inc()
        if detail:
            log.debug("request refused (%s): %r", reason, detail)
        reply = error_reply(status, message, "invalid_request_error" if status < 429 else reason, retry_after)
        if unread:
            reply.force_close()
        return reply

    async def _send(self, request: web.Request, raw: bytes, headers: dict[str, str], decision: Decision,
                    keys: list[bytes], stream: bool, t0: float) -> web.StreamResponse:
        """One attempt on one engine. Raises :class:`_Upstream` when the engine fails before the client got a
        byte (a whole answer, when not streaming): the caller tries the next engine."""
        with tracing.span("kvtier.router.upstream", engine=decision.engine, reason=decision.reason,
                          predicted_cached_tokens=decision.predicted_cached,
                          predicted_ttft_s=decision.predicted_s) as span:
            if span is not None:  # the engine's spans (vLLM's, the connector's) join this one's trace
                headers = {k: v for k, v in headers.items() if k.lower() not in ("traceparent", "tracestate")}
                headers.update(tracing.headers())
            reply = await self._attempt(request, raw, headers, decision, keys, stream, t0)
            if span is not None:
                span.set_attribute("http.status_code", reply.status)
            return reply

    async def _attempt(self, request: web.Request, raw: bytes, headers: dict[str, str], decision: Decision,
                       keys: list[bytes], stream: bool, t0: float) -> web.StreamResponse:
        name = decision.engine
        attempt = time.monotonic()
        flight = self.router.started(decision, keys)
        self.metrics.predicted_ttft.labels(name).observe(decision.predicted_s)
        outcome = "aborted"
        upstream: aiohttp.ClientResponse | None = None
        try:
            upstream = await self._open(name, request.path_qs, raw, headers)
            if not stream:
                body = await self._whole(upstream)
                outcome = "ok"
                answer = web.Response(status=upstream.status, body=body,
                                      headers=reply_headers(upstream.headers, decision, headers["X-Request-Id"],
                                                            self.config.explain_headers))
                self._compare(decision, body[-4096:])
                return answer
            first = await self._first(upstream)
            now = time.monotonic()
            if upstream.status < 300:  # an error answers fast and says nothing about prefill
                # this engine's own time calibrates it; the client's (with any engine tried before) is the metric
                self.router.first_byte(name, flight, now - attempt)
                self.metrics.ttft.labels(name).observe(now - t0)
            reply = web.StreamResponse(status=upstream.status,
                                       headers=reply_headers(upstream.headers, decision, headers["X-Request-Id"],
                                                             self.config.explain_headers))
            await reply.prepare(request)
            # SSE is passed on in whole events: an engine that dies mid-event must not leave the client half of
            # one (a corrupt event) before the error event
            sse = upstream.content_type == "text/event-stream"
            events = EventCutter()  # holds the start of an event whose end has not come
            chunk, tail = first, b""
            while chunk:
                tail = (tail + chunk)[-4096:]
                whole = events.feed(chunk) if sse else chunk
                if whole:
                    await self._deliver(reply, whole)
                try:
                    chunk = await asyncio.wait_for(upstream.content.readany(), self.config.timeouts.idle_s)
                except (TimeoutError, aiohttp.ClientError) as exc:
                    cause = "idle_timeout" if isinstance(exc, asyncio.TimeoutError) else "disconnected"
                    log.warning("engine %s failed mid-stream (%s): the client gets an error event%s", name, cause,
                                f" ({len(events.held)} bytes of a partial event dropped)" if events.held else "")
                    self.metrics.stream_errors.labels(name, cause).inc()
                    outcome = "failed_mid_stream"
                    await reply.write(sse_error(f"engine {name} failed mid-stream ({cause})"))
                    return reply
            if events.held:
                await self._deliver(reply, events.held)  # a clean end: its last bytes as the engine sent them
            await reply.write_eof()
            outcome = "ok"
            self._compare(decision, tail)
            return reply
        except _Upstream:
            outcome = "failed"
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.client_aborts.labels(name).inc()
            raise
        finally:
            if upstream is not None:
                if outcome == "ok":
                    upstream.release()
                else:
                    upstream.close()  # drops the connection: vLLM aborts a request whose client left
            # A refused or failed request computes nothing: its reserved blocks go now, not after reserve_s.
            computed = outcome != "failed" and upstream is not None and upstream.status < 400
            self.router.finished(name, flight, computed)
            if outcome != "failed":
                self.metrics.requests.labels(name, decision.reason, outcome).inc()

    async def _deliver(self, reply: web.StreamResponse, data: bytes) -> None:
        """Write to a client that must take it within ``timeouts.idle_s``: one that stops reading (a slow-read
        attack) would hold its engine's request for the whole generation. Raises ConnectionResetError then: the
        client is treated as gone, the upstream request aborted."""
        try:
            async with asyncio.timeout(self.config.timeouts.idle_s):
                await reply.write(data)
        except TimeoutError:
            raise ConnectionResetError(f"the client read nothing for {self.config.timeouts.idle_s} s") from None

    async def _open(self, name: str, path: str, raw: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        assert self._session is not None
        timeouts = self.config.timeouts
        try:
            # first_byte_s from the request on: an engine that accepts the connection and never answers (not
            # even its headers) is given up on too. A redirect is not followed: a 307 would send the prompt to
            # another origin.
            upstream = await asyncio.wait_for(self._session.post(
                self.urls[name] + path, data=raw, headers=headers, allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s, sock_read=None)),
                timeouts.first_byte_s)
        except aiohttp.ClientConnectionError as exc:
            # Not routed to until its next good health check; its entries stay unless it stays down.
            self.router.engines[name].healthy = False
            raise _Upstream(f"{type(exc).__name__}: {exc}") from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _Upstream(f"{type(exc).__name__}: {exc}") from exc
        except ValueError as exc:  # aiohttp's refusal to send this request (e.g. URL credentials and Authorization)
            raise _Upstream(f"the request cannot be sent: {type(exc).__name__}") from exc
        if upstream.status >= 500 or 300 <= upstream.status < 400:
            upstream.close()
            what = " (a redirect: not followed, nor passed on)" if upstream.status < 400 else ""
            raise _Upstream(f"HTTP {upstream.status}{what}")
        return upstream

    async def _whole(self, upstream: aiohttp.ClientResponse) -> bytes:
        try:
            return await asyncio.wait_for(upstream.read(), self.config.timeouts.first_byte_s)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _Upstream(f"no whole answer: {type(exc).__name__}") from exc

    async def _first(self, upstream: aiohttp.ClientResponse) -> bytes:
        try:
            first = await asyncio.wait_for(upstream.content.readany(), self.config.timeouts.first_byte_s)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _Upstream(f"no first byte: {type(exc).__name__}") from exc
        if not first:
            raise _Upstream("the answer ended before its first byte")
        return first

    def _compare(self, decision: Decision, tail: bytes) -> None:
        """Predicted cached tokens against the engine's own count, when its answer reports one."""
        found = _USAGE.findall(tail)
        if not found:
            return
        actual = int(found[-1])
        name = decision.engine
        self.metrics.predicted_cached.labels(name).inc(decision.predicted_cached)
        self.metrics.actual_cached.labels(name).inc(actual)
        outcome = "exact" if actual == decision.predicted_cached else \
            "over" if decision.predicted_cached > actual else "under"
        self.metrics.predictions.labels(name, outcome).inc()


def _describe(span: object, decisions: list[Decision]) -> None:
    """A decision span's attributes: the engines in the order tried, each one's predicted cost, and the reason."""
    span.set_attributes({  # type: ignore[attr-defined]
        "candidates": [d.engine for d in decisions],
        "predicted_ttft_s": [round(d.predicted_s, 6) for d in decisions],
        "predicted_cached_tokens": [d.predicted_cached for d in decisions],
        "uncached_tokens": [d.uncached for d in decisions],
        "chosen": decisions[0].engine if decisions else "",
        "reason": decisions[0].reason if decisions else "no_healthy_engine",
    })


def serve(config: RouterConfig) -> None:
    """Run the router until interrupted (SIGINT/SIGTERM stop it cleanly). Raises ConfigError for an engine key
    that cannot be read."""
    if config.otlp_traces_endpoint is not None:
        tracing.configure(config.otlp_traces_endpoint, "kvtier-router")
    try:
        asyncio.run(_serve(RouterApp(config)))
    finally:
        tracing.shutdown()  # the last spans are exported before the process ends


async def _serve(app: RouterApp) -> None:
    config = app.config
    admin = None
    if config.admin_listen is not None:
        host, _, port = config.admin_listen.rpartition(":")
        admin = (host.strip("[]"), int(port))
    elif config.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("/metrics and /health's per-engine detail are served to clients on %s: set admin_listen to "
                    "serve them elsewhere (they tell a client whether its prompts were cached)", config.host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runners = await app.listen(config.host, config.port, admin)
    try:
        await stop.wait()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
