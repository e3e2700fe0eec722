"""Disaggregated prefill and decode through kvtier (docs/pd.md): the scheduler side's part of the handoff.

A request's ``kv_transfer_params`` (vLLM passes the OpenAI body's field to ``Request.kv_transfer_params``) may
carry kvtier's own sub-dict, ``{"kvtier": {...}}``, written by kvtier's router:

- ``{"pd": "prefill"}``: a prefill engine computes the prompt. Its save is a handoff (the cascade keeps it within
  a budget of its own and writes it first) and, once the request ends, vLLM's answer carries what was stored:
  ``{"kvtier": {"pd": "stored", "tokens": N, "namespace": ID, "key": HEX}}`` (N leading prompt tokens, the
  namespace's id, the key of the last chunk or tail stored), or ``{"kvtier": {"pd": "none"}}`` when nothing was.
- ``{"pd": "decode", "tokens": N, "namespace": ID, "key": HEX, "wait_s": S}``: a decode engine serves the
  request. Its lookup answers "ask again" (vLLM's ``None``: no blocks are held meanwhile) until the N tokens are
  visible in the store, ``S`` seconds have passed (at most the connector's ``pd_wait_max_seconds``) or every
  secondary tier is in an outage; then it loads what is there and vLLM computes the rest. A namespace or key that
  differs from this engine's own for the prompt (another tokenization, model, salt) means no wait, as does a
  promise of less than one chunk.

Every request's handoff is counted once, by side and outcome (``kvtier_connector_pd_requests_total``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from prometheus_client import Counter, Histogram

from kvtier.keys import Namespace, chunk_keys
from kvtier.store import KVStore

PD_FIELD = "kvtier"
POLL_SECONDS = 0.02  # between two lookups of a decode request waiting for its KV (a tier is asked at most this often)
PREFILL_OUTCOMES = ("stored", "none", "bad_params")
DECODE_OUTCOMES = ("complete", "partial", "timed_out", "tier_down", "mismatch", "short", "bad_params")
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_HEX = frozenset("0123456789abcdef")


class BadParams(ValueError):
    """kvtier's sub-dict of ``kv_transfer_params`` is not one this release reads."""


@dataclasses.dataclass(frozen=True)
class Promise:
    """What a prefill engine stored, as the decode request carries it."""

    tokens: int
    namespace: str
    key: str
    wait_s: float


def _hex(value: object, field: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 128 or not set(value) <= _HEX:
        raise BadParams(f"kv_transfer_params.kvtier.{field}: lowercase hex of at most 128 digits, got {value!r}")
    return value


def parse(params: object) -> tuple[str, Promise | None] | None:
    """The request's P/D role (``prefill`` or ``decode``, with the decode's promise), or None when its
    ``kv_transfer_params`` carry no kvtier sub-dict. Raises :class:`BadParams` for one this release cannot read."""
    if not isinstance(params, dict) or PD_FIELD not in params:
        return None
    own = params[PD_FIELD]
    if not isinstance(own, dict):
        raise BadParams(f"kv_transfer_params.kvtier: a mapping, got {type(own).__name__}")
    role = own.get("pd")
    if role == "prefill":
        return "prefill", None
    if role != "decode":
        raise BadParams(f"kv_transfer_params.kvtier.pd: 'prefill' or 'decode', got {role!r}")
    tokens, wait_s = own.get("tokens"), own.get("wait_s", 0.0)
    if type(tokens) is not int or not 0 <= tokens <= 2**31:
        raise BadParams(f"kv_transfer_params.kvtier.tokens: an integer in [0, 2**31], got {tokens!r}")
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not math.isfinite(wait_s) or wait_s < 0:
        raise BadParams(f"kv_transfer_params.kvtier.wait_s: seconds, a number >= 0, got {wait_s!r}")
    return "decode", Promise(tokens, _hex(own.get("namespace"), "namespace"), _hex(own.get("key"), "key"),
                             float(wait_s))


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
    promise: Promise
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

    def begin(self, request: Any, ns: Namespace, tokens: list[int]) -> None:
        """Read a request's role at its first lookup (later lookups of the same request change nothing)."""
        rid = request.request_id
        if rid in self._settled or rid in self._waits or rid in self._prefills:
            return
        try:
            parsed = parse(getattr(request, "kv_transfer_params", None))
        except BadParams:
            # Never trusted further: served as a request without P/D (a prefill's save stays an ordinary save)
            self._settle(rid, "bad_params", "decode" if _claims_decode(request) else "prefill")
            return
        if parsed is None:
            self._settled.add(rid)
        elif parsed[0] == "prefill":
            self._prefills.add(rid)
        else:
            assert parsed[1] is not None
            self._expect(rid, ns, tokens, parsed[1])

    def _expect(self, rid: str, ns: Namespace, tokens: list[int], promise: Promise) -> None:
        """Wait for a decode request's promised KV, unless it is less than a chunk or not this prompt's."""
        if promise.tokens < self._chunk or promise.tokens > len(tokens):
            self._settle(rid, "short" if promise.tokens < self._chunk else "mismatch")
            return
        named = self._store.named(ns)
        if named.id != promise.namespace or self._last_key(named, tokens[:promise.tokens]) != promise.key:
            self._settle(rid, "mismatch")
            return
        now = time.monotonic()
        # The lookup ends at the last whole block before the prompt's last token (which the engine computes)
        self._waits[rid] = _Wait(promise, promise.tokens, now, now + min(promise.wait_s, self._wait_max))

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
        if stored is None or not stored[1]:
            self._metrics.requests.labels("prefill", "none").inc()
            return {PD_FIELD: {"pd": "none"}}
        named = self._store.named(stored[0])
        self._metrics.requests.labels("prefill", "stored").inc()
        return {PD_FIELD: {"pd": "stored", "tokens": len(stored[1]), "namespace": named.id,
                           "key": self._last_key(named, stored[1])}}

    def _settle(self, rid: str, outcome: str, side: str = "decode") -> None:
        self._settled.add(rid)
        self._metrics.requests.labels(side, outcome).inc()

    def finished(self, rid: str) -> None:
        self._prefills.discard(rid)
        self._waits.pop(rid, None)
        self._settled.discard(rid)


def _claims_decode(request: Any) -> bool:
    params = getattr(request, "kv_transfer_params", None)
    own = params.get(PD_FIELD) if isinstance(params, dict) else None
    return isinstance(own, dict) and own.get("pd") == "decode"
