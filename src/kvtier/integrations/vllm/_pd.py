"""Disaggregated prefill and decode through kvtier (docs/pd.md): the scheduler side's part of the handoff.

A request's ``kv_transfer_params`` (vLLM passes the OpenAI body's field to ``Request.kv_transfer_params``) may
carry kvtier's own sub-dict, ``{"kvtier": {...}}``, written by kvtier's router (the wire format: :mod:`kvtier.pd`):

- ``{"pd": "prefill"}``: a prefill engine computes the prompt. Its save is a handoff (the cascade keeps it within
  a budget of its own and writes it first) and, once the request ends, vLLM's answer carries what was stored:
  ``{"kvtier": {"pd": "stored", "tokens": N, "namespace": ID, "key": HEX}}`` (N leading prompt tokens, the
  namespace's id, the key of the last chunk or tail stored), or ``{"kvtier": {"pd": "none"}}`` when nothing was.
- ``{"pd": "decode", "tokens": N, "namespace": ID, "key": HEX, "wait_s": S}``: a decode engine serves the
  request. Its lookup answers "ask again" (vLLM's ``None``: no blocks are held meanwhile) until the N tokens are
  visible in the store, ``S`` seconds have passed (at most the connector's ``pd_wait_max_seconds``) or every
  secondary tier is in an outage (or the store has none); then it loads what is there and vLLM computes the
  rest. A namespace or key that differs from this engine's own for the prompt (another tokenization, model, salt)
  means no wait, as does a promise of less than one chunk.

Every request's handoff is counted once, by side and outcome (``kvtier_connector_pd_requests_total``); a decode
request aborted while it waits counts as ``aborted``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from prometheus_client import Counter, Histogram

from kvtier import pd
from kvtier.keys import Namespace, chunk_keys
from kvtier.store import KVStore

POLL_SECONDS = 0.02  # between two lookups of a decode request waiting for its KV (a tier is asked at most this often)
PREFILL_OUTCOMES = ("stored", "none", "bad_params")
DECODE_OUTCOMES = ("complete", "partial", "timed_out", "tier_down", "mismatch", "short", "bad_params", "aborted")
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class PDMetrics:
    def __init__(self, store: KVStore) -> None:
        registry = store.metrics.registry
        self.requests = Counter("kvtier_connector_pd_requests", "Disaggregated prefill/decode requests, by side "
                                "and outcome (docs/pd.md)", ["side", "outcome"], registry=registry)
        self.wait_seconds = Histogram("kvtier_connector_pd_wait_seconds", "Time a decode request waited for the "
                                      "KV its prefill engine stored", registry=registry, buckets=_WAIT_BUCKETS)
        for outcome in PREFILL_OUTCOMES:
            self.requests.labels("prefill", outcome)
        for outcome in DECODE_OUTCOMES:
            self.requests.labels("decode", outcome)


@dataclasses.dataclass
class _Wait:
    target: int  # tokens the lookup must find for the handoff to be complete
    started: float  # monotonic
    deadline: float
    next_poll: float = 0.0


class Handoffs:
    """The P/D state of the scheduler's requests: which are prefills, and the decode requests still waiting."""

    def __init__(self, store: KVStore, metrics: PDMetrics, *, unit: int, tails: bool, wait_max: float) -> None:
        self._store = store
        self._metrics = metrics
        self._chunk = store.chunk_tokens
        self._unit = unit  # what a request's KV is stored as: blocks (with tails) or chunks
        self._tails = tails
        self._wait_max = wait_max
        self._prefills: set[str] = set()
        self._waits: dict[str, _Wait] = {}
        self._settled: set[str] = set()  # decode requests (and requests without P/D) whose handoff was decided

    def begin(self, request: Any, ns: Namespace | None, tokens: list[int]) -> None:
        """Read a request's role at its first lookup (later lookups of the same request change nothing). ``ns``
        None: the connector neither looks the request up nor saves it (a prefill's answer is then "none")."""
        rid = request.request_id
        if rid in self._settled or rid in self._waits or rid in self._prefills:
            return
        params = getattr(request, "kv_transfer_params", None)
        try:
            read = pd.read_request(params)
        except pd.BadParams:
            # Never trusted further: served as a request without P/D (a prefill's save stays an ordinary save)
            own = params.get(pd.FIELD) if isinstance(params, dict) else None
            claims_decode = isinstance(own, dict) and own.get("pd") == "decode"
            self._settle(rid, "bad_params", "decode" if claims_decode else "prefill")
            return
        if read is None:
            self._settled.add(rid)
        elif read[0] == "prefill":
            self._prefills.add(rid)
        elif ns is None:
            self._settle(rid, "mismatch")  # KV this engine does not name: nothing to wait for
        else:
            assert read[1] is not None
            self._expect(rid, ns, tokens, read[1], read[2])

    def _expect(self, rid: str, ns: Namespace, tokens: list[int], promise: pd.Stored, wait_s: float) -> None:
        """Wait for a decode request's promised KV, unless it is less than a chunk or not this prompt's."""
        if promise.tokens < self._chunk or promise.tokens > len(tokens):
            self._settle(rid, "short" if promise.tokens < self._chunk else "mismatch")
            return
        named = self._store.named(ns)
        if named.id != promise.namespace or self._last_key(named, tokens[:promise.tokens]) != promise.key:
            self._settle(rid, "mismatch")
            return
        if self._store.tiers_down:  # no tier could show another engine's writes: waiting is in vain
            self._settle(rid, "tier_down")
            return
        now = time.monotonic()
        self._waits[rid] = _Wait(promise.tokens, now, now + min(wait_s, self._wait_max))

    def _last_key(self, named: Namespace, tokens: list[int]) -> str:
        keys = chunk_keys(named, tokens, self._chunk, tail=self._tails)
        return keys[-1].hex() if keys else ""

    def paused(self, rid: str) -> bool:
        """A decode request between two lookups of its wait: vLLM is told to ask again, no tier is asked."""
        wait = self._waits.get(rid)
        return wait is not None and time.monotonic() < wait.next_poll

    def waiting(self, rid: str, found: int, cap: int) -> bool:
        """Whether a decode request, whose lookup found ``found`` leading tokens (of at most ``cap`` it may
        load), goes on waiting. When it stops, its outcome is counted."""
        wait = self._waits.get(rid)
        if wait is None:
            return False
        now = time.monotonic()
        if found >= min(wait.target, cap):
            outcome = "complete"
        elif self._store.tiers_down:
            outcome = "tier_down"
        elif now >= wait.deadline:
            outcome = "partial" if found else "timed_out"
        else:
            wait.next_poll = now + POLL_SECONDS
            return True
        del self._waits[rid]
        self._metrics.wait_seconds.observe(now - wait.started)
        self._settle(rid, outcome)
        return False

    def is_prefill(self, rid: str) -> bool:
        return rid in self._prefills

    def answer(self, rid: str, stored: tuple[Namespace, list[int]] | None) -> dict[str, Any] | None:
        """What a finished prefill request tells its router (None for any other request): ``stored`` is the
        namespace and the leading tokens its save covered, None when none was planned."""
        if rid not in self._prefills:
            return None
        # Nothing planned, or nothing a decode engine could load: KV that reaches no shared tier (placement, no
        # tenant key) would only make it wait
        if stored is None or not stored[1] or not self._store.reaches_shared(stored[0]):
            self._metrics.requests.labels("prefill", "none").inc()
            return {pd.FIELD: dict(pd.NOTHING_STORED)}
        named = self._store.named(stored[0])
        self._metrics.requests.labels("prefill", "stored").inc()
        return {pd.FIELD: pd.Stored(len(stored[1]), named.id, self._last_key(named, stored[1])).answer()}

    def next_poll(self) -> float | None:
        """When the earliest decode request waiting for its KV asks the tiers again (monotonic), if any waits."""
        return min((wait.next_poll for wait in self._waits.values()), default=None)

    def _settle(self, rid: str, outcome: str, side: str = "decode") -> None:
        self._settled.add(rid)
        self._metrics.requests.labels(side, outcome).inc()

    def finished(self, rid: str) -> None:
        self._prefills.discard(rid)
        if self._waits.pop(rid, None) is not None:  # aborted (or failed) while it waited
            self._metrics.requests.labels("decode", "aborted").inc()
        self._settled.discard(rid)
