"""``KVTierConnector``: the object vLLM drives, one per role; it checks the configuration at start and contains
every hook's failure, and hands the work to its scheduler side (:mod:`._scheduler`) or its worker side
(:mod:`._worker`).

A configuration kvtier cannot serve is refused at start (:class:`ConfigError`). After that no exception reaches
the engine from a hook: a failed lookup is a miss, a failed load becomes load errors (vLLM recomputes those
blocks), a failed save is dropped. Each is counted in ``kvtier_connector_errors_total{hook}`` and its first kind
logged (:mod:`._shared`).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvtier import threads
from kvtier.errors import ConfigError
from kvtier.integrations.vllm._namespace import Namespaces
from kvtier.integrations.vllm._scheduler import SchedulerSide
from kvtier.integrations.vllm._shared import Shared, acquire, log, release
from kvtier.integrations.vllm._wire import KVTierMetadata
from kvtier.integrations.vllm._worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_EXTRA_KEYS = ("config", "model_fingerprint", "lookup_timeout_seconds", "store_tails", "pd_wait_max_seconds")


def _check_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    groups = [] if kv_cache_config is None else kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise ConfigError(f"KVTierConnector: model {vllm_config.model_config.model!r} has {len(groups)} KV-cache "
                          f"groups ({kinds}: hybrid or sliding-window attention); kvtier supports models with "
                          "one group only")


def _check_parallelism(vllm_config: VllmConfig) -> None:
    """Refuse parallel layouts whose ranks hold other layers or other tokens under the same chunk keys.

    Pipeline stages hold different layers, context-parallel ranks different tokens of one block: their KV
    would be stored under the same keys and read back by the wrong rank. Only tensor parallelism is keyed.
    """
    parallel = vllm_config.parallel_config
    for field in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, field, 1)
        if size != 1:
            raise ConfigError(f"KVTierConnector: parallel_config.{field} is {size}; kvtier supports tensor and "
                              "data parallelism only (its keys carry heads, not layers or token slices)")


def _events_enabled(vllm_config: VllmConfig) -> bool:
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def _keep_off_compute_cores() -> None:
    """In a CPU worker vLLM started with its OpenMP threads bound to cores (its multiprocessing executor: under
    the API server, or an ``LLM`` with multiprocessing on), run kvtier's threads on the process's other cores
    (:func:`kvtier.threads.spare_cpus`). Bound, the worker's main thread passes its cores to every thread started
    from it: kvtier's reading, decrypting and writing threads shared the engine's compute core (seen in
    ``/proc``: every thread of the worker on core 0 of 2). Only in vLLM's worker processes
    (``VllmWorker-N``): where such a process may run is its starter's CPUs (vLLM's engine process, not bound),
    which for a process started some other way need not be the user's."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid != os.getppid() or not hasattr(os, "sched_getaffinity") or \
            not multiprocessing.current_process().name.startswith("VllmWorker-"):
        return
    try:
        allowed, current = os.sched_getaffinity(parent.pid), os.sched_getaffinity(0)
    except OSError:  # the starter is gone: not knowing where the process may run, kvtier leaves its threads
        return
    siblings, nodes = threads.topology()
    cpus = threads.spare_cpus(os.environ, allowed, current, siblings=siblings, nodes=nodes)
    if cpus is not None:
        threads.run_on(cpus)
        log.info("kvtier: vLLM computes on CPUs %s; kvtier's threads run on CPUs %s", threads.cpu_list(current),
                 threads.cpu_list(cpus))


class KVTierConnector(KVConnectorBase_V1):
    """vLLM KV connector that loads prefixes from, and saves prefills to, kvtier's tiered store."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ConfigError(f"kv_connector_extra_config.{unknown[0]}: unknown key; allowed: {', '.join(_EXTRA_KEYS)}")
        _check_groups(vllm_config, kv_cache_config)
        _check_parallelism(vllm_config)
        lookup_timeout = extra.get("lookup_timeout_seconds", 1.0)
        if isinstance(lookup_timeout, bool) or not isinstance(lookup_timeout, (int, float)) or \
                not 0 <= lookup_timeout <= 600:
            raise ConfigError("kv_connector_extra_config.lookup_timeout_seconds: seconds a request may wait for "
                              f"a lookup in a shared tier, a number in [0, 600]; got {lookup_timeout!r}")
        pd_wait_max = extra.get("pd_wait_max_seconds", 10.0)
        if isinstance(pd_wait_max, bool) or not isinstance(pd_wait_max, (int, float)) or \
                not 0 <= pd_wait_max <= 600:
            raise ConfigError("kv_connector_extra_config.pd_wait_max_seconds: the longest a decode request waits "
                              "for the KV its prefill engine stored, whatever it asks (docs/pd.md), a number in "
                              f"[0, 600]; got {pd_wait_max!r}")
        tails = extra.get("store_tails", True)
        if not isinstance(tails, bool):
            raise ConfigError("kv_connector_extra_config.store_tails: whether a prompt's whole blocks after its last "
                              f"whole chunk are stored too, true or false; got {tails!r}")
        block_size = vllm_config.cache_config.block_size
        kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        # Namespaces come first: a model that cannot be fingerprinted is refused before any store opens.
        names = Namespaces(vllm_config, extra.get("model_fingerprint")) if role == KVConnectorRole.SCHEDULER \
            else None
        if role != KVConnectorRole.SCHEDULER:  # before the store starts its threads
            _keep_off_compute_cores()
        shared = acquire(extra.get("config"), moves_bytes=role != KVConnectorRole.SCHEDULER)
        store, metrics = shared.store, shared.metrics
        if store.chunk_tokens % block_size:
            release(shared)
            raise ConfigError(f"chunk_tokens: {store.chunk_tokens} is not a multiple of vLLM's block size "
                              f"{block_size}")
        if role == KVConnectorRole.SCHEDULER and \
                getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r: a chunk that fails verification on load fails its "
                        "request; set \"kv_load_failure_policy\": \"recompute\" in kv_transfer_config to "
                        "recompute it instead", self._kv_transfer_config.kv_load_failure_policy)
        self._shared: Shared | None = shared  # None once shut down
        self._released: set[str] = set()  # requests to report finished sending (worker side)
        self._metrics = metrics
        self._scheduler = None if names is None else SchedulerSide(
            store, names, metrics, block_size=block_size, kv_heads=kv_heads,
            workers=vllm_config.parallel_config.tensor_parallel_size,
            tp_size=vllm_config.parallel_config.tensor_parallel_size, lookup_timeout=lookup_timeout,
            events=_events_enabled(vllm_config), tails=tails, pd_wait_max=pd_wait_max)
        self._worker_side = None if role == KVConnectorRole.SCHEDULER else WorkerSide(
            store, metrics, block_size=block_size, kv_heads=kv_heads,
            report_tier_writes=_events_enabled(vllm_config))

    @property
    def loads_by_layers(self) -> bool:
        """Whether this worker copies its in-step loads layer by layer beside the forward pass (a CPU engine
        with a core to spare), rather than in ``start_load_kv`` before it."""
        return self._worker_side is not None and self._worker_side.by_layers

    @property
    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side hook was called on a worker-role connector"
        return self._scheduler

    @property
    def _worker(self) -> WorkerSide:
        assert self._worker_side is not None, "a worker-side hook was called on a scheduler-role connector"
        return self._worker_side

    # ================================================================================ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._sched.lookup(request, num_computed_tokens)
        except Exception as exc:  # noqa: BLE001 contained: counted, logged once
            self._metrics.error("get_num_new_matched_tokens", exc, request.request_id)
            self._sched.forget_lookup(request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        try:
            self._sched.after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:  # noqa: BLE001 contained: counted, logged once
            self._metrics.error("update_state_after_alloc", exc, request.request_id)
            if num_external_tokens <= 0:
                return
            try:
                self._sched.invalidate(request, blocks, num_external_tokens)
            except Exception as again:  # noqa: BLE001 contained: logged (the blocks cannot be marked)
                log.error("kvtier: request %s: cannot mark its blocks for recomputation (%s); the engine may "
                          "use KV that was never loaded", request.request_id, again)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._sched.take_loads()
        meta.idle = not scheduler_output.total_num_scheduled_tokens
        try:
            self._sched.plan_saves(meta, scheduler_output)
            if meta.idle:
                self._sched.idle()
        except Exception as exc:  # noqa: BLE001 per-request failures are contained inside; this is anything else
            self._metrics.error("build_connector_meta", exc)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        try:
            self._sched.connector_output(connector_output)
        except Exception as exc:  # noqa: BLE001 contained: counted, logged once
            self._metrics.error("update_connector_output", exc)

    def take_events(self) -> list[KVCacheEvent]:
        """kvtier's own KV events (what its DRAM and tiers came to hold or lost), published by vLLM with the
        engine's when ``--kv-events-config`` enables them (:mod:`._events`)."""
        try:
            return self._sched.take_events()
        except Exception as exc:  # noqa: BLE001 contained: counted, logged once
            self._metrics.error("take_events", exc)
            return []

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Free the blocks now (saves finished in the step that computed them: the bytes are in kvtier's DRAM);
        a P/D prefill's answer carries what it stored (:mod:`._pd`); one whose save was put off keeps its blocks
        until the save has run (:meth:`SchedulerSide.finished`)."""
        try:
            return self._sched.finished(request.request_id)
        except Exception as exc:  # noqa: BLE001 contained: counted, logged once
            self._metrics.error("request_finished", exc, request.request_id)
            return False, None

    # ================================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches, self._tp)

    @staticmethod
    def _tp() -> tuple[int, int]:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata), f"unexpected connector metadata {type(meta).__name__}"
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = None
        try:
            meta = self._meta()
            self._worker.load(meta, self._tp)
        except Exception as exc:  # noqa: BLE001 per-load failures are contained inside; this is anything else
            if meta is None:
                self._metrics.error("start_load_kv", exc)
            else:
                self._worker.fail(meta, exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this step's in-step loads to have copied this layer (where they copy layer by layer beside
        the forward pass; else they completed in ``start_load_kv``). Asynchronous loads are not waited for: their
        requests are not in the step."""
        try:
            self._worker.wait_for_layer(layer_name)
        except Exception as exc:  # noqa: BLE001 contained: counted, logged once (the loads' failures are their own)
            self._metrics.error("wait_for_layer_load", exc)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves happen once per step in ``wait_for_save``, from all layers together."""

    def wait_for_save(self) -> None:
        meta = None
        try:
            meta = self._meta()
            self._worker.save(meta, self._tp)
        except Exception as exc:  # noqa: BLE001 per-save failures are contained inside; this is anything else
            self._metrics.error("wait_for_save", exc)
        finally:  # saved, failed or skipped: vLLM may free their blocks
            if meta is not None:
                self._released.update(meta.released)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose blocks were kept for a save that has now run (P/D prefills that ended first), and those
        whose asynchronous loads ended (their failed blocks are in this step's load errors)."""
        released, self._released = self._released, set()
        try:
            return released or None, self._worker.finished_loads(finished_req_ids) or None
        except Exception as exc:  # noqa: BLE001 a load never reported finished would hold its request forever: log loudly
            self._metrics.error("get_finished", exc)
            return released or None, None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """What this rank's DRAM came to hold or lost this step, for the scheduler's lookups."""
        try:
            return self._worker.dram_report(self._tp)
        except Exception as exc:  # noqa: BLE001 the scheduler then under-counts this worker's DRAM: misses, never wrong KV
            self._metrics.error("build_connector_worker_meta", exc)
            return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker_side is not None:
            try:
                self._worker_side.close()
            except Exception as exc:  # noqa: BLE001 the store is released all the same
                self._metrics.error("shutdown", exc)
        shared, self._shared = self._shared, None
        if shared is not None:
            release(shared)
