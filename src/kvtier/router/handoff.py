"""The router's side of disaggregated prefill and decode (docs/pd.md): the prefill hop before a request is sent to
the engine that answers it.

On a worker thread, :func:`bodies` writes the two requests a P/D route sends: the prefill (the client's body with
``max_tokens: 1``, not streamed, ``kv_transfer_params.kvtier = {"pd": "prefill"}``) and the decode, the client's
body with kvtier's sub-dict left as a slot filled once the prefill answered (:meth:`PDBodies.decode`, a
concatenation on the event loop). A client's own ``kv_transfer_params.kvtier`` never reaches an engine
(:mod:`kvtier.router.reading` drops it): only the router speaks kvtier's protocol.

:class:`Prefills` runs the hop: the prefill engines in the plan's order, each answer read whole (bounded) and its
``kv_transfer_params.kvtier`` checked; an engine that fails, times out or answers without them is counted and the
next is tried; when none answers, the request is served whole by its decode engine (a P/D failure never reaches
the client). A prefill waits first for one in flight on the same engine whose prompt shares at least
``pd.local_tokens`` tokens with its own, so that a burst sharing a new prefix computes it once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvtier import tracing
from kvtier.router.config import RouterConfig
from kvtier.router.engines import Engines
from kvtier.router.guards import timeout
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import RouteDecision, Router

log = logging.getLogger(__name__)

PD_FIELD = "kvtier"
MAX_PREFILL_ANSWER_BYTES = 1 << 20  # a one-token answer: a larger one is not a prefill's


@dataclasses.dataclass(frozen=True)
class PDBodies:
    """A request's two P/D bodies: the prefill's whole, the decode's around the slot for kvtier's sub-dict."""

    prefill: bytes
    decode_head: bytes
    decode_tail: bytes

    def decode(self, promise: dict[str, Any], wait_s: float) -> bytes:
        """The decode request's body carrying ``promise`` (a prefill's answer) and the wait bound."""
        own = {**promise, "pd": "decode", "wait_s": wait_s}
        return self.decode_head + json.dumps(own).encode() + self.decode_tail


def bodies(body: dict[str, Any]) -> PDBodies | None:
    """The P/D bodies of a parsed request body (without a client's own ``kv_transfer_params.kvtier``), or None
    when its ``kv_transfer_params`` is not a mapping (vLLM refuses it anyway: the request is served whole)."""
    params = body.get("kv_transfer_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return None
    prefill = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    prefill.update(stream=False, max_tokens=1, kv_transfer_params={**params, PD_FIELD: {"pd": "prefill"}})
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    slot = "kvtier-slot-" + uuid.uuid4().hex  # a string no client can have guessed: the body is split there
    text = json.dumps({**body, "kv_transfer_params": {**params, PD_FIELD: slot}}).encode()
    head, sep, tail = text.partition(json.dumps(slot).encode())
    assert sep, "the slot is in the body"
    return PDBodies(json.dumps(prefill).encode(), head, tail)


def promise_of(answer: bytes) -> dict[str, Any] | None:
    """kvtier's sub-dict of a prefill answer's ``kv_transfer_params``: what it stored (``pd`` is ``stored``) or
    that it stored nothing (``none``); None when the answer carries none or it is malformed."""
    try:
        data = json.loads(answer)
    except (ValueError, RecursionError):
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    own = params.get(PD_FIELD) if isinstance(params, dict) else None
    if not isinstance(own, dict):
        return None
    if own.get("pd") == "none":
        return {"pd": "none"}
    tokens, namespace, key = own.get("tokens"), own.get("namespace"), own.get("key")
    if own.get("pd") != "stored" or type(tokens) is not int or tokens < 0 or \
            not all(isinstance(v, str) and 0 < len(v) <= 128 for v in (namespace, key)):
        return None
    return {"pd": "stored", "tokens": tokens, "namespace": namespace, "key": key}


class _Failed(Exception):
    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


class Prefills:
    """The prefill hop of P/D routes, and the prefills in flight (by engine) that a new one may wait for."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, router: Router, engines: Engines) -> None:
        self.config = config
        self.metrics = metrics
        self.router = router
        self.engines = engines
        self._flying: dict[str, list[tuple[Sequence[bytes], asyncio.Event]]] = {}
        # The block whose key is shared once two prompts share pd.local_tokens tokens (keys chain: one equal key
        # means an equal prefix)
        self._shared_block = max(1, config.pd.local_tokens // config.block_size) - 1

    async def run(self, bodies: PDBodies, path: str, headers: dict[str, str], decisions: list[RouteDecision],
                  keys: Sequence[bytes]) -> dict[str, Any] | None:
        """The promise of the first prefill engine that stores the prompt, or None: the request is then served
        whole by its decode engine (the outcome is counted either way)."""
        with tracing.span("kvtier.router.prefill", request_id=headers.get("X-Request-Id", "")) as span:
            outcome, promise = "prefill_failed", None
            for attempt, decision in enumerate(decisions[:1 + self.config.retries]):
                try:
                    found = await self._one(bodies.prefill, path, headers, decision, keys)
                except _Failed as exc:
                    self.metrics.requests.labels(decision.engine, "prefill", "failed").inc()
                    log.warning("request %r: prefill engine %s failed (%s)%s", headers.get("X-Request-Id"),
                                decision.engine, exc, "; trying the next" if attempt < self.config.retries else
                                "; served whole by its decode engine")
                    self.metrics.pd_prefill_failures.labels(decision.engine, exc.cause).inc()
                    continue
                self.metrics.requests.labels(decision.engine, "prefill", "ok").inc()
                outcome, promise = ("handoff", found) if found["pd"] == "stored" else ("nothing_stored", None)
                if span is not None:
                    span.set_attribute("engine", decision.engine)
                break
            if span is not None:
                span.set_attribute("outcome", outcome)
        self.metrics.pd_requests.labels(outcome).inc()
        return promise

    async def _one(self, body: bytes, path: str, headers: dict[str, str], decision: RouteDecision,
                   keys: Sequence[bytes]) -> dict[str, Any]:
        """One prefill on one engine (after any prefill of a shared prefix in flight there): its promise."""
        name = decision.engine
        await self._after_shared(name, keys)
        done = asyncio.Event()
        flying = self._flying.setdefault(name, [])
        entry = (keys, done)
        flying.append(entry)
        flight = self.router.started(decision, keys)
        start, computed = time.monotonic(), False
        try:
            answer = await self._post(name, path, body, headers)
            computed = True
            promise = promise_of(answer)
            if promise is None:
                raise _Failed("no_params", "its answer carries no kv_transfer_params.kvtier (is its connector "
                                           "kvtier's?)")
            elapsed = time.monotonic() - start
            self.router.first_byte(name, flight, elapsed)  # a one-token answer: its time is the prefill's
            self.metrics.pd_prefill_seconds.labels(name).observe(elapsed)
            return promise
        finally:
            self.router.finished(name, flight, computed)
            flying.remove(entry)
            done.set()

    async def _after_shared(self, name: str, keys: Sequence[bytes]) -> None:
        """Wait (within ``pd.prefill_timeout_s``) for the prefills in flight on ``name`` that share this prompt's
        first ``pd.local_tokens`` tokens: once they end, the engine computes only what differs."""
        j = self._shared_block
        if len(keys) <= j:
            return
        waits = [done.wait() for other, done in self._flying.get(name, ()) if len(other) > j and other[j] == keys[j]]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=self.config.pd.prefill_timeout_s)

    async def _post(self, name: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        session = self.engines.session
        assert session is not None
        timeouts = self.config.timeouts
        hop = {k: v for k, v in headers.items() if k.lower() not in ("traceparent", "tracestate")}
        hop.update(tracing.headers())
        hop["Content-Type"] = "application/json"
        try:
            async with timeout(self.config.pd.prefill_timeout_s), session.post(
                    self.engines.urls[name] + path, data=body, headers=hop, allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s)) as reply:
                if reply.status != 200:
                    raise _Failed("http_error", f"HTTP {reply.status}")
                parts, size = [], 0
                async for part in reply.content.iter_any():
                    size += len(part)
                    if size > MAX_PREFILL_ANSWER_BYTES:
                        raise _Failed("bad_answer", f"an answer over {MAX_PREFILL_ANSWER_BYTES} bytes")
                    parts.append(part)
        except asyncio.TimeoutError:
            raise _Failed("timeout", f"no answer within pd.prefill_timeout_s ({self.config.pd.prefill_timeout_s} s)"
                          ) from None
        except aiohttp.ClientError as exc:
            if isinstance(exc, aiohttp.ClientConnectionError):
                self.router.engines[name].healthy = False  # until its next good health check
            raise _Failed("disconnected", f"{type(exc).__name__}: {exc}") from exc
        except ValueError as exc:  # aiohttp's refusal to send this request
            raise _Failed("bad_answer", f"the request cannot be sent: {type(exc).__name__}") from exc
        return b"".join(parts)
