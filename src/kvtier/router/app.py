"""``kvtier router``: an OpenAI-compatible proxy in front of vLLM API servers (aiohttp, one event loop).

Per request: read the body, tokenize the prompt as the engine will, ask the policy for engines in order, send
the request to the first; one that fails before its first byte is retried on the next. After the first byte
the answer passes through byte for byte; an engine that fails or goes quiet mid-stream ends the client's
stream with an SSE ``error`` event. A client that leaves closes the upstream connection, which aborts the
request in vLLM. Beside the proxy: a KV-event subscriber per engine, a health check, and a scrape of each
engine's prefill counters for calibration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Mapping

import aiohttp
import zmq.asyncio
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier import tracing
from kvtier.metrics import sample_sum
from kvtier.router.config import RouterConfig
from kvtier.router.events import Batch, Cleared, Feed, Removed, Stored, Subscriber
from kvtier.router.index import LOCAL_PLACES, Place, PrefixIndex
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import Decision, Router
from kvtier.router.prompts import Prompt, PromptError, Tokenizer, read_prompt, read_stream

log = logging.getLogger(__name__)

_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-authorization", "proxy-authenticate", "accept-encoding"}
_USAGE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_LOST_AFTER = 3  # health checks failed in a row before an engine's entries are cleared


class _Upstream(Exception):
    """An engine failed before its first byte: try the next one."""


class RouterApp:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.metrics.declare([e.name for e in config.engines], [e.name for e in config.engines if e.kv_events])
        self.index = PrefixIndex(config.block_size)
        self.router = Router(config, self.index)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer(config.tokenizer)
        self.urls = {e.name: e.url.rstrip("/") for e in config.engines}
        self.base_models: set[str] = set()
        self.subscribers: dict[str, Subscriber] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._prefill_counters: dict[str, tuple[float, float, float]] = {}
        self._failures: dict[str, int] = {}  # health checks failed in a row, per engine

    # --- lifecycle ------------------------------------------------------------------------------------------
    def web_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self._proxy)
        app.router.add_post("/v1/chat/completions", self._proxy)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        # No Accept-Encoding of the client's own: engines answer uncompressed, which passes through as it is.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",))
        self._zmq = zmq.asyncio.Context()
        for engine in self.config.engines:
            if engine.kv_events is None:
                continue
            name = engine.name
            feed = Feed(apply=lambda batch, name=name: self._apply(name, batch),
                        clear=lambda name=name: self.index.clear(name, LOCAL_PLACES),
                        on_gap=lambda missed, name=name: self.metrics.event_gaps.labels(name).inc(missed),
                        on_reset=lambda name=name: self.metrics.event_resets.labels(name, "sequence").inc())
            sub = Subscriber(self._zmq, name, engine.kv_events, engine.kv_events_replay, feed,
                             bind=engine.kv_events_bind,
                             on_batch=lambda batch, ignored, name=name: self._arrived(name, batch),
                             on_error=lambda kind, name=name: self.metrics.event_errors.labels(name, kind).inc(),
                             on_replay=lambda name=name: self.metrics.event_replays.labels(name).inc())
            self.subscribers[name] = sub
            sub.start()
        # Health first: nothing is routed to an engine before it answered once.
        await asyncio.gather(*(self._check(name) for name in self.urls))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._health_loop()), loop.create_task(self._scrape_loop())]

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

    # --- KV events ------------------------------------------------------------------------------------------
    def _arrived(self, engine: str, batch: Batch) -> None:
        self.metrics.event_lag.labels(engine).observe(max(0.0, time.time() - batch.ts))

    def _apply(self, engine: str, batch: Batch) -> None:
        for event in batch.events:
            if isinstance(event, Stored):
                self.index.stored(engine, event)
            elif isinstance(event, Removed):
                self.index.removed(engine, event)
            elif isinstance(event, Cleared):
                self.index.clear(engine, (Place.ENGINE,))  # vLLM's own cache only: kvtier's places stay
                self.metrics.event_resets.labels(engine, "all_blocks_cleared").inc()
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
            async with self._session.get(self.urls[name] + "/health", timeout=timeout) as reply:
                ok = reply.status == 200
        except Exception:  # refused, reset, timed out, malformed: not healthy this time
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
        """The engines' base model names (a request for another model is a LoRA adapter's)."""
        assert self._session is not None
        try:
            async with self._session.get(self.urls[name] + "/v1/models", timeout=timeout) as reply:
                data = (await reply.json()).get("data")
            self.base_models = {m["id"] for m in data if isinstance(m, Mapping) and isinstance(m.get("id"), str)
                                and not m.get("parent")}
        except Exception as exc:  # not fatal: requests are routed as base-model ones until it answers
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
            async with self._session.get(self.urls[name] + "/metrics", timeout=timeout) as reply:
                text = await reply.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
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

    async def _metrics(self, request: web.Request) -> web.Response:
        for name, state in self.router.engines.items():
            self.metrics.in_flight.labels(name).set(len(state.flights))
            self.metrics.decode_wait.labels(name).set(state.decode_s)
            self.metrics.prefill_rate.labels(name).set(self.router.prefill_rate(state))
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        for name in self.router.healthy():
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.timeouts.first_byte_s,
                                                connect=self.config.timeouts.connect_s)
                async with self._session.get(self.urls[name] + "/v1/models", timeout=timeout,
                                             headers=_forwarded(request.headers, "")) as reply:
                    return web.Response(status=reply.status, body=await reply.read(),
                                        content_type=reply.content_type)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return _error(503, "no engine is healthy", "no_healthy_engine")

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        """:meth:`_route` in a span continuing the client's trace (its ``traceparent``), when tracing is on."""
        with tracing.span("kvtier.router.request", tracing.context_of(request.headers), path=request.path) as span:
            reply = await self._route(request)
            if span is not None:
                span.set_attribute("http.status_code", reply.status)
            return reply

    async def _route(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and "kv_cache_report_mode" in xargs:
            # "full" makes the engine announce reused blocks again without removing them: the index counts
            # references, and would credit evicted blocks for good. The router owns what engines announce.
            body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_cache_report_mode"}
            raw = json.dumps(body).encode()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        prompt: Prompt | None
        try:
            prompt = read_prompt(self.tokenizer, request.path, body, self.base_models)
        except (PromptError, RecursionError) as exc:
            log.info("request %s routed without its cache: %s", request_id, exc)
            prompt = None  # the engine will answer with its own validation error, or serve it
        keys = self.router.keys(prompt) if prompt is not None else []
        with tracing.span("kvtier.router.decision", request_id=request_id,
                          prompt_tokens=None if prompt is None else len(prompt.tokens)) as span:
            decisions = self.router.decide(prompt, request.headers.get(self.config.session_header), keys)
            if span is not None:
                _describe(span, decisions)
        if not decisions:
            return _error(503, "no engine is healthy", "no_healthy_engine", retry_after=True)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s", request_id, "; ".join(
                f"{d.engine} {d.predicted_s:.3f}s (wait {d.wait_s:.3f}, load {d.load_s:.3f}, compute {d.uncached}, "
                f"{d.match})" for d in decisions))
        headers = _forwarded(request.headers, request_id)
        stream = read_stream(body)  # as vLLM reads it: "false" is false
        t0 = time.monotonic()
        for attempt, decision in enumerate(decisions[:1 + self.config.retries]):
            try:
                return await self._send(request, raw, headers, decision, keys, stream, t0)
            except _Upstream as exc:
                log.warning("request %s: engine %s failed before answering (%s)%s", request_id, decision.engine,
                            exc, "; trying the next" if attempt < self.config.retries else "")
                self.metrics.retries.labels(decision.engine).inc()
                self.metrics.requests.labels(decision.engine, decision.reason, "failed").inc()
        return _error(502, "every engine tried failed before answering", "upstream_unavailable", retry_after=True)

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
                reply = web.Response(status=upstream.status, body=body,
                                     headers=_reply_headers(upstream.headers, decision, headers["X-Request-Id"],
                                                             self.config.explain_headers))
                self._compare(decision, body[-4096:])
                return reply
            first = await self._first(upstream)
            now = time.monotonic()
            if upstream.status < 300:  # an error answers fast and says nothing about prefill
                # this engine's own time calibrates it; the client's (with any engine tried before) is the metric
                self.router.first_byte(name, flight, now - attempt)
                self.metrics.ttft.labels(name).observe(now - t0)
            reply = web.StreamResponse(status=upstream.status,
                                       headers=_reply_headers(upstream.headers, decision, headers["X-Request-Id"],
                                                             self.config.explain_headers))
            await reply.prepare(request)
            await reply.write(first)
            tail = first[-4096:]
            while True:
                try:
                    chunk = await asyncio.wait_for(upstream.content.readany(), self.config.timeouts.idle_s)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    cause = "idle_timeout" if isinstance(exc, asyncio.TimeoutError) else "disconnected"
                    log.warning("engine %s failed mid-stream (%s): the client gets an error event", name, cause)
                    self.metrics.stream_errors.labels(name, cause).inc()
                    outcome = "failed_mid_stream"
                    await reply.write(_sse_error(f"engine {name} failed mid-stream ({cause})"))
                    return reply
                if not chunk:
                    break
                tail = (tail + chunk)[-4096:]
                await reply.write(chunk)
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

    async def _open(self, name: str, path: str, raw: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        assert self._session is not None
        timeouts = self.config.timeouts
        try:
            # first_byte_s from the request on: an engine that accepts the connection and never answers (not
            # even its headers) is given up on too
            upstream = await asyncio.wait_for(self._session.post(
                self.urls[name] + path, data=raw, headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s, sock_read=None)),
                timeouts.first_byte_s)
        except aiohttp.ClientConnectionError as exc:
            # Not routed to until its next good health check; its entries stay unless it stays down.
            self.router.engines[name].healthy = False
            raise _Upstream(f"{type(exc).__name__}: {exc}") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _Upstream(f"{type(exc).__name__}: {exc}") from exc
        if upstream.status >= 500:
            upstream.close()
            raise _Upstream(f"HTTP {upstream.status}")
        return upstream

    async def _whole(self, upstream: aiohttp.ClientResponse) -> bytes:
        try:
            return await asyncio.wait_for(upstream.read(), self.config.timeouts.first_byte_s)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _Upstream(f"no whole answer: {type(exc).__name__}") from exc

    async def _first(self, upstream: aiohttp.ClientResponse) -> bytes:
        try:
            first = await asyncio.wait_for(upstream.content.readany(), self.config.timeouts.first_byte_s)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
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


def _forwarded(incoming: Mapping[str, str], request_id: str) -> dict[str, str]:
    headers = {k: v for k, v in incoming.items() if k.lower() not in _HOP}
    if request_id:
        headers["X-Request-Id"] = request_id
    return headers


def _reply_headers(upstream: Mapping[str, str], decision: Decision, request_id: str,
                   explain: bool) -> dict[str, str]:
    headers = {k: v for k, v in upstream.items() if k.lower() not in _HOP | {"date", "server", "x-request-id"}}
    headers["X-Request-Id"] = request_id
    if not explain:
        return headers
    headers["X-KVTier-Engine"] = decision.engine
    headers["X-KVTier-Route-Reason"] = decision.reason
    headers["X-KVTier-Predicted-Cached-Tokens"] = str(decision.predicted_cached)
    headers["X-KVTier-Predicted-TTFT"] = f"{decision.predicted_s:.4f}"
    return headers


def _sse_error(message: str) -> bytes:
    error = {"error": {"message": message, "type": "upstream_error", "code": 502}}
    return b"\n\ndata: " + json.dumps(error).encode() + b"\n\n"


def _error(status: int, message: str, kind: str, retry_after: bool = False) -> web.Response:
    headers = {"Retry-After": "1"} if retry_after else None
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


def serve(config: RouterConfig) -> None:
    """Run the router until interrupted (SIGINT/SIGTERM stop it cleanly)."""
    if config.otlp_traces_endpoint is not None:
        tracing.configure(config.otlp_traces_endpoint, "kvtier-router")
    app = RouterApp(config)
    try:
        web.run_app(app.web_app(), host=config.host, port=config.port, handler_cancellation=True,
                    access_log=None, print=lambda text: log.info("%s", text))
    finally:
        tracing.shutdown()  # the last spans are exported before the process ends
