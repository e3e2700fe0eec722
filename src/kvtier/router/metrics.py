"""The router's Prometheus metrics, under ``kvtier_router_*`` (never the engines' ``vllm:`` names)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

if TYPE_CHECKING:
    from kvtier.router.policy import Signals

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30)
PD_OUTCOMES = ("handoff", "local", "no_prefill_engine", "prefill_failed", "nothing_stored", "not_prefilled")
PD_PREFILL_CAUSES = ("http_error", "timeout", "disconnected", "no_params", "bad_answer")


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvtier_router_requests", "Requests routed, by engine, policy reason and outcome",
                                ["engine", "reason", "outcome"], registry=r)
        self.retries = Counter("kvtier_router_retries", "Requests sent to another engine after one failed before "
                               "its first byte, by the engine that failed", ["engine"], registry=r)
        self.stream_errors = Counter("kvtier_router_stream_errors", "Streams ended with an SSE error event after "
                                     "their first byte, by engine and cause", ["engine", "cause"], registry=r)
        self.client_aborts = Counter("kvtier_router_client_aborts", "Requests the client left before the end "
                                     "(the upstream request is aborted)", ["engine"], registry=r)
        self.predicted_cached = Counter("kvtier_router_predicted_cached_tokens", "Prompt tokens predicted cached "
                                        "on the chosen engine, for requests whose answer reported cached_tokens",
                                        ["engine"], registry=r)
        self.actual_cached = Counter("kvtier_router_actual_cached_tokens", "Prompt tokens the engine reported "
                                     "cached (usage.prompt_tokens_details.cached_tokens)", ["engine"], registry=r)
        self.predictions = Counter("kvtier_router_cache_predictions", "Answers with cached_tokens, by whether the "
                                   "prediction was exact, over or under", ["engine", "outcome"], registry=r)
        self.ttft = Histogram("kvtier_router_ttft_seconds", "Time to the first byte of a streamed answer, as the "
                              "router sees it", ["engine"], registry=r, buckets=_TTFT_BUCKETS)
        self.predicted_ttft = Histogram("kvtier_router_predicted_ttft_seconds", "Predicted TTFT of the chosen "
                                        "engine", ["engine"], registry=r, buckets=_TTFT_BUCKETS)
        self.index_blocks = Gauge("kvtier_router_index_blocks", "Distinct blocks the index credits an engine with",
                                  ["engine"], registry=r)
        self.event_batches = Counter("kvtier_router_event_batches", "KV-event batches applied", ["engine"],
                                     registry=r)
        self.event_lag = Histogram("kvtier_router_event_lag_seconds", "From a batch's timestamp to its arrival",
                                   ["engine"], registry=r, buckets=_LAG_BUCKETS)
        self.event_gaps = Counter("kvtier_router_event_gaps", "KV-event batches missed and not recovered by replay",
                                  ["engine"], registry=r)
        self.event_replays = Counter("kvtier_router_event_replays", "Replays asked of an engine's replay socket",
                                     ["engine"], registry=r)
        self.event_resets = Counter("kvtier_router_event_resets", "Times an engine's entries were cleared (restart, "
                                    "death, AllBlocksCleared)", ["engine", "cause"], registry=r)
        self.event_errors = Counter("kvtier_router_event_errors", "KV-event messages skipped (malformed, too "
                                    "large, dropped from a full queue, replayed out of range) and replays that "
                                    "failed, by kind",
                                    ["engine", "kind"], registry=r)
        self.index_unusable = Gauge("kvtier_router_index_unusable", "Stored blocks the index could not place "
                                    "or keep (orphans, other block sizes, hashes reused, past an engine's cap), "
                                    "since start", ["reason"], registry=r)
        self.healthy = Gauge("kvtier_router_engine_healthy", "1 if the engine answers /health", ["engine"],
                             registry=r)
        self.prefill_rate = Gauge("kvtier_router_prefill_seconds_per_token", "Calibrated prefill cost",
                                  ["engine"], registry=r)
        self.decode_wait = Gauge("kvtier_router_decode_wait_seconds", "Calibrated wait each request decoding on "
                                 "an engine adds to a new request's", ["engine"], registry=r)
        self.in_flight = Gauge("kvtier_router_in_flight", "Requests sent to an engine and not finished",
                               ["engine"], registry=r)
        self.refused = Counter("kvtier_router_refused_requests", "Requests the router answered itself without an "
                               "engine, by reason (body_too_large, body_budget, body_timeout, busy, bad_body, "
                               "bad_header)", ["reason"], registry=r)
        self.refused_connections = Counter("kvtier_router_refused_connections", "Connections closed as they were "
                                           "accepted: limits.max_connections open, each with a request in flight",
                                           ["listener"], registry=r)
        self.evicted_connections = Counter("kvtier_router_evicted_connections", "Idle connections (headers not "
                                           "complete, or between requests) closed to admit a new one at "
                                           "limits.max_connections", ["listener"], registry=r)
        self.connections = Gauge("kvtier_router_connections", "Open connections, by listener", ["listener"],
                                 registry=r)
        self.unpredicted = Counter("kvtier_router_unpredicted_requests", "Requests routed without a cache "
                                   "prediction, by why (unreadable, too_long, failed, busy: every worker was busy)",
                                   ["kind"], registry=r)
        self.pd_requests = Counter("kvtier_router_pd_requests", "Requests the P/D policy considered, by outcome "
                                   "(handoff: prefilled elsewhere; local: served whole by the engine answering, "
                                   "its uncached tokens under pd.local_tokens; no_prefill_engine; prefill_failed: "
                                   "every prefill engine tried failed, served whole; nothing_stored: the prefill "
                                   "engine stored nothing, served whole; not_prefilled: its P/D bodies could not be "
                                   "made (beam search, every worker busy, the body budget spent), served whole)",
                                   ["outcome"], registry=r)
        self.pd_prefill_seconds = Histogram("kvtier_router_pd_prefill_seconds", "A prefill hop's time, from its "
                                            "request to the prefill engine's whole answer", ["engine"], registry=r,
                                            buckets=_TTFT_BUCKETS)
        self.pd_prefill_failures = Counter("kvtier_router_pd_prefill_failures", "Prefill hops that failed, by "
                                           "engine and cause (an engine's own failure, a connection, 5xx, redirect "
                                           "or timeout, is retried on the next prefill engine; a 4xx or an answer "
                                           "without kvtier's params serves the request whole at once)",
                                           ["engine", "cause"], registry=r)
        self._fleet(r)
        self.prompt_queue = Gauge("kvtier_router_prompt_work", "Requests being parsed, tokenized and keyed or "
                                  "waiting for a worker", registry=r)

    def _fleet(self, r: CollectorRegistry) -> None:
        """The fleet's series: its size, config reloads, and each engine's load signals (read from the router's
        accounting at each scrape, :meth:`watch`): what an autoscaler scales on."""
        self.queued = Gauge("kvtier_router_queued_requests", "Requests sent to an engine whose prefill (or load) the "
                            "router predicts is not done", ["engine"], registry=r)
        self.queued_tokens = Gauge("kvtier_router_queued_tokens", "Tokens the queued requests compute",
                                   ["engine"], registry=r)
        self.in_flight_tokens = Gauge("kvtier_router_in_flight_tokens", "Tokens the requests in flight computed "
                                      "or compute", ["engine"], registry=r)
        self.ttft_now = Gauge("kvtier_router_predicted_ttft_now_seconds", "A new one-block request's predicted "
                              "time to first token on the engine, now", ["engine"], registry=r)
        self.ttft_slo = Counter("kvtier_router_ttft_slo_requests", "Streamed requests by whether their time to "
                                "first token was within ttft_slo_s (met) or over it (missed)", ["engine", "outcome"],
                                registry=r)
        self.reloads = Counter("kvtier_router_config_reloads", "Reads of the config file for its engines, by outcome "
                               "(applied: the fleet changed; unchanged; refused: a bad file, the running fleet "
                               "kept)", ["outcome"], registry=r)
        self.fleet = Gauge("kvtier_router_engines", "Engines in the fleet (healthy or not)", registry=r)
        self.discovery_errors = Counter(
            "kvtier_router_discovery_errors", "Failures of the discovery sources, by kind (dns, kubernetes: no "
            "answer, the engines found kept; expired, watch_ended: a watch the API ended, watched again after a "
            "wait; port: endpoints without a configured port; engine: an endpoint no engine could be named after; "
            "name, address: an engine named or at an address already; max_engines: more found than allowed; "
            "apply: the fleet not applied, tried again; source: a source stopped)", ["kind"], registry=r)
        self.discovered = Gauge("kvtier_router_discovered_engines", "Engines a discovery source finds now",
                                ["source"], registry=r)

    def watch(self, engines: Sequence[str], signals: Callable[[str], Signals]) -> None:
        """Read each engine's load signals at every scrape (``signals(engine)``)."""
        fields = ((self.queued, "queued"), (self.queued_tokens, "queued_tokens"),
                  (self.in_flight_tokens, "in_flight_tokens"), (self.ttft_now, "ttft_s"))
        for name in engines:
            for gauge, field in fields:
                gauge.labels(name).set_function(
                    lambda n=name, f=field: getattr(signals(n), f))  # type: ignore[misc]  # mypy: default-bound lambda

    def forget(self, engine: str) -> None:
        """Remove every series of ``engine`` (it left the fleet): no alert fires for an engine that is gone, and
        dashboards show the engines there are."""
        for family in vars(self).values():
            if not isinstance(family, MetricWrapperBase):
                continue
            for metric in family.collect():
                ours = [sample.labels for sample in metric.samples if sample.labels.get("engine") == engine]
                if not ours:
                    continue
                names = min((tuple(labels) for labels in ours), key=len)  # (a histogram's buckets add "le")
                for values in {tuple(labels[n] for n in names) for labels in ours}:
                    family.remove(*values)

    def declare(self, engines: list[str], evented: list[str], prefill: Sequence[str] = ()) -> None:
        """Create the per-engine series of fixed label sets at 0, so dashboards and alerts have a series (a rate of
        0) before the first event; ``evented``: the engines whose KV events the router follows; ``prefill``: the
        prefill engines (disaggregated prefill and decode)."""
        for name in prefill:
            for cause in PD_PREFILL_CAUSES:
                self.pd_prefill_failures.labels(name, cause)
        if prefill:
            for outcome in PD_OUTCOMES:
                self.pd_requests.labels(outcome)
        for name in engines:
            for family in (self.retries, self.client_aborts, self.healthy, self.in_flight, self.index_blocks):
                family.labels(name)
            for cause in ("idle_timeout", "disconnected"):
                self.stream_errors.labels(name, cause)
            for outcome in ("met", "missed"):
                self.ttft_slo.labels(name, outcome)
            self.event_resets.labels(name, "health")
        for name in evented:
            for family in (self.event_batches, self.event_gaps, self.event_replays):
                family.labels(name)
            for cause in ("sequence", "all_blocks_cleared"):
                self.event_resets.labels(name, cause)
            for kind in ("task", "decode", "too_large", "frames", "dropped", "apply", "replay_endpoint",
                         "replay_range", "replay_timeout", "replay_bytes"):
                self.event_errors.labels(name, kind)
        for reason in ("body_too_large", "body_budget", "body_timeout", "busy", "bad_body", "bad_header"):
            self.refused.labels(reason)
        for kind in ("unreadable", "too_long", "failed", "busy"):
            self.unpredicted.labels(kind)
        for outcome in ("applied", "unchanged", "refused"):
            self.reloads.labels(outcome)


class _Increment(Protocol):
    def inc(self) -> None: ...


class CountsByKind(Protocol):
    """What :class:`LogOnce` counts through: a :class:`~prometheus_client.Counter` with one label, or a stand-in
    with the same ``labels(kind).inc()``."""

    def labels(self, kind: str) -> _Increment: ...


class LogOnce:
    """Log the first occurrence of each kind, count every one in ``counter`` (labelled by kind; None where the
    caller counts them itself): for what a client or a peer can cause at will, so the log never grows with them.
    With ``every_s``, a kind is logged again once that long has passed since it last was (for events an operator
    must see each time they truly happen, such as an engine's restart, which a forged publisher could repeat at
    will). Kinds are the code's own few names; anything a client sent goes into the message through ``%r`` (its
    newlines escaped: no forged log lines)."""

    def __init__(self, counter: CountsByKind | None, metric: str, logger: logging.Logger, level: int = logging.INFO,
                 every_s: float | None = None) -> None:
        self._counter, self._metric, self._log, self._level = counter, metric, logger, level
        self._every_s = every_s
        self._logged: dict[str, tuple[float, int]] = {}  # kind: (when last logged, how many since)
        self._lock = threading.Lock()  # called from worker threads too

    def __call__(self, kind: str, message: str, *args: object) -> None:
        if self._counter is not None:
            self._counter.labels(kind).inc()
        now = time.monotonic()
        with self._lock:
            last = self._logged.get(kind)
            due = last is None or (self._every_s is not None and now - last[0] >= self._every_s)
            if due:
                self._logged[kind] = (now, 0)
            else:
                assert last is not None
                self._logged[kind] = (last[0], last[1] + 1)
        if not due:
            return
        if self._every_s is None:
            note = f"logged once: further ones of this kind are only counted, {self._metric}{{kind={kind!r}}}"
        else:
            skipped = f"; {last[1]} since the last one logged" if last is not None else ""
            note = f"logged at most once every {self._every_s:.0f} s, all counted in {self._metric}{skipped}"
        self._log.log(self._level, f"{message} ({note})", *args)
