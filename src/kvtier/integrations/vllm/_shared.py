"""What the vLLM connector's instances in one process share: one store per config, and the connector's metrics.

vLLM makes one connector instance per role; in the in-process engine the scheduler and the worker live in one
process and share a store, so a lookup sees the DRAM tier the worker fills. The connector's counters are
registered on that store's registry, so they are scraped and snapshotted (``store.stats()``) with the store's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from prometheus_client import Counter, Histogram

from kvtier.config import load_config
from kvtier.health import FirstOfKind
from kvtier.integrations.vllm._pd import PDMetrics
from kvtier.store import KVStore

log = logging.getLogger("kvtier.integrations.vllm")
_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)

HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "start_load_kv", "wait_for_save",
         "build_connector_worker_meta")
# Why a request may be neither looked up nor saved (kvtier.integrations.vllm._namespace.Skip's reasons).
SKIP_REASONS = ("prompt_embeds", "multimodal_unhashed", "lora_unresolved")
# What a contained failure of each hook costs: said once in the log, so an operator knows what happened.
_CONSEQUENCE = {
    "get_num_new_matched_tokens": "the request is a miss",
    "update_state_after_alloc": "its promised blocks are reported as load errors and vLLM recomputes them",
    "build_connector_meta": "the request's save is skipped",
    "update_connector_output": "a save after a failed load may be skipped",
    "request_finished": "its state is dropped",
    "start_load_kv": "the blocks are reported as load errors and vLLM recomputes them",
    "wait_for_layer_load": "the step's in-step loads are reported as load errors and vLLM recomputes them",
    "wait_for_save": "the save is dropped",
    "build_connector_worker_meta": "the scheduler misses chunks this worker's DRAM holds",
    "take_events": "kvtier's KV events leave those chunks unannounced",
    "shutdown": "the worker's threads end with the process",
}


class ConnectorMetrics:
    """The connector's own counters, and the log-once rule for the failures it contains."""

    def __init__(self, store: KVStore) -> None:
        registry = store.metrics.registry
        self.errors = Counter("kvtier_connector_errors", "Exceptions the vLLM connector contained, by hook",
                              ["hook"], registry=registry)
        self.skipped = Counter("kvtier_connector_skipped_requests",
                               "Requests the vLLM connector neither looks up nor saves, by reason", ["reason"],
                               registry=registry)
        self.async_lookups = Counter("kvtier_connector_async_lookups", "Lookups that went to a background "
                                     "thread, by outcome (answered in time; timed_out: the request went on with "
                                     "what DRAM and local tiers hold)", ["outcome"], registry=registry)
        self.lookups = Counter("kvtier_connector_lookups", "Lookups answered, by outcome (hit: tokens beyond "
                               "vLLM's own hit promised)", ["outcome"], registry=registry)
        self.loaded_tokens = Counter("kvtier_connector_loaded_tokens", "Tokens loaded into vLLM's blocks",
                                     registry=registry)
        self.load_failed_blocks = Counter("kvtier_connector_load_failed_blocks", "Blocks promised to vLLM and "
                                          "reported as load errors (vLLM recomputes them)", registry=registry)
        self.saved_tokens = Counter("kvtier_connector_saved_tokens", "Tokens put into the store from vLLM's "
                                    "blocks (those the store held already are not counted)", registry=registry)
        self.load_seconds = Histogram("kvtier_connector_load_seconds", "Time of one request's load into vLLM's "
                                      "blocks", registry=registry, buckets=_LOAD_BUCKETS)
        self.pd = PDMetrics(store)
        for hook in HOOKS:  # present at 0, so a dashboard's rate() has a series before the first failure
            self.errors.labels(hook)
        for outcome in ("hit", "miss"):
            self.lookups.labels(outcome)
        for outcome in ("answered", "timed_out", "dropped"):
            self.async_lookups.labels(outcome)
        for reason in SKIP_REASONS:
            self.skipped.labels(reason)
        self._logged = FirstOfKind()

    def error(self, hook: str, exc: BaseException, request_id: str | None = None) -> None:
        """Count a contained exception; log the first of its kind (hook and exception type) with its traceback."""
        self.errors.labels(hook).inc()
        if self._logged.first(hook, type(exc).__name__):
            log.warning("kvtier: %s failed%s (%s: %s); contained: %s. Further %s failures in %s are counted "
                        "(kvtier_connector_errors_total), not logged", hook,
                        f" for request {request_id}" if request_id else "", type(exc).__name__, exc,
                        _CONSEQUENCE.get(hook, "skipped"), type(exc).__name__, hook, exc_info=exc)

    def skip(self, reason: str, detail: str, request_id: str) -> None:
        """Count a request left alone; log the first one of each reason."""
        self.skipped.labels(reason).inc()
        if self._logged.first("skip", reason):
            log.warning("kvtier: request %s is neither looked up nor saved: %s (further such requests are "
                        "counted in kvtier_connector_skipped_requests_total{reason=%r}, not logged)",
                        request_id, detail, reason)


@dataclasses.dataclass
class Shared:
    """One store and its connector metrics, and how many connector instances use them."""

    store: KVStore
    metrics: ConnectorMetrics
    users: int = 0
    roles: set[str] = dataclasses.field(default_factory=set)


_shared: dict[str, Shared] = {}  # config key -> its store
_lock = threading.Lock()


def _config_key(config: object) -> str:
    if isinstance(config, (str, os.PathLike)):
        return "path:" + str(Path(config).resolve())
    return "map:" + json.dumps(config, sort_keys=True, default=str)


def acquire(config: Mapping[str, object] | str | None, *, moves_bytes: bool) -> Shared:
    """The process's store for ``config``. Only a worker (``moves_bytes``) needs its DRAM pool: a process with
    the scheduler alone (vLLM's API server) never allocates it; a worker in the same process does, at start."""
    key = _config_key(config)
    with _lock:
        if key not in _shared:
            store = KVStore(load_config(config), allocate_dram=False)
            try:
                _shared[key] = Shared(store, ConnectorMetrics(store))
            except BaseException:
                store.close()
                raise
        shared = _shared[key]
        if moves_bytes:
            shared.store.dram.allocate()  # a ConfigError here (no memory) refuses the start, as it should
        shared.users += 1
        # Scraped metrics say which of vLLM's processes they come from: "scheduler" (the API server's engine
        # core), "worker", or "engine" (both roles in one process).
        shared.roles.add("worker" if moves_bytes else "scheduler")
        shared.store.metrics.process_labels["role"] = "engine" if len(shared.roles) > 1 else next(iter(shared.roles))
        return shared


def release(shared: Shared) -> None:
    with _lock:
        for key, slot in list(_shared.items()):
            if slot is shared:
                slot.users -= 1
                if slot.users == 0:
                    del _shared[key]
                    slot.store.close()
                return


def shared_store(config: Mapping[str, object] | str) -> KVStore | None:
    """The store that connectors in this process opened for ``config``, if any (for stats and tests)."""
    with _lock:
        slot = _shared.get(_config_key(config))
        return None if slot is None else slot.store
