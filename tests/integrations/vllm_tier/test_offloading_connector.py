"""The tier as a vLLM user configures it: vLLM's own ``OffloadingConnector`` (scheduler role, the part that runs on
a CPU host; its worker copies GPU blocks) built from ``kv_connector_extra_config`` with ``TieringOffloadingSpec``
and kvtier's entry, kvtier's config in a YAML file. The keys are vLLM's own, from a real request's block hashes:
rows a first engine stored are what a restarted engine's connector finds for the same prompt, promoted into its
primary tier byte for byte, and nothing for another prompt or another cache salt."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import ScheduleEndContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.request import Request

from kvtier.integrations.vllm_tier import KVTierSecondaryTier
from kvtier.keys import fingerprint_model
from kvtier.testing.vllm_tiering import row_bytes

BLOCK, CHUNK = 128, 256  # vLLM's CPU block size; the offloaded chunk (``block_size`` in the extra config)
LAYERS = 2  # the tiny Llama of the fixtures


def user_config(model_dir: Path, kvtier_yaml: Path) -> VllmConfig:
    """The engine config a user's flags make: ``--kv-transfer-config`` as docs/vllm-native.md shows it."""
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 20, "block_size": CHUNK,
             "secondary_tiers": [{"type": "KVTierSecondaryTier", "module_path": "kvtier.integrations.vllm_tier",
                                  "config": str(kvtier_yaml)}]}
    kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    return EngineArgs(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, max_model_len=2048,
                      dtype="bfloat16", block_size=BLOCK, kv_transfer_config=kv).create_engine_config()


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn))


def manager_of(conn: OffloadingConnector) -> TieringOffloadingManager:
    manager = conn.connector_scheduler.manager  # type: ignore[union-attr]
    assert isinstance(manager, TieringOffloadingManager)
    return manager


def matched(conn: OffloadingConnector, req: Request, timeout: float = 30.0) -> int:
    """The connector's answer for ``req``, asked again each step while it says "not yet" (as the scheduler does)."""
    conn.on_new_request(req)
    deadline = time.monotonic() + timeout
    while True:
        hit, _ = conn.get_num_new_matched_tokens(req, 0)
        if hit is not None:
            return hit
        assert time.monotonic() < deadline, "the connector never answered"
        manager_of(conn).on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(0.002)


@pytest.fixture
def kvtier_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"dram": {"capacity_bytes": "4MiB", "page_bytes": "64KiB"},
                                    "tiers": [{"type": "filesystem", "name": "disk", "path": str(tmp_path / "kv")}]}))
    return path


def test_a_restarted_engine_finds_what_the_first_stored_under_vllms_own_keys(model_dir: Path,
                                                                            kvtier_yaml: Path) -> None:
    prompt = list(range(1000))  # 7 blocks, 3 whole chunks of 256
    config = user_config(model_dir, kvtier_yaml)
    first = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        manager = manager_of(first)
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, KVTierSecondaryTier)
        assert tier.namespace.model == fingerprint_model(model_dir)  # fingerprinted, no model_fingerprint needed
        req = request("first", prompt)
        assert matched(first, req) == 0
        state = first.connector_scheduler._req_status["first"]  # type: ignore[union-attr]
        keys, req_context = state.group_states[0].offload_keys, state.req_context
        assert len(keys) == 3
        # What the worker does after a prefill: the GPU's blocks copied into the primary's slots.
        out = manager.prepare_store(keys, req_context)
        assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
        view = torch.from_numpy(np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8))
        rows = {key: row_bytes(key, view.shape[1]) for key in keys}
        for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids):
            view[int(slot)].copy_(torch.from_numpy(rows[key]))
        manager.complete_store(out.keys_to_store, req_context)
        while manager.has_pending_work():
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            time.sleep(0.002)
        del view
    finally:
        first.shutdown()  # kvtier's cascade finishes its writes

    second = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        assert matched(second, request("again", prompt + [7, 7])) == 3 * CHUNK
        manager = manager_of(second)
        state = second.connector_scheduler._req_status["again"]  # type: ignore[union-attr]
        spec = manager.prepare_load(keys, state.req_context)
        assert isinstance(spec, CPULoadStoreSpec)
        view = torch.from_numpy(np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8))
        assert all(np.array_equal(view[int(slot)].numpy(), rows[key]) for key, slot in zip(keys, spec.chunk_ids))
        del view
        assert matched(second, request("other", [5] + prompt[1:])) == 0  # another first token: another chain
        assert matched(second, request("salted", prompt, salt="tenant-b")) == 0  # the salt is in vLLM's keys
    finally:
        second.shutdown()


def test_engine_settings_that_change_kv_change_the_rows_namespace(model_dir: Path, kvtier_yaml: Path) -> None:
    """vLLM passes a tier no engine settings; the tier reads them from the connector that builds it, as kvtier's own
    connector names them: a RoPE override names other rows."""
    def namespace_id(**engine: object) -> str:
        config = user_config(model_dir, kvtier_yaml)
        if engine:
            args = {"model": str(model_dir), "skip_tokenizer_init": True, "enforce_eager": True,
                    "max_model_len": 2048, "dtype": "bfloat16", "block_size": BLOCK,
                    "kv_transfer_config": config.kv_transfer_config, **engine}
            config = EngineArgs(**args).create_engine_config()  # type: ignore[arg-type]
        conn = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
        try:
            (tier,) = manager_of(conn).secondary_tiers
            assert isinstance(tier, KVTierSecondaryTier)
            return tier.namespace.id
        finally:
            conn.shutdown()

    plain = namespace_id()
    assert namespace_id() == plain  # the same engine, restarted: the same rows
    assert namespace_id(hf_overrides={"rope_theta": 1234.0}) != plain
    assert namespace_id(hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 4.0}}) != plain
