"""The router's proxy: a client's request from its body to the last byte of the engine's answer.

Read the body (within ``limits``), tokenize the prompt as the engine will and key it (on a worker thread,
:mod:`kvtier.router.guards`; a short completion on the loop, :meth:`Reader.cheap`), ask the policy for engines in
order, send the request to the first; one that fails before its first byte (or redirects) is retried on the next.
After the first byte the answer passes through byte for byte, a streamed one in whole SSE events; an engine that
fails or goes quiet mid-stream ends the client's stream with an SSE ``error`` event (after the last whole event: a
partial one is dropped). A client that leaves closes the upstream connection, which aborts the request in vLLM.
``/v1/models`` is passed on from the first healthy engine that answers.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvtier import tracing
from kvtier.router.config import RouterConfig
from kvtier.router.engines import Engines
from kvtier.router.guards import (BodyBudget, BodyTooLarge, BudgetSpent, Charge, PoolFull, WorkerPool, read_body,
                                  timeout)
from kvtier.router.handoff import Prefills, bodies
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import Plan, RouteDecision, Router
from kvtier.router.reading import Read, Reader, Unreadable
from kvtier.router.upstream import Answer, ConnectionLost, UpstreamError
from kvtier.router.wire import EventCutter, error_reply, forwarded, reply_headers, sse_error

log = logging.getLogger(__name__)

_USAGE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')

# With every worker busy, a body up to this size is parsed on the event loop and routed without a prediction; a
# larger one is refused (429) rather than parsed there (json.loads of 32 KiB takes at most ~0.6 ms here, a
# hostile body of deep or huge numbers included)
BUSY_PARSE_BYTES = 32 * 1024


class _Upstream(Exception):
    """An engine failed before its first byte: try the next one."""


class Proxy:
    """The client listener's completions and models endpoints (:meth:`handle`, :meth:`models`)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, router: Router, engines: Engines,
                 reader: Reader, pool: WorkerPool, bodies: BodyBudget) -> None:
        self.config = config
        self.metrics = metrics
        self.router = router
        self.engines = engines
        self.reader = reader
        self.pool = pool
        self.bodies = bodies
        self.prefills = Prefills(config, metrics, router, engines)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """:meth:`_route` in a span continuing the client's trace (its ``traceparent``), when tracing is on."""
        with tracing.span("kvtier.router.request", tracing.context_of(request.headers), path=request.path) as span:
            reply = await self._route(request)
            if span is not None:
                span.set_attribute("http.status_code", reply.status)
            return reply

    async def models(self, request: web.Request) -> web.StreamResponse:
        session = self.engines.session
        assert session is not None
        try:
            headers = forwarded(request.headers, "")
        except UnicodeEncodeError as exc:
            return self.refuse(400, "a request header is not UTF-8", "bad_header", str(exc))
        for name in self.router.healthy():
            url = self.engines.urls.get(name)
            if url is None:
                continue  # (it left the fleet meanwhile)
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.timeouts.first_byte_s,
                                                connect=self.config.timeouts.connect_s)
                async with session.get(url + "/v1/models", timeout=timeout,
                                       headers=headers, allow_redirects=False) as reply:
                    if 300 <= reply.status < 400:
                        continue  # a redirect is not passed on: its Location is the engine's business
                    return web.Response(status=reply.status, body=await reply.read(),
                                        content_type=reply.content_type)
            except (asyncio.TimeoutError, aiohttp.ClientError):
                continue
        return error_reply(503, "no engine is healthy", "no_healthy_engine")

    def refuse(self, status: int, message: str, reason: str, detail: str = "", retry_after: bool = False,
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

    # --- deciding ---------------------------------------------------------------------------------------------
    async def _route(self, request: web.Request) -> web.StreamResponse:
        try:
            headers = forwarded(request.headers, request.headers.get("X-Request-Id") or uuid.uuid4().hex)
        except UnicodeEncodeError as exc:  # aiohttp reads bytes that are not UTF-8 as surrogates: unsendable
            return self.refuse(400, "a request header is not UTF-8", "bad_header", str(exc))
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
        session = request.headers.get(self.config.session_header)
        t0 = time.monotonic()  # the client's TTFT includes a prefill hop
        with tracing.span("kvtier.router.decision", request_id=request_id,
                          prompt_tokens=None if prompt is None else len(prompt.tokens)) as span:
            plan = self.router.plan(prompt, session, keys)
            if span is not None:
                _describe(span, plan.serve)
                span.set_attribute("prefill_candidates", [d.engine for d in plan.prefill])
        if plan.prefill:  # disaggregated: a prefill engine computes the prompt first
            raw, served_whole = await self._prefill(request, raw, headers, plan, keys, charge)
            if served_whole:  # by the engines that answer, as any request would be
                plan = Plan(self.router.decide(prompt, session, keys, self.router.answering()))
        elif self.router.disaggregated and prompt is not None and prompt.uncached is None and plan.serve:
            prefilling = any(self.router.engines[n].role == "prefill" for n in self.router.healthy())
            self.metrics.pd_requests.labels("local" if prefilling else "no_prefill_engine").inc()
        decisions = plan.serve
        if not decisions:
            return error_reply(503, "no engine is healthy", "no_healthy_engine", retry_after=True)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %r: %s", request_id, "; ".join(
                f"{d.engine} {d.predicted_s:.3f}s (wait {d.wait_s:.3f}, load {d.load_s:.3f}, compute {d.uncached}, "
                f"{d.match})" for d in decisions))
        for attempt, decision in enumerate(decisions[:1 + self.config.retries]):
            try:
                return await self._send(request, raw, headers, decision, keys, stream, t0)
            except _Upstream as exc:
                log.warning("request %r: engine %s failed before answering (%s)%s", request_id, decision.engine,
                            exc, "; trying the next" if attempt < self.config.retries else "")
                self.metrics.retries.labels(decision.engine).inc()
                self.metrics.requests.labels(decision.engine, decision.reason, "failed").inc()
        return error_reply(502, "every engine tried failed before answering", "upstream_unavailable", retry_after=True)

    async def _prefill(self, request: web.Request, raw: bytes, headers: dict[str, str], plan: Plan,
                       keys: list[bytes], charge: Charge) -> tuple[bytes, bool]:
        """The P/D hop: the body to send the decode engine, and whether the request is served whole instead (its
        P/D bodies could not be made: beam search, every worker busy, the body budget spent; or no prefill
        engine stored the prompt)."""
        held = self.bodies.charge()  # the two bodies, while the prefill hop runs
        try:
            try:
                pd_bodies = await self.pool.run(bodies, raw)
                if pd_bodies is not None:
                    held.add(pd_bodies.size)
            except (PoolFull, BudgetSpent, ValueError, RecursionError):
                pd_bodies = None
            if pd_bodies is None:
                self.metrics.pd_requests.labels("not_prefilled").inc()
                return raw, True
            promise = await self.prefills.run(pd_bodies, request.path_qs, headers, plan.prefill, keys)
            if promise is None:
                return raw, True
            decode = pd_bodies.decode(promise, self.config.pd.wait_s)
            charge.add(max(0, len(decode) - len(raw)))  # held with the client's body until the request ends
            return decode, False
        except BudgetSpent:
            self.metrics.pd_requests.labels("not_prefilled").inc()
            return raw, True
        finally:
            held.release()

    async def _read(self, request: web.Request, charge: Charge) -> Read | web.Response:
        """The request's body read (within ``limits``, charged to ``charge``), parsed, its prompt tokenized and
        keyed (on a worker, or here when that costs less: :meth:`Reader.cheap`); or the router's own answer refusing
        it."""
        limits = self.config.limits
        try:
            raw = await read_body(request, limits, charge)
        except BodyTooLarge:
            return self.refuse(413, f"the request body is over {limits.max_body_bytes} bytes "
                               "(limits.max_body_bytes, once inflated)", "body_too_large", unread=True)
        except BudgetSpent:
            return self.refuse(503, "the router holds as many request bodies as it may "
                               "(limits.max_inflight_body_bytes); retry", "body_budget", retry_after=True,
                               unread=True)
        except asyncio.TimeoutError:
            return self.refuse(408, f"the request body took over {limits.body_s} s (limits.body_s)",
                               "body_timeout", unread=True)
        except (web.RequestPayloadError, HttpProcessingError) as exc:
            return self.refuse(400, "the request body cannot be read (its encoding is broken)", "bad_body",
                               type(exc).__name__)
        try:
            if self.reader.cheap(request.path, len(raw)):
                return self.reader(request.path, raw, self.engines.base_models, self._longest_prompt())
            try:
                return await self.pool.run(self.reader, request.path, raw, self.engines.base_models,
                                           self._longest_prompt())
            except PoolFull:
                if len(raw) > BUSY_PARSE_BYTES:
                    return self.refuse(429, "the router is busy reading other requests; retry", "busy",
                                       retry_after=True)
                # A prediction is an optimisation, answering is not: a small body is parsed here (a few
                # milliseconds on the loop at most) and routed unindexed, so a few slow prompts cannot turn every
                # client away
                return self.reader.unpredicted(raw, "busy")
        except Unreadable as exc:
            return self.refuse(400, str(exc), "bad_body")

    def _longest_prompt(self) -> int:
        """Prompt tokens the router keys: limits.max_prompt_tokens, and no more than the engines take."""
        cap = self.config.limits.max_prompt_tokens
        longest = self.engines.max_model_len
        return cap if longest is None else min(cap, longest)

    # --- sending ----------------------------------------------------------------------------------------------
    async def _send(self, request: web.Request, raw: bytes, headers: dict[str, str], decision: RouteDecision,
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

    async def _attempt(self, request: web.Request, raw: bytes, headers: dict[str, str], decision: RouteDecision,
                       keys: list[bytes], stream: bool, t0: float) -> web.StreamResponse:
        name = decision.engine
        if name not in self.router.engines:
            raise _Upstream("it left the fleet")  # (after this request's plan was made): the next engine
        attempt = time.monotonic()
        flight = self.router.started(decision, keys)
        self.metrics.predicted_ttft.labels(name).observe(decision.predicted_s)
        outcome = "aborted"
        upstream: Answer | None = None
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
                self.metrics.ttft_slo.labels(name, "met" if now - t0 <= self.config.ttft_slo_s else "missed").inc()
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
                    async with timeout(self.config.timeouts.idle_s):  # (not wait_for: no task for each chunk)
                        chunk = await upstream.readany()
                except (asyncio.TimeoutError, UpstreamError) as exc:
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
            if name not in self.router.engines:
                self.metrics.forget(name)  # it left the fleet while this request ran: no series of it stays

    async def _deliver(self, reply: web.StreamResponse, data: bytes) -> None:
        """Write to a client that must take it within ``timeouts.idle_s``: one that stops reading (a slow-read
        attack) would hold its engine's request for the whole generation. Raises ConnectionResetError then: the
        client is treated as gone, the upstream request aborted."""
        try:
            async with timeout(self.config.timeouts.idle_s):
                await reply.write(data)
        except asyncio.TimeoutError:
            raise ConnectionResetError(f"the client read nothing for {self.config.timeouts.idle_s} s") from None

    async def _open(self, name: str, path: str, raw: bytes, headers: dict[str, str]) -> Answer:
        timeouts = self.config.timeouts
        try:
            # first_byte_s from the request on: an engine that accepts the connection and never answers (not
            # even its headers) is given up on too. A redirect is not followed: a 307 would send the prompt to
            # another origin.
            async with timeout(timeouts.first_byte_s):
                upstream = await self.engines.upstream.post(self.engines.urls[name], path, raw, headers,
                                                            timeouts.connect_s)
        except ConnectionLost as exc:
            # Not routed to until its next good health check; its entries stay unless it stays down.
            state = self.router.engines.get(name)
            if state is not None:
                state.healthy = False
            raise _Upstream(f"{type(exc).__name__}: {exc}") from exc
        except (asyncio.TimeoutError, UpstreamError) as exc:
            raise _Upstream(f"{type(exc).__name__}: {exc}") from exc
        except ValueError as exc:  # a header or target that cannot be sent
            raise _Upstream(f"the request cannot be sent: {exc}") from exc
        if upstream.status >= 500 or 300 <= upstream.status < 400:
            upstream.close()
            what = " (a redirect: not followed, nor passed on)" if upstream.status < 400 else ""
            raise _Upstream(f"HTTP {upstream.status}{what}")
        return upstream

    async def _whole(self, upstream: Answer) -> bytes:
        try:
            async with timeout(self.config.timeouts.first_byte_s):
                return await upstream.read()
        except (asyncio.TimeoutError, UpstreamError) as exc:
            raise _Upstream(f"no whole answer: {type(exc).__name__}") from exc

    async def _first(self, upstream: Answer) -> bytes:
        try:
            async with timeout(self.config.timeouts.first_byte_s):
                first = await upstream.readany()
        except (asyncio.TimeoutError, UpstreamError) as exc:
            raise _Upstream(f"no first byte: {type(exc).__name__}") from exc
        if not first:
            raise _Upstream("the answer ended before its first byte")
        return first

    def _compare(self, decision: RouteDecision, tail: bytes) -> None:
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


def _describe(span: object, decisions: list[RouteDecision]) -> None:
    """A decision span's attributes: the engines in the order tried, each one's predicted cost, and the reason."""
    span.set_attributes({  # type: ignore[attr-defined]  # an OpenTelemetry span (an optional package)
        "candidates": [d.engine for d in decisions],
        "predicted_ttft_s": [round(d.predicted_s, 6) for d in decisions],
        "predicted_cached_tokens": [d.predicted_cached for d in decisions],
        "uncached_tokens": [d.uncached for d in decisions],
        "chosen": decisions[0].engine if decisions else "",
        "reason": decisions[0].reason if decisions else "no_healthy_engine",
    })
