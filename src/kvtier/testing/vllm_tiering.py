"""vLLM's own tiering manager, driven on a CPU host as vLLM's scheduler drives it: for the tests and the benchmark
of :mod:`kvtier.integrations.vllm_tier`, and for a user checking a tier entry before a GPU host runs it.

vLLM's ``OffloadingConnector`` refuses the CPU backend at its worker (it copies GPU blocks), but the scheduler
side is plain Python: :class:`Tiering` builds ``TieringOffloadingSpec(config).get_manager()`` (the primary tier
in a shared-memory region, and every secondary tier from ``secondary_tiers``, through vLLM's
``SecondaryTierFactory``), and plays the worker's part itself, copying rows into and out of the primary tier by
hand. Everything between (lookups, cascades to the secondary tiers, promotions, events, the per-step hooks) is
vLLM's code.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

_STEP_SECONDS = 0.002  # between two scheduler steps while waiting on a tier
_PENDING = (LookupResult.RETRY, LookupResult.HIT_PENDING)


def offloading_config(secondary_tiers: list[dict[str, Any]], *, model: str, layers: int = 30,
                      kv_bytes_per_token_layer: int = 768, tokens_per_block: int = 16, blocks_per_chunk: int = 1,
                      cpu_bytes: int = 256 << 20, dtype: str = "bfloat16", events: bool = False,
                      layout: str = "LBNHC", extra: Mapping[str, Any] | None = None) -> OffloadingConfig:
    """The config vLLM's ``OffloadingConnector`` would derive for one worker (TP 1) of a model with ``layers`` full
    attention layers of ``kv_bytes_per_token_layer`` bytes of KV a token (SmolLM2-135M's by default), offloading
    chunks of ``blocks_per_chunk`` blocks of ``tokens_per_block`` tokens."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=tokens_per_block, layer_names=names, group_id=0),),
        worker_kv_bytes_per_block=layers * kv_bytes_per_token_layer * tokens_per_block,
        enable_kv_cache_events=events,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                      "secondary_tiers": secondary_tiers, **(extra or {})},
        engine_id=f"kvtier-harness-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
        kv_cache_layout=layout,
    )


def chunk_names(prompt: str, count: int, group: int = 0) -> list[OffloadKey]:
    """``count`` keys as vLLM names a prompt's chunks in KV cache group ``group``: each hashes its parent's (a
    prefix chain)."""
    keys, parent = [], hashlib.sha256(prompt.encode()).digest()
    for i in range(count):
        parent = hashlib.sha256(parent + i.to_bytes(8, "little")).digest()
        keys.append(make_offload_key(parent, group))
    return keys


def row_bytes(key: OffloadKey, size: int) -> np.ndarray:
    """Deterministic bytes of one row, different for every key."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


class Tiering:
    """One engine's tiering manager (``TieringOffloadingSpec(config).get_manager()``), stepped by hand."""

    def __init__(self, config: OffloadingConfig) -> None:
        self.spec = TieringOffloadingSpec(config)
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        view = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.rows = torch.from_numpy(view)  # (chunks, row bytes), the primary tier's own memory
        self.row_bytes = self.rows.shape[1]
        self._requests = 0

    @property
    def tiers(self) -> list[Any]:
        return list(self.manager.secondary_tiers)

    def step(self) -> None:
        """The end of one scheduler step: finished jobs taken, promotions submitted, the tiers' lookups flushed."""
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def request(self) -> ReqContext:
        """A new request's context, announced to the manager (end it with :meth:`finish`)."""
        self._requests += 1
        ctx = ReqContext(req_id=f"req-{self._requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def store(self, keys: Sequence[OffloadKey], data: Sequence[np.ndarray] | None = None) -> list[OffloadKey]:
        """Offload ``keys`` as the worker would (rows ``data``, else :func:`row_bytes`): into the primary tier,
        which cascades them to every secondary tier. The keys it stored (those the primary did not hold)."""
        ctx = self.request()
        out = self.manager.prepare_store(list(keys), ctx)
        stored: list[OffloadKey] = []
        if out is not None:
            stored = list(out.keys_to_store)
            assert isinstance(out.store_spec, CPULoadStoreSpec)
            index = {key: i for i, key in enumerate(keys)}
            for key, chunk in zip(stored, out.store_spec.chunk_ids):
                row = row_bytes(key, self.row_bytes) if data is None else data[index[key]]
                self.rows[int(chunk)].copy_(torch.from_numpy(row))
            if stored:  # (the worker's transfer is submitted, and completed, only for rows to store)
                self.manager.complete_store(stored, ctx)
        self.manager.on_request_finished(ctx)
        return stored

    def settle(self, timeout: float = 30.0) -> None:
        """Step until no transfer is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            if not self.manager.has_pending_work():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfers still in flight after {timeout} s")
            time.sleep(_STEP_SECONDS)

    def lookup(self, keys: Sequence[OffloadKey], timeout: float = 30.0, ctx: ReqContext | None = None) -> int:
        """How many of ``keys``, from the first, the manager serves from its primary tier, asked as vLLM's
        scheduler asks (``_maximal_prefix_lookup``: every key up to the first miss each step, a found one promoted
        first), stepping until no answer is "retry" or pending."""
        own = ctx is None
        ctx = self.request() if ctx is None else ctx
        deadline = time.monotonic() + timeout
        try:
            while True:
                hits, deferred = 0, False
                for key in keys:
                    result = self.manager.lookup(key, ctx)
                    if result is LookupResult.MISS:
                        break
                    deferred = deferred or result in _PENDING
                    hits += result is not LookupResult.RETRY
                if not deferred:
                    return hits
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lookups still deferred after {timeout} s")
                self.step()
                time.sleep(_STEP_SECONDS)
        finally:
            if own:
                self.manager.on_request_finished(ctx)
                self.step()

    def finish(self, ctx: ReqContext) -> None:
        self.manager.on_request_finished(ctx)
        self.step()

    def load(self, keys: Sequence[OffloadKey], timeout: float = 30.0) -> list[np.ndarray]:
        """The rows of the leading ``keys`` the manager serves (promoted into the primary tier first), copied out
        as the worker would copy them to the GPU."""
        ctx = self.request()
        try:
            hits = self.lookup(keys, timeout, ctx)
            spec = self.manager.prepare_load(list(keys[:hits]), ctx)
            assert isinstance(spec, CPULoadStoreSpec)
            rows = [self.rows[int(chunk)].numpy().copy() for chunk in spec.chunk_ids]
            self.manager.complete_load(list(keys[:hits]), ctx)
            return rows
        finally:
            self.manager.on_request_finished(ctx)
            self.step()

    def evict_primary(self) -> None:
        """Empty the primary tier (vLLM's ``reset_cache``: secondary tiers keep what they hold)."""
        self.manager.reset_cache()

    def events(self) -> list[OffloadingEvent]:
        return list(self.manager.take_events())

    def close(self) -> None:
        self.rows = torch.empty(0, 0, dtype=torch.uint8)  # the primary's memory is unmapped next
        self.manager.shutdown()
