"""The router's side of disaggregated prefill and decode (docs/pd.md): the prefill hop before a request is sent to
the engine that answers it (the wire format: :mod:`kvtier.pd`).

Once the plan says P/D, :func:`bodies` writes on a worker thread the two requests a P/D route sends: the prefill
(the client's body with ``max_tokens: 1``, not streamed, without what would make its one token larger or dearer,
carrying ``kv_transfer_params.kvtier = {"pd": "prefill"}``) and the decode, the client's body with kvtier's
sub-dict left as a slot filled once the prefill answered (:meth:`PDBodies.decode`, a concatenation on the event
loop). A client's own ``kv_transfer_params`` never reach an engine (:mod:`kvtier.router.reading` drops them):
what passes between engines is the router's to say.

:class:`Prefills` runs the hop: the prefill engines in the plan's order, each answer read whole (bounded) and its
``kv_transfer_params.kvtier`` checked. An engine that fails (connection, 5xx, timeout) is counted and the next is
tried; a 4xx or an answer without kvtier's params would be the same on every one, so the request goes on at once;
when none answers, the request is served whole by its decode engine (a P/D failure never reaches the client). A
prefill first waits (bounded) for one in flight on the same engine that computes the same first
``pd.local_tokens`` tokens, which the engine does not hold yet, so that a burst sharing a new prefix computes it
once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Sequence

from kvtier import pd, tracing
from kvtier.router.config import RouterConfig
from kvtier.router.engines import WARN_EVERY_S, Engines
from kvtier.router.guards import timeout
from kvtier.router.metrics import LogOnce, RouterMetrics
from kvtier.router.policy import RouteDecision, Router
from kvtier.router.upstream import Answer, ConnectionLost, UpstreamError

log = logging.getLogger(__name__)

MAX_PREFILL_ANSWER_BYTES = 1 << 20  # a one-token answer: a larger one is not a prefill's
# What the prefill hop does not send: its answer is one token that nobody reads, and these would make it larger
# (echo, logprobs), compute more (n, best_of, beam search) or be refused with max_tokens 1 (min_tokens)
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "echo", "logprobs", "top_logprobs", "prompt_logprobs", "n",
                    "best_of", "use_beam_search")


@dataclasses.dataclass(frozen=True)
class PDBodies:
    """A request's two P/D bodies: the prefill's whole, the decode's around the slot for kvtier's sub-dict."""

    prefill: bytes
    decode_head: bytes
    decode_tail: bytes

    @property
    def size(self) -> int:
        return len(self.prefill) + len(self.decode_head) + len(self.decode_tail)

    def decode(self, promise: pd.Stored, wait_s: float) -> bytes:
        """The decode request's body carrying ``promise`` (a prefill's answer) and the wait bound."""
        return self.decode_head + json.dumps(promise.decode(wait_s)).encode() + self.decode_tail


def bodies(raw: bytes) -> PDBodies | None:
    """The P/D bodies of a request body the router already read (a JSON object, without a client's
    ``kv_transfer_params``), or None for one P/D cannot serve (beam search): it is served whole. On a worker."""
    body = json.loads(raw)
    if body.get("use_beam_search") is True:
        return None
    prefill = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    prefill.update(stream=False, max_tokens=1, kv_transfer_params={pd.FIELD: {"pd": "prefill"}})
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    slot = "kvtier-slot-" + uuid.uuid4().hex  # a string no client can have guessed: the body is split there
    text = json.dumps({**body, "kv_transfer_params": {pd.FIELD: slot}}).encode()
    head, sep, tail = text.partition(json.dumps(slot).encode())
    assert sep, "the slot is in the body"
    return PDBodies(json.dumps(prefill).encode(), head, tail)


def promise_of(answer: bytes) -> pd.Stored | None:
    """What a prefill engine's answer says it stored (None: nothing). Raises :class:`kvtier.pd.BadParams` for an
    answer that is not JSON or carries no kvtier sub-dict, or one this release does not read."""
    try:
        data = json.loads(answer)
    except (ValueError, RecursionError):
        raise pd.BadParams("the answer is not JSON") from None
    return pd.read_answer(data.get("kv_transfer_params") if isinstance(data, dict) else None)


class _Failed(Exception):
    """A prefill engine's failure; ``retry``: another prefill engine may do better (a 4xx or an answer without
    kvtier's params would be the same on every one: the request is served whole at once)."""

    def __init__(self, cause: str, detail: str, retry: bool = True) -> None:
        super().__init__(detail)
        self.cause = cause
        self.retry = retry


class Prefills:
    """The prefill hop of P/D routes, and the prefills in flight (by engine) that a new one may wait for."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, router: Router, engines: Engines) -> None:
        self._failed = LogOnce(None, "kvtier_router_pd_prefill_failures_total", log, logging.WARNING,
                               every_s=WARN_EVERY_S)
        self.config = config
        self.metrics = metrics
        self.router = router
        self.engines = engines
        self._flying: dict[str, list[tuple[Sequence[bytes], asyncio.Event]]] = {}
        # The block whose key is shared once two prompts share pd.local_tokens tokens (keys chain: one equal key
        # means an equal prefix)
        self._shared_block = max(1, config.pd.local_tokens // config.block_size) - 1

    async def run(self, bodies: PDBodies, path: str, headers: dict[str, str], decisions: list[RouteDecision],
                  keys: Sequence[bytes]) -> pd.Stored | None:
        """The promise of the first prefill engine that stores the prompt, or None: the request is then served
        whole by its decode engine (the outcome is counted either way)."""
        with tracing.span("kvtier.router.prefill", request_id=headers.get("X-Request-Id", "")) as span:
            outcome, promise = "prefill_failed", None
            for attempt, decision in enumerate(decisions[:1 + self.config.retries]):
                try:
                    promise = await self._one(bodies.prefill, path, headers, decision, keys)
                except _Failed as exc:
                    self.metrics.requests.labels(decision.engine, "prefill", "failed").inc()
                    self.metrics.pd_prefill_failures.labels(decision.engine, exc.cause).inc()
                    last = not exc.retry or attempt >= min(self.config.retries, len(decisions) - 1)
                    self._failed(f"{exc.cause}:{decision.engine}", "request %r: prefill engine %s failed (%s)%s",
                                 headers.get("X-Request-Id"), decision.engine, exc,
                                 "; served whole by its decode engine" if last else "; trying the next")
                    if last:
                        break
                    continue
                self.metrics.requests.labels(decision.engine, "prefill", "ok").inc()
                outcome = "handoff" if promise is not None else "nothing_stored"
                if span is not None:
                    span.set_attribute("engine", decision.engine)
                break
            if span is not None:
                span.set_attribute("outcome", outcome)
        self.metrics.pd_requests.labels(outcome).inc()
        return promise

    async def _one(self, body: bytes, path: str, headers: dict[str, str], decision: RouteDecision,
                   keys: Sequence[bytes]) -> pd.Stored | None:
        """One prefill on one engine (after any prefill in flight there computing this prompt's first
        ``pd.local_tokens`` tokens): what it stored."""
        name = decision.engine
        if name not in self.router.engines:
            raise _Failed("disconnected", "it left the fleet")  # (after this request's plan was made): the next
        await self._after_shared(name, decision, keys)
        if name not in self.router.engines:
            raise _Failed("disconnected", "it left the fleet")  # (while this prefill waited)
        done, flying = asyncio.Event(), self._flying.setdefault(name, [])
        entry = (keys, done)
        flying.append(entry)
        flight, computed = None, False
        try:
            flight = self.router.started(decision, keys)
            start = time.monotonic()
            answer = await self._post(name, path, body, headers)
            computed = True
            try:
                promise = promise_of(answer)
            except pd.BadParams as exc:
                raise _Failed("no_params", f"{exc} (is its connector kvtier's?)", retry=False) from None
            elapsed = time.monotonic() - start
            self.router.first_byte(name, flight, elapsed)  # a one-token answer: its time is the prefill's
            self.metrics.pd_prefill_seconds.labels(name).observe(elapsed)
            return promise
        finally:
            done.set()  # first: nothing below may leave a later prefill waiting on it
            flying.remove(entry)
            if flight is not None:
                self.router.finished(name, flight, computed)

    async def _after_shared(self, name: str, decision: RouteDecision, keys: Sequence[bytes]) -> None:
        """Wait for the first of the prefills in flight on ``name`` that compute this prompt's first
        ``pd.local_tokens`` tokens, which the engine does not hold yet (its events have not announced them): once it
        ends, the engine computes only what differs. At most twice the predicted time of computing that prefix (at
        least 0.1 s, at most ``pd.prefill_timeout_s``), so a prefill that shares a prefix with a slow one (a long
        tail of its own) is delayed by no more than that."""
        j = self._shared_block
        if len(keys) <= j or self.router.index.announced_run(name, keys) > j:
            return
        waits = [done for other, done in self._flying.get(name, ()) if len(other) > j and other[j] == keys[j]]
        if not waits:
            return
        engine = self.router.engines.get(name)
        if engine is None:
            return
        bound = min(self.config.pd.prefill_timeout_s,
                    max(0.1, 2 * (j + 1) * self.config.block_size * self.router.prefill_rate(engine)))
        tasks = [asyncio.ensure_future(done.wait()) for done in waits]
        try:  # the first to end has computed the prefix
            await asyncio.wait(tasks, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()

    async def _post(self, name: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        hop = {k: v for k, v in headers.items() if k.lower() not in ("traceparent", "tracestate")}
        hop.update(tracing.headers())
        hop["Content-Type"] = "application/json"
        reply: Answer | None = None
        try:
            async with timeout(self.config.pd.prefill_timeout_s):
                reply = await self.engines.upstream.post(self.engines.urls[name], path, body, hop,
                                                         self.config.timeouts.connect_s)
                if reply.status != 200:  # a 4xx is the request's (every engine would refuse it); a 5xx or a redirect
                    # (never followed) the engine's
                    raise _Failed("http_error", f"HTTP {reply.status}", retry=not 400 <= reply.status < 500)
                parts, size = [], 0
                while part := await reply.readany():
                    size += len(part)
                    if size > MAX_PREFILL_ANSWER_BYTES:
                        raise _Failed("bad_answer", f"an answer over {MAX_PREFILL_ANSWER_BYTES} bytes")
                    parts.append(part)
                reply.release()
        except asyncio.TimeoutError:
            raise _Failed("timeout", f"no answer within pd.prefill_timeout_s ({self.config.pd.prefill_timeout_s} s)"
                          ) from None
        except UpstreamError as exc:
            state = self.router.engines.get(name)
            if state is not None and isinstance(exc, ConnectionLost):
                state.healthy = False  # until its next good health check
            raise _Failed("disconnected", f"{type(exc).__name__}: {exc}") from exc
        except ValueError as exc:  # a header or target that cannot be sent
            raise _Failed("bad_answer", f"the request cannot be sent: {exc}") from exc
        finally:
            if reply is not None:
                reply.close()  # (after release: nothing)
        return b"".join(parts)
