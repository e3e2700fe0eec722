"""Prometheus metrics of one store, in a registry of its own (several stores may live in one process).

:meth:`StoreMetrics.snapshot` reads the same samples back, so ``store.stats()`` and a Prometheus scrape agree.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier import threads

if TYPE_CHECKING:
    from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class StoreMetrics:
    """Counters, gauges and histograms per tier (``dram`` is the primary tier)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._server: tuple[Any, threading.Thread] | None = None
        # Labels that every sample served over HTTP carries, telling this process's metrics from another's (e.g.
        # vLLM's API server: a scheduler process and worker processes, each with a store): set by integrations.
        self.process_labels: dict[str, str] = {}
        self.hits = Counter("kvtier_hit_chunks", "Chunks served by get, by tier that served them", ["tier"],
                            registry=r)
        self.misses = Counter("kvtier_miss_chunks", "Chunks get found in no tier (a get stops at its first)",
                              registry=r)
        self.lookup_tokens = Counter("kvtier_lookup_tokens", "Tokens asked about by lookup", registry=r)
        self.lookup_hit_tokens = Counter("kvtier_lookup_hit_tokens", "Tokens lookup found available", registry=r)
        self.bytes_written = Counter("kvtier_written_bytes", "Bytes written, by tier", ["tier"], registry=r)
        self.bytes_read = Counter("kvtier_read_bytes", "Bytes read, by tier", ["tier"], registry=r)
        self.evictions = Counter("kvtier_evictions", "Shards evicted, by tier", ["tier"], registry=r)
        self.promotions = Counter("kvtier_promotions", "Shards copied into DRAM from a secondary tier",
                                  ["tier"], registry=r)
        self.dropped = Counter("kvtier_dropped_writes", "Writes dropped, by tier and reason", ["tier", "reason"],
                               registry=r)
        self.present_writes = Counter("kvtier_present_writes", "Cascade writes skipped: the tier held the object",
                                      ["tier"], registry=r)
        self.write_errors = Counter("kvtier_write_errors", "Failed tier writes", ["tier"], registry=r)
        self.read_errors = Counter("kvtier_read_errors", "Failed tier reads", ["tier"], registry=r)
        self.corrupt = Counter("kvtier_corrupt_objects", "Objects that failed verification and were removed",
                               ["tier"], registry=r)
        self.unopened = Counter("kvtier_unopened_objects", "Sealed objects under a key this process does not hold "
                                "(a forgotten tenant's, a replay from another tenant): misses, removed",
                                ["tier"], registry=r)
        self.codec_refused = Counter("kvtier_codec_refused_objects", "Objects stored with a codec this tier's reads "
                                     "do not accept (lossy KV where exact is wanted): misses, left in place",
                                     ["tier"], registry=r)
        self.codec_bytes = Counter("kvtier_codec_bytes", "Payload bytes the cascade wrote through each tier's codec: "
                                   "before encoding (form=raw) and as stored (form=stored)", ["tier", "form"],
                                   registry=r)
        self.expired = Counter("kvtier_expired_objects", "Objects found older than their tier's ttl_seconds on read: "
                               "misses, removed", ["tier"], registry=r)
        self.keyring_errors = Counter("kvtier_keyring_errors", "Puts and gets whose tenant key could not be made or "
                                      "read (their secondary tiers skipped)", registry=r)
        self.queue_depth = Gauge("kvtier_queue_depth", "Cascade writes waiting, by tier", ["tier"], registry=r)
        self.used_bytes = Gauge("kvtier_used_bytes", "Bytes held, by tier", ["tier"], registry=r)
        self.capacity_bytes = Gauge("kvtier_capacity_bytes", "Byte budget, by tier", ["tier"], registry=r)
        self.put_seconds = Histogram("kvtier_put_seconds", "Caller-side time of put", registry=r,
                                     buckets=_LATENCY_BUCKETS)
        self.get_seconds = Histogram("kvtier_get_seconds", "Caller-side time of get", registry=r,
                                     buckets=_LATENCY_BUCKETS)
        self.tier_write_seconds = Histogram("kvtier_tier_write_seconds", "Time of one tier write", ["tier"],
                                            registry=r, buckets=_LATENCY_BUCKETS)
        self.tier_read_seconds = Histogram("kvtier_tier_read_seconds", "Time of one tier read", ["tier"],
                                           registry=r, buckets=_LATENCY_BUCKETS)
        self.placement_withheld = Counter("kvtier_placement_withheld", "Shards not queued for a tier because a "
                                          "placement rule keeps their tenant's KV out of it", ["tier"], registry=r)
        self.admission_deferred = Counter("kvtier_admission_deferred_chunks", "Chunks a put did not store because "
                                          "they had not been put admission.store_after times yet", registry=r)
        self.outage = Gauge("kvtier_tier_outage", "1 while a tier's reads or writes are failing (the tier rests "
                            "between retries), else 0", ["tier", "what"], registry=r)

    def declare(self, secondary: Sequence[str]) -> None:
        """Create every per-tier series at 0, so a dashboard's rate() and an alert have a series before the first
        event (a labelled series otherwise appears only when first counted)."""
        for counter in (self.hits, self.bytes_written, self.bytes_read, self.corrupt):
            for tier in ("dram", *secondary):
                counter.labels(tier)
        self.evictions.labels("dram")
        self.dropped.labels("dram", "dram_full")
        for tier in secondary:
            for family in (self.promotions, self.present_writes, self.write_errors, self.read_errors,
                           self.tier_write_seconds, self.tier_read_seconds, self.unopened, self.expired,
                           self.codec_refused):
                family.labels(tier)
            for form in ("raw", "stored"):
                self.codec_bytes.labels(tier, form)
            for reason in ("queue_full", "handoff_budget", "tier_unavailable", "not_encodable"):
                self.dropped.labels(tier, reason)
            self.placement_withheld.labels(tier)
            for what in ("reads", "writes"):
                self.outage.labels(tier, what).set(0)

    def watch_tiers(self, tiers: Sequence[Tier]) -> None:
        """Export the events each tier counts itself (its own evictions, expiries, cleanups)."""
        self.registry.register(_TierEvents(tiers))

    def serve(self, port: int, addr: str = "127.0.0.1", tries: int = 8) -> int | None:
        """Expose the metrics over HTTP for Prometheus; returns the port, or None (with a warning).

        One engine may run several processes with a store each (vLLM's API server has a scheduler process and
        a worker process), so a taken port moves on to the next, up to ``tries`` ports; it never stops the engine.
        """
        for candidate in range(port, port + tries):
            try:
                # its threads (one per scrape) where kvtier's run, named as kvtier's
                self._server = threads.call(functools.partial(
                    start_http_server, candidate, addr=addr, registry=_Labelled(self.registry, self.process_labels)),
                    "kvtier-metrics")
            except OSError:
                continue
            log.info("kvtier metrics on http://%s:%d/metrics", addr, candidate)
            return candidate
        log.warning("kvtier metrics: ports %d-%d on %s are all taken; this process's metrics are not served",
                    port, port + tries - 1, addr)
        return None

    def stop_serving(self) -> None:
        """Close the HTTP endpoint (if serving): the port is free again when this returns."""
        server, self._server = self._server, None
        if server is not None:
            httpd, thread = server
            httpd.shutdown()
            httpd.server_close()
            thread.join()

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Every sample, grouped by tier label (``_store`` for those without one)."""
        out: dict[str, dict[str, float]] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created") or sample.name.endswith("_bucket"):
                    continue
                labels = dict(sample.labels)
                group = labels.pop("tier", "_store")
                name = sample.name.removeprefix("kvtier_")
                if labels:
                    name += "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                out.setdefault(group, {})[name] = sample.value
        return out


class _TierEvents(Collector):
    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._tiers = tiers

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("kvtier_tier_events", "Events counted inside a tier", labels=["tier", "event"])
        for tier in self._tiers:
            for event, value in sorted(tier.counters().items()):
                family.add_metric([tier.name, event], value)
        yield family


class _Labelled:
    """A registry's samples with ``labels`` added, read at each scrape (so labels set after serving began show)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._registry = registry
        self._labels = labels

    def restricted_registry(self, names: Sequence[str]) -> _Labelled:
        """The same, for the families asked for (``/metrics?name[]=...``)."""
        return _Labelled(self._registry.restricted_registry(names), self._labels)  # type: ignore[arg-type]  # prometheus_client types it a CollectorRegistry

    def collect(self) -> Iterator[Metric]:
        extra = dict(self._labels)
        for family in self._registry.collect():
            if extra:
                family.samples = [s._replace(labels={**s.labels, **extra}) for s in family.samples]
            yield family


def sample_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return total
