"""vLLM integration: ``KVTierConnector``, a KV connector (``KVConnectorBase_V1``) backed by a :class:`KVStore`.

Load it with::

    kv_transfer_config={"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"config": <mapping or YAML path>}}

vLLM makes one instance per role. The scheduler instance decides (lookups, what to load and save, sent to the
workers as :class:`KVTierMetadata`); worker instances move bytes between the engine's paged KV cache and the store
(:mod:`kvtier.integrations.layouts` converts layouts). Both roles of one process share one store, so a lookup
sees the DRAM tier the worker fills. Loads and saves are synchronous within the engine step: a load finishes in
``start_load_kv`` before the forward pass; a save copies into DRAM in ``wait_for_save`` after it, and the store
cascades to secondary tiers in the background. A load that fails is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes those blocks, so a miss never becomes wrong KV.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.errors import ConfigError
from kvtier.integrations.layouts import Layout, gather, kv_shape, scatter
from kvtier.keys import Namespace, fingerprint_model
from kvtier.store import KVStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_EXTRA_KEYS = ("config", "model_fingerprint")


# -- one store per process and config, shared by the roles --------------------------------------------------------
_stores: dict[str, list[Any]] = {}  # config key -> [store, users]
_stores_lock = threading.Lock()


def _config_key(config: object) -> str:
    if isinstance(config, (str, os.PathLike)):
        return "path:" + str(Path(config).resolve())
    return "map:" + json.dumps(config, sort_keys=True, default=str)


def _acquire_store(config: Mapping[str, object] | str | None) -> KVStore:
    key = _config_key(config)
    with _stores_lock:
        if key not in _stores:
            _stores[key] = [KVStore.from_config(config), 0]
        _stores[key][1] += 1
        return _stores[key][0]  # type: ignore[no-any-return]


def shared_store(config: Mapping[str, object] | str) -> KVStore | None:
    """The store that connectors in this process opened for ``config``, if any (for stats and tests)."""
    with _stores_lock:
        slot = _stores.get(_config_key(config))
        return None if slot is None else slot[0]  # type: ignore[no-any-return]


def _release_store(store: KVStore) -> None:
    with _stores_lock:
        for key, slot in list(_stores.items()):
            if slot[0] is store:
                slot[1] -= 1
                if slot[1] == 0:
                    del _stores[key]
                    store.close()
                return


# -- what the scheduler tells the workers -------------------------------------------------------------------------
@dataclasses.dataclass
class Transfer:
    """Move ``tokens[offset:]`` (whole blocks) between the store and ``block_ids`` (the blocks of those tokens)."""

    request_id: str
    namespace: Namespace
    tokens: list[int]
    block_ids: list[int]
    offset: int


@dataclasses.dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[Transfer] = dataclasses.field(default_factory=list)
    saves: list[Transfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Tracked:
    """A running request, as the scheduler instance follows it."""

    namespace: Namespace
    tokens: list[int]
    block_ids: list[int]
    stored: int  # leading tokens known to be in the store already
    saved: bool = False


def _model_fingerprint(vllm_config: VllmConfig, override: object) -> str:
    if override is not None:
        if not isinstance(override, str) or not override:
            raise ConfigError("kv_connector_extra_config.model_fingerprint: expected a non-empty string")
        return override
    model = vllm_config.model_config.model
    if Path(model).is_dir():
        return fingerprint_model(model)
    revision = getattr(vllm_config.model_config, "revision", None)
    return f"{model}@{revision or 'default'}"


class KVTierConnector(KVConnectorBase_V1):
    """vLLM KV connector that loads prefixes from, and saves prefills to, kvtier's tiered store."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ConfigError(f"kv_connector_extra_config.{unknown[0]}: unknown key; allowed: {', '.join(_EXTRA_KEYS)}")
        self._store = _acquire_store(extra.get("config"))
        self._chunk = self._store.chunk_tokens
        self._block_size = vllm_config.cache_config.block_size
        if self._chunk % self._block_size:
            _release_store(self._store)
            raise ConfigError(f"chunk_tokens: {self._chunk} is not a multiple of vLLM's block size "
                              f"{self._block_size}")
        if role == KVConnectorRole.SCHEDULER and \
                getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r: a chunk that fails verification on load fails its "
                        "request; set \"kv_load_failure_policy\": \"recompute\" in kv_transfer_config to "
                        "recompute it instead", self._kv_transfer_config.kv_load_failure_policy)
        # scheduler side
        self._model = _model_fingerprint(vllm_config, extra.get("model_fingerprint")) \
            if role == KVConnectorRole.SCHEDULER else ""
        self._dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self._namespaces: dict[str, Namespace] = {}
        # request -> (engine-computed tokens, store hit tokens, the tokens looked up)
        self._hits: dict[str, tuple[int, int, list[int]]] = {}
        self._loads: dict[str, Transfer] = {}  # loads to send with the request's next step
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._caches: list[torch.Tensor] = []
        self._layout: Layout = "cpu"
        self._load_errors: set[int] = set()
        self._staging: torch.Tensor | None = None  # reused for loads: fresh memory costs page faults each time

    # ================================================================================ scheduler side
    def _namespace(self, request: Request) -> Namespace:
        lora = request.lora_request
        return Namespace(model=self._model, dtype=self._dtype,
                         lora=None if lora is None else f"{lora.lora_name}:{lora.lora_path}",
                         cache_salt=request.cache_salt)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond the engine's own hit that the store holds (whole chunks; the last token is computed)."""
        ns = self._namespace(request)
        self._namespaces[request.request_id] = ns
        tokens = list(request.all_token_ids)
        limit = (len(tokens) - 1) // self._chunk * self._chunk
        hit = self._store.lookup(ns, tokens[:limit]) if limit > num_computed_tokens else 0
        self._hits[request.request_id] = (num_computed_tokens, hit, tokens)
        return max(hit - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        computed, _, tokens = self._hits[request.request_id]
        end = computed + num_external_tokens
        # Block ids come with the scheduler output; the tokens are those looked up (for a request resumed after
        # preemption they include its output so far).
        self._loads[request.request_id] = Transfer(request.request_id, self._namespaces[request.request_id],
                                                   tokens[:end], [], computed)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVTierMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            ns = self._namespaces.get(rid)
            if ns is None or new.prompt_token_ids is None:
                continue  # not looked up by this connector (e.g. prompt embeddings): neither load nor save
            hit = self._hits.pop(rid, (0, 0, []))[1]
            self._tracked[rid] = _Tracked(ns, list(new.prompt_token_ids), list(new.block_ids[0]), stored=hit)
            self._plan(meta, rid, new.num_computed_tokens + scheduled.get(rid, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: its blocks were all replaced
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
                hit = self._hits.pop(rid, (0, 0, []))[1]
                tracked.stored = max(tracked.stored, min(hit, len(tracked.tokens)))
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[0])
            self._plan(meta, rid, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return meta

    def _plan(self, meta: KVTierMetadata, rid: str, computed_after_step: int) -> None:
        tracked = self._tracked[rid]
        load = self._loads.pop(rid, None)
        if load is not None:
            load.block_ids = tracked.block_ids[:len(load.tokens) // self._block_size]
            meta.loads.append(load)
        upto = len(tracked.tokens) // self._chunk * self._chunk  # the prompt's whole chunks
        if not tracked.saved and computed_after_step >= upto:
            tracked.saved = True
            if upto > tracked.stored:
                offset = tracked.stored // self._chunk * self._chunk
                meta.saves.append(Transfer(rid, tracked.namespace, tracked.tokens[:upto],
                                           tracked.block_ids[:upto // self._block_size], offset))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        for table in (self._tracked, self._namespaces, self._hits, self._loads):
            table.pop(rid, None)
        return False, None  # saves finished in the step that computed them: free the blocks now

    # ================================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def layer_index(name: str) -> tuple[int, str]:
            digits = [int(p) for p in name.split(".") if p.isdigit()]
            return (digits[0] if digits else 0, name)

        self._caches = [kv_caches[name] for name in sorted(kv_caches, key=layer_index)]
        first = self._caches[0]
        if first.dim() == 4:
            self._layout = "cpu"
        elif first.dim() == 5 and first.shape[0] == 2:
            self._layout = "flash"
        else:
            raise ValueError(f"KVTierConnector: unsupported KV cache layout {tuple(first.shape)}; supported: "
                             "[blocks, kv_heads, block_size, 2*head_dim] (CPU) and "
                             "[2, blocks, block_size, kv_heads, head_dim] (flash attention)")

    @staticmethod
    def _tp() -> tuple[int, int]:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        if not meta.loads:
            return
        rank, size = self._tp()
        bs = self._block_size
        for load in meta.loads:
            from_chunk = load.offset // self._chunk * self._chunk
            kv = self._store.get(load.namespace, load.tokens, tp_rank=rank, tp_size=size, offset=from_chunk,
                                 out=self._staging_for(len(load.tokens) - from_chunk))
            blocks = load.block_ids[load.offset // bs:]
            if kv is None:
                log.warning("kvtier: request %s: KV for %d tokens vanished before loading; vLLM recomputes it",
                            load.request_id, len(load.tokens) - load.offset)
                self._load_errors.update(blocks)
                continue
            scatter(kv[:, :, :, load.offset - from_chunk:], self._caches, blocks, self._layout)

    def _staging_for(self, tokens: int) -> torch.Tensor:
        """A host buffer for ``tokens`` tokens of canonical KV, grown as needed and kept."""
        shape = kv_shape(self._caches, self._layout, tokens)
        numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
        if self._staging is None or self._staging.numel() < numel:
            self._staging = torch.empty(numel, dtype=self._caches[0].dtype, device=self._caches[0].device)
            self._staging.zero_()  # touch it once now, not on every load
        return self._staging[:numel].view(shape)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in ``start_load_kv``, before any layer runs."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves happen once per step in ``wait_for_save``, from all layers together."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        if not meta.saves:
            return
        rank, size = self._tp()
        bs = self._block_size
        for save in meta.saves:
            kv = gather(self._caches, save.block_ids[save.offset // bs:], self._layout)
            self._store.put(save.namespace, save.tokens, kv, tp_rank=rank, tp_size=size, offset=save.offset)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        store, self._store = self._store, None  # type: ignore[assignment]
        if store is not None:
            _release_store(store)
