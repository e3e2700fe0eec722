"""A scheduler-role and worker-role KVTierConnector driven the way vLLM's scheduler and model runner drive them,
over fake paged CPU caches, with real vLLM requests, scheduler outputs and block lists. No model runs: a
"forward pass" writes each token's reference KV (a function of the prompt) into its blocks, so what a load
put there can be checked against what a computation would have.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorWorkerMetadata
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.integrations.layouts import Scatter, gather
from kvtier.integrations.vllm import KVTierConnector, KVTierMetadata
from kvtier.keys import rank_heads
from kvtier.config import load_config
from kvtier.store import KVStore

BLOCK = 128
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64  # the tiny Llama of the fixtures


def vllm_config(model_dir: str, store: dict, extra: dict | None = None, **engine: object) -> VllmConfig:
    """A VllmConfig for the tiny model with kvtier as its connector over store config ``store`` (and the other
    ``kv_connector_extra_config`` keys in ``extra``)."""
    kv = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"config": store, **(extra or {})})
    args = {"model": model_dir, "skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 2048,
            "dtype": "bfloat16", "block_size": BLOCK, "kv_transfer_config": kv}
    args.update(engine)
    return EngineArgs(**args).create_engine_config()  # type: ignore[arg-type] # args typed as a plain dict


def kv_cache_config(groups: int = 1) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layers, spec) for _ in range(groups)])


def request(rid: str, tokens: list[int], *, images: Sequence[tuple[int, int, str]] = (),
            salt: str | None = None, lora: LoRARequest | None = None, prompt_embeds: torch.Tensor | None = None,
            prompt_is_token_ids: list[bool] | None = None) -> Request:
    """A vLLM request; ``images`` are (offset, length, hash) of multimodal inputs over placeholder tokens."""
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=off, length=n))
                for off, n, ident in images]
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, mm_features=features, cache_salt=salt,
                   lora_request=lora, prompt_embeds=prompt_embeds, prompt_is_token_ids=prompt_is_token_ids)


def reference_kv(tokens: list[int]) -> torch.Tensor:
    """What a forward pass computes for ``tokens``: canonical KV [layers, 2, all KV heads, tokens, head_dim]."""
    g = torch.Generator().manual_seed(hash(tuple(tokens)) % 2**31)
    return torch.randn(LAYERS, 2, KV_HEADS, len(tokens), HEAD_DIM, generator=g).to(torch.bfloat16)


@dataclasses.dataclass
class Step:
    meta: KVTierMetadata
    hit: int  # tokens the scheduler side promised beyond the engine's own
    blocks: list[int]
    load_errors: set[int]
    load_meta: KVTierMetadata | None = None  # the step that carried an asynchronous load, if there was one


class MiniEngine:
    """One scheduler-role connector and one worker-role connector per tensor-parallel rank (``tp_size``)."""

    def __init__(self, config: VllmConfig, tp_size: int = 1, num_blocks: int = 64,
                 separate_processes: bool = False) -> None:
        self.scheduler = KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
        self._own_store: KVStore | None = None
        if separate_processes:
            # As in vLLM's API server: the scheduler's process has a store of its own over the same config, with
            # no DRAM pool (it only looks up).
            sched = self.scheduler._scheduler
            assert sched is not None
            own = KVStore(load_config(config.kv_transfer_config.kv_connector_extra_config["config"]),
                          allocate_dram=False)
            self._own_store = sched._store = sched._lookups._store = own
        self.workers: list[KVTierConnector] = []
        self.caches: list[list[torch.Tensor]] = []
        for rank in range(tp_size):
            worker = KVTierConnector(config, KVConnectorRole.WORKER, kv_cache_config())
            worker._tp = lambda rank=rank: (rank, tp_size)  # type: ignore[method-assign] # a rank without vLLM's groups
            heads = rank_heads(KV_HEADS, rank, tp_size).count
            caches = [torch.zeros(num_blocks, heads, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
                      for _ in range(LAYERS)]
            worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)})
            self.workers.append(worker)
            self.caches.append(caches)
        self.tp_size = tp_size
        self._free = list(range(num_blocks))

    def shutdown(self) -> None:
        for conn in [self.scheduler, *self.workers]:
            conn.shutdown()
        if self._own_store is not None:
            self._own_store.close()

    def prefill(self, req: Request, computed: int = 0) -> Step:
        """Schedule ``req``'s whole prompt in one step (``computed``: vLLM's own prefix-cache hit), load, "run
        the model" over the tokens not loaded, save; then report load errors back as vLLM does."""
        hit, asynchronous = self.scheduler.get_num_new_matched_tokens(req, computed)
        hit = hit or 0
        n = req.num_prompt_tokens
        blocks = [self._free.pop(0) for _ in range(math.ceil(n / BLOCK))]
        alloc = KVCacheBlocks(([KVCacheBlock(b) for b in blocks],))
        self.scheduler.update_state_after_alloc(req, alloc, hit)
        load_meta, load_errors = None, set()
        if asynchronous and hit:
            # vLLM's asynchronous load: a step without the request carries it; the request waits until every
            # worker reports it finished (with its failed blocks), then is scheduled.
            load_meta = self.scheduler.build_connector_meta(SchedulerOutput.make_empty())
            assert isinstance(load_meta, KVTierMetadata)
            load_errors = self.finish_async(load_meta, req.request_id)
        req.num_computed_tokens = computed + hit
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(req, (blocks,))]
        out.num_scheduled_tokens = {req.request_id: n - computed - hit}
        out.total_num_scheduled_tokens = n - computed - hit
        meta = self.scheduler.build_connector_meta(out)
        assert isinstance(meta, KVTierMetadata)
        errors = self.step(meta, req, blocks, computed + hit)
        return Step(meta, hit, blocks, errors | load_errors, load_meta)

    def finish_async(self, meta: KVTierMetadata, request_id: str, timeout: float = 30) -> set[int]:
        """Every worker starts ``meta``'s loads; then poll them, as vLLM's steps do, until each reports
        ``request_id`` finished; returns the blocks they reported failed."""
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)  # type: ignore[arg-type] # kvtier reads no forward context
            worker.wait_for_save()
            worker.clear_connector_metadata()
        errors: set[int] = set()
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(done) < len(self.workers):
            assert time.monotonic() < deadline, f"the asynchronous load of {request_id} never finished"
            for rank, worker in enumerate(self.workers):
                _, recving = worker.get_finished(set())
                errors |= worker.get_block_ids_with_load_errors()
                if recving and request_id in recving:
                    done.add(rank)
            time.sleep(0.005)
        self.scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids=errors,
                                                                 finished_recving={request_id}))
        return errors

    def decode(self, req: Request, blocks: list[int]) -> KVTierMetadata:
        """One decode step of ``req`` (its prompt computed): the scheduler side plans, every worker runs it."""
        n = req.num_prompt_tokens
        out = SchedulerOutput.make_empty()
        cached = out.scheduled_cached_reqs
        cached.req_ids, cached.new_block_ids, cached.num_computed_tokens = [req.request_id], [None], [n]
        cached.new_token_ids, cached.num_output_tokens = [[]], [1]
        out.num_scheduled_tokens, out.total_num_scheduled_tokens = {req.request_id: 1}, 1
        meta = self.scheduler.build_connector_meta(out)
        assert isinstance(meta, KVTierMetadata)
        self.step(meta, req, blocks, n)
        return meta

    def step(self, meta: KVTierMetadata, req: Request, blocks: list[int], loaded_upto: int) -> set[int]:
        """Every worker runs one step of ``meta``; the forward pass fills ``req``'s tokens from ``loaded_upto``."""
        errors, reports = self.run_workers(meta, req, blocks, loaded_upto)
        self.scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids=errors,
                                                                 kv_connector_worker_meta=reports))
        return errors

    def run_workers(self, meta: KVTierMetadata, req: Request, blocks: list[int],
                    loaded_upto: int) -> tuple[set[int], KVConnectorWorkerMetadata | None]:
        """:meth:`step` without telling the scheduler side: the step's output (load errors, the workers'
        aggregated reports), for a test to deliver when vLLM's asynchronous scheduling would."""
        errors: set[int] = set()
        reports: KVConnectorWorkerMetadata | None = None
        ref = reference_kv(list(req.all_token_ids))
        for rank, worker in enumerate(self.workers):
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)  # type: ignore[arg-type] # kvtier reads no forward context
            first = loaded_upto // BLOCK
            # The forward pass, layer by layer, as vLLM runs it: the new tokens' KV is written into their blocks
            # (vLLM's cache update, before the layer's attention), then the attention waits for that layer's load
            # and reads the loaded blocks (kept here, to check no load wrote them after).
            read: list[torch.Tensor] = []
            for layer in range(LAYERS):
                if first < len(blocks):
                    self._compute(rank, ref[:, :, :, first * BLOCK:], blocks[first:], layer)
                worker.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
                read.append(self.caches[rank][layer][blocks[:first]].clone())
            worker.wait_for_save()
            step_errors = worker.get_block_ids_with_load_errors()
            errors |= step_errors
            for layer, seen in enumerate(read):
                for i, block in enumerate(blocks[:first]):
                    assert block in step_errors or torch.equal(seen[i], self.caches[rank][layer][block]), \
                        f"block {block} of layer {layer} was written after the layer's wait_for_layer_load"
            report = worker.build_connector_worker_meta()  # aggregated over the ranks, as vLLM does
            reports = report if reports is None else reports.aggregate(report) if report is not None else reports
            worker.clear_connector_metadata()
        return errors, reports

    def _compute(self, rank: int, kv: torch.Tensor, blocks: list[int], layer: int) -> None:
        heads = rank_heads(KV_HEADS, rank, self.tp_size)
        padded = torch.zeros(*kv.shape[:3], len(blocks) * BLOCK, HEAD_DIM, dtype=kv.dtype)
        padded[:, :, :, :kv.shape[3]] = kv
        Scatter(padded[:, :, heads.start:heads.stop].unsqueeze(0), self.caches[rank], blocks,
                "cpu").layers(slice(layer, layer + 1))

    def read(self, blocks: list[int], tokens: int) -> torch.Tensor:
        """The canonical KV of the first ``tokens`` tokens in ``blocks``, all heads, assembled over the ranks."""
        out = torch.empty(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16)
        for rank in range(self.tp_size):
            heads = rank_heads(KV_HEADS, rank, self.tp_size)
            kv = gather(self.caches[rank], blocks[:math.ceil(tokens / BLOCK)], "cpu")
            out[:, :, heads.start:heads.stop] = kv[:, :, :, :tokens]
        return out

    def finish(self, req: Request) -> None:
        self.scheduler.request_finished(req, [])
