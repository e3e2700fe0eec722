from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from kvtier import KVStore, Namespace, TierError, chunk_keys, rank_heads
from kvtier.keys import HeadRange
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.tiers.filesystem import FilesystemTier
from tests.conftest import CLEAN_AUDIT, NS, settled, store_config

T = 16


def stored_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*.kv"))


def test_put_get_round_trip_is_exact(make_store) -> None:
    store = make_store()
    tokens = synthetic_tokens(1, 5 * T + 3)  # a partial trailing chunk is not stored
    kv = synthetic_kv(tokens)
    assert store.put(NS, tokens, kv) == 5 * T
    assert store.lookup(NS, tokens) == 5 * T
    assert store.lookup(NS, tokens[:2 * T + 1]) == 2 * T
    got = store.get(NS, tokens[:5 * T])
    assert got is not None and torch.equal(got, kv[:, :, :, :5 * T])
    assert torch.equal(store.get(NS, tokens[:T]), kv[:, :, :, :T])


def test_put_from_a_source_stores_what_put_stores(make_store) -> None:
    """A source writing straight into DRAM (the connector's save) stores exactly the chunks put would, from a
    whole-chunk offset on; a source that raises stores none of them and leaks no page."""
    store = make_store()
    tokens = synthetic_tokens(11, 6 * T)
    kv = synthetic_kv(tokens)
    asked: list[tuple[int, int]] = []

    def source(first: int, dst: torch.Tensor) -> None:
        asked.append((first, dst.shape[0]))
        chunk = 2 * T + first * T  # offset 2 chunks: chunk `first` holds tokens from here
        dst.copy_(kv[:, :, :, chunk:chunk + dst.shape[0] * T].unflatten(3, (dst.shape[0], T))
                  .permute(3, 0, 1, 2, 4, 5))

    layers, _, heads, _, dim = kv.shape
    assert store.put(NS, tokens[:2 * T], kv[:, :, :, :2 * T]) == 2 * T
    assert store.put_from(NS, tokens, source, layers=layers, head_dim=dim, dtype=kv.dtype, offset=2 * T,
                          kv_heads=heads) == 6 * T
    assert sum(n for _, n in asked) == 4  # only the chunks DRAM lacked
    assert torch.equal(store.get(NS, tokens), kv)

    def broken(first: int, dst: torch.Tensor) -> None:
        raise RuntimeError("the engine's copy failed")

    other = synthetic_tokens(12, 3 * T)
    with pytest.raises(RuntimeError, match="copy failed"):
        store.put_from(NS, other, broken, layers=layers, head_dim=dim, dtype=kv.dtype, kv_heads=heads)
    assert store.lookup(NS, other) == 0
    store.flush()  # the cascade's references to the stored chunks are released
    assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def test_a_tail_is_stored_found_and_loaded_from_dram_and_from_disk(make_store) -> None:
    """A prompt's whole blocks after its last whole chunk (blocks of 4 here) stored as a tail: a lookup with
    ``tail_block`` finds the longest stored tail whose tokens it has, a load hands it over, a new process reads it
    from the disk. Its padding is zeroed whatever the source wrote there; lookups without ``tail_block`` and tails
    of other lengths or tokens do not see it."""
    store = make_store()
    tokens = synthetic_tokens(40, 3 * T + 9)
    stored = tokens[:3 * T + 8]  # 3 chunks and a tail of 2 blocks
    kv = synthetic_kv(tokens)
    layers, _, heads, _, dim = kv.shape

    def source(first: int, dst: torch.Tensor) -> None:  # writes garbage after the tail's tokens
        dst.fill_(7)
        for c in range(dst.shape[0]):
            start = (first + c) * T
            dst[c, :, :, :, :min(T, len(stored) - start)] = kv[:, :, :, start:min(start + T, len(stored))]

    assert store.put_from(NS, stored, source, layers=layers, head_dim=dim, dtype=kv.dtype, kv_heads=heads,
                          tail=True) == 3 * T + 8
    assert store.held(NS, stored, kv_heads=heads, tail=True) == 3 * T + 8
    assert store.held(NS, stored[:-4], kv_heads=heads, tail=True) == 3 * T  # a tail of one block: not stored
    assert store.lookup(NS, tokens, tail_block=4) == 3 * T + 8
    assert store.lookup(NS, tokens) == 3 * T
    assert store.lookup(NS, tokens[:3 * T + 7], tail_block=4) == 3 * T  # has tokens for a 1-block tail only
    assert store.lookup(NS, tokens[:3 * T] + synthetic_tokens(41, 8), tail_block=4) == 3 * T
    for bad in (0, -4, 5, 2 * T):
        with pytest.raises(ValueError, match=f"tail_block must divide the chunk size {T}, got {bad}"):
            store.lookup(NS, tokens, tail_block=bad)

    def check(reader: KVStore) -> None:
        out = torch.full((layers, 2, heads, 4 * T, dim), 3, dtype=kv.dtype)

        def sink(first: int, chunks: torch.Tensor) -> None:
            out[:, :, :, first * T:(first + chunks.shape[0]) * T] = chunks.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)

        assert reader.load(NS, stored, sink, layers=layers, head_dim=dim, dtype=kv.dtype, kv_heads=heads,
                           tail=True) == 3 * T + 8
        assert torch.equal(out[:, :, :, :3 * T + 8], kv[:, :, :, :3 * T + 8])
        assert not out[:, :, :, 3 * T + 8:].any()  # zeros: never bytes a page held before

    check(store)
    store.flush()
    store.close()
    fresh = make_store()
    assert fresh.lookup(NS, tokens, tail_block=4) == 3 * T + 8
    check(fresh)


def test_a_shorter_tail_another_process_wrote_is_found(make_store) -> None:
    """Another process (a vLLM worker) wrote a prompt's chunks and its 2-block tail after this store indexed the
    directory; a prompt continuing it by 2 blocks tries the tails of 3, 2 and 1 blocks: the disk is searched for
    each (the tier's index lacks them all), and the 2-block tail is found."""
    reader = make_store()
    writer = make_store()
    tokens = synthetic_tokens(42, 3 * T + 8)
    kv = synthetic_kv(tokens)

    def source(first: int, dst: torch.Tensor) -> None:
        for c in range(dst.shape[0]):
            start = (first + c) * T
            dst[c, :, :, :, :min(T, len(tokens) - start)] = kv[:, :, :, start:min(start + T, len(tokens))]

    writer.put_from(NS, tokens, source, layers=kv.shape[0], head_dim=kv.shape[4], dtype=kv.dtype, kv_heads=4,
                    tail=True)
    writer.flush()
    assert reader.lookup(NS, tokens + synthetic_tokens(43, 8), tail_block=4) == 3 * T + 8


def test_only_the_shared_prefix_hits(make_store) -> None:
    store = make_store()
    a = synthetic_tokens(2, 4 * T)
    b = a[:2 * T] + synthetic_tokens(3, 2 * T)
    store.put(NS, a, synthetic_kv(a))
    assert store.lookup(NS, b) == 2 * T
    assert store.get(NS, b) is None
    assert torch.equal(store.get(NS, b[:2 * T]), synthetic_kv(b)[:, :, :, :2 * T])


@pytest.mark.parametrize("field", ["model", "dtype", "lora", "cache_salt", "layout_version"])
def test_namespaces_never_share_hits(make_store, field: str) -> None:
    store = make_store()
    tokens = synthetic_tokens(4, 2 * T)
    base = Namespace(model="m", dtype="bfloat16", lora="adapter-1", cache_salt="tenant-a")
    other = {"model": "m2", "dtype": "float16", "lora": "adapter-2", "cache_salt": "tenant-b",
             "layout_version": 99}[field]
    changed = dataclasses.replace(base, **{field: other})
    store.put(base, tokens, synthetic_kv(tokens))
    store.flush()
    assert store.lookup(base, tokens) == 2 * T
    assert store.lookup(changed, tokens) == 0 and store.get(changed, tokens) is None
    store.drop_dram()  # and from disk
    assert store.lookup(changed, tokens) == 0 and store.get(changed, tokens) is None


@pytest.mark.parametrize(("write_tp", "read_tp"), [(1, 2), (1, 4), (2, 1), (4, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize("from_disk", [False, True])
def test_kv_written_at_one_tp_degree_reads_at_another(make_store, write_tp: int, read_tp: int,
                                                      from_disk: bool) -> None:
    store = make_store()
    tokens = synthetic_tokens(5, 3 * T)
    kv = synthetic_kv(tokens, heads=4)
    per = 4 // write_tp
    for rank in range(write_tp):
        store.put(NS, tokens, kv[:, :, rank * per:(rank + 1) * per].clone(), tp_rank=rank, tp_size=write_tp)
    if from_disk:
        store.flush()
        store.drop_dram()
    per = 4 // read_tp
    for rank in range(read_tp):
        got = store.get(NS, tokens, tp_rank=rank, tp_size=read_tp)
        assert got is not None and torch.equal(got, kv[:, :, rank * per:(rank + 1) * per])


@pytest.mark.parametrize("write_tp", [4, 8])
@pytest.mark.parametrize("from_disk", [False, True])
def test_replicated_heads_beyond_the_kv_head_count(make_store, write_tp: int, from_disk: bool) -> None:
    """More ranks than KV heads: vLLM gives each rank one head, shared with other ranks; read at any degree."""
    store = make_store()
    tokens = synthetic_tokens(6, 3 * T)
    kv = synthetic_kv(tokens, heads=2)
    for rank in range(write_tp):
        head = rank * 2 // write_tp
        assert store.put(NS, tokens, kv[:, :, head:head + 1].clone(), tp_rank=rank, tp_size=write_tp,
                         kv_heads=2) == 3 * T
    if from_disk:
        store.flush()
        store.drop_dram()
    for read_tp in (1, 2, 4, 8):
        assert store.lookup(NS, tokens, kv_heads=2) == 3 * T
        for rank in range(read_tp):
            want = rank_heads(2, rank, read_tp)
            assert store.held(NS, tokens, tp_rank=rank, tp_size=read_tp, kv_heads=2) == 3 * T or from_disk
            got = store.get(NS, tokens, tp_rank=rank, tp_size=read_tp, kv_heads=2)
            assert got is not None and torch.equal(got, kv[:, :, want.start:want.stop])


def test_rank_heads() -> None:
    assert [str(rank_heads(8, r, 2)) for r in range(2)] == ["0-4of8", "4-8of8"]
    assert [str(rank_heads(2, r, 4)) for r in range(4)] == ["0-1of2", "0-1of2", "1-2of2", "1-2of2"]
    with pytest.raises(ValueError, match="tp_size 3 does not divide the 4 KV heads"):
        rank_heads(4, 0, 3)
    with pytest.raises(ValueError, match="neither a divisor nor a multiple"):
        rank_heads(2, 0, 3)


def test_chunk_is_visible_only_when_every_head_shard_is_present(make_store) -> None:
    store = make_store()
    tokens = synthetic_tokens(6, 2 * T)
    kv = synthetic_kv(tokens, heads=4)
    store.put(NS, tokens, kv[:, :, :2].clone(), tp_rank=0, tp_size=2)
    assert store.lookup(NS, tokens) == 0
    store.put(NS, tokens, kv[:, :, 2:].clone(), tp_rank=1, tp_size=2)
    assert store.lookup(NS, tokens) == 2 * T


def test_tp_size_that_does_not_divide_heads_is_an_error(make_store) -> None:
    store = make_store()
    tokens = synthetic_tokens(7, T)
    store.put(NS, tokens, synthetic_kv(tokens, heads=4))
    with pytest.raises(ValueError, match="tp_size 3 does not divide"):
        store.get(NS, tokens, tp_rank=0, tp_size=3, kv_heads=4)
    assert store.get(NS, tokens, tp_rank=0, tp_size=3) is None  # no head count recorded fits: a miss


def test_bad_arguments(make_store) -> None:
    store = make_store()
    tokens = synthetic_tokens(8, 2 * T)
    with pytest.raises(ValueError, match="kv holds"):
        store.put(NS, tokens, synthetic_kv(tokens[:T]))
    with pytest.raises(ValueError, match=r"\[layers, 2"):
        store.put(NS, tokens, torch.zeros(2, 3, 4, 2 * T, 8))
    with pytest.raises(ValueError, match="whole number"):
        store.get(NS, tokens[:T + 1])
    with pytest.raises(ValueError, match="tp_rank"):
        store.get(NS, tokens, tp_rank=2, tp_size=2)


def test_get_into_a_caller_buffer(make_store) -> None:
    store = make_store()
    tokens = synthetic_tokens(9, 2 * T)
    kv = synthetic_kv(tokens)
    store.put(NS, tokens, kv)
    out = torch.empty_like(kv)
    assert store.get(NS, tokens, out=out) is out and torch.equal(out, kv)
    with pytest.raises(ValueError, match="the caller expects"):
        store.get(NS, tokens, out=torch.empty(1, 2, 4, 2 * T, 8, dtype=torch.bfloat16))


def test_cascade_writes_every_chunk_to_disk_and_restart_promotes(make_store, tmp_path: Path) -> None:
    store = make_store()
    tokens = synthetic_tokens(10, 6 * T)
    kv = synthetic_kv(tokens)
    store.put(NS, tokens, kv)
    store.flush()
    assert len(stored_files(tmp_path / "fs")) == 6
    store.close()
    fresh = make_store()
    assert fresh.dram.used_bytes == 0
    assert fresh.lookup(NS, tokens) == 6 * T
    got = fresh.get(NS, tokens)
    assert got is not None and torch.equal(got, kv)
    stats = fresh.stats()
    assert stats["filesystem"]["promotions_total"] == 6
    assert stats["filesystem"]["hit_chunks_total"] == 6
    assert fresh.get(NS, tokens) is not None
    assert fresh.stats()["dram"]["hit_chunks_total"] == 6  # the second read is served from DRAM


def test_token_ids_never_reach_disk(make_store, tmp_path: Path) -> None:
    store = make_store()
    tokens = [123456789 + i for i in range(2 * T)]  # distinctive values to search for
    store.put(NS, tokens, synthetic_kv(tokens))
    store.flush()
    blob = b"".join(p.read_bytes() + p.name.encode() for p in (tmp_path / "fs").rglob("*") if p.is_file())
    import numpy as np
    for width in ("<i8", "<i4", ">i8", ">i4"):
        needle = np.asarray(tokens[:4], dtype=width).tobytes()
        assert needle not in blob
    assert b"123456789" not in blob


class GatedTier(FilesystemTier):
    """A real filesystem tier whose writes wait until the test opens ``GATE`` (a stalled shared store)."""

    GATE = threading.Event()

    def put(self, key, parts) -> None:
        assert self.GATE.wait(timeout=60), "gate never opened"
        super().put(key, parts)


@pytest.fixture
def gated_config(tmp_path: Path):
    GatedTier.GATE.clear()
    cfg = store_config(tmp_path / "fs")
    cfg["tiers"][0].update(type="tests.store.test_kvstore:GatedTier", name="filesystem")
    yield cfg
    GatedTier.GATE.set()


def test_a_stalled_tier_never_blocks_put(gated_config, tmp_path: Path) -> None:
    with KVStore.from_config(gated_config) as store:
        for i in range(20):  # with the tier stalled, every put still returns
            tokens = synthetic_tokens(100 + i, 2 * T)
            assert store.put(NS, tokens, synthetic_kv(tokens)) == 2 * T
        assert store.stats()["filesystem"]["queue_depth"] in (39, 40)  # one write may be in the stalled tier
        assert stored_files(tmp_path / "fs") == []
        GatedTier.GATE.set()
        store.flush()
        assert len(stored_files(tmp_path / "fs")) == 40


def test_full_queue_drops_and_counts(gated_config, tmp_path: Path) -> None:
    gated_config["tiers"][0]["queue_depth"] = 2
    with KVStore.from_config(gated_config) as store:
        tokens = synthetic_tokens(11, 10 * T)
        store.put(NS, tokens, synthetic_kv(tokens))
        assert store.lookup(NS, tokens) == 10 * T  # all still served from DRAM
        GatedTier.GATE.set()
        store.flush()
        dropped = store.stats()["filesystem"]["dropped_writes_total{reason=queue_full}"]
        assert 7 <= dropped <= 8  # the worker may have taken one item off before the queue filled
        assert len(stored_files(tmp_path / "fs")) == 10 - dropped
        assert store.drop_dram() == 10  # nothing stays pinned by dropped writes


class OrderedGatedTier(GatedTier):
    """A gated tier that records the chunks it writes, in order."""

    WRITTEN: ClassVar[list[str]] = []

    def put(self, key, parts) -> None:
        super().put(key, parts)
        self.WRITTEN.append(key.chunk)


def put_handoff(store: KVStore, tokens: list[int]) -> int:
    """A disaggregated prefill's save (KVStore.put_from with handoff)."""
    kv = synthetic_kv(tokens)
    layers, _, heads, _, head_dim = kv.shape

    def source(first: int, dst: torch.Tensor) -> None:
        for i in range(dst.shape[0]):
            dst[i].copy_(kv[:, :, :, (first + i) * T:(first + i + 1) * T])
    return store.put_from(NS, tokens, source, layers=layers, head_dim=head_dim, dtype=kv.dtype, kv_heads=heads,
                          handoff=True)


def test_a_handoff_is_never_dropped_for_a_full_queue_and_is_written_first(gated_config, tmp_path: Path) -> None:
    """A P/D prefill's KV, which a decode engine waits for, takes a budget of its own past a full queue (the
    ordinary writes queued behind a stalled tier are dropped as before) and goes to the tier before them."""
    gated_config["tiers"][0].update(type="tests.store.test_kvstore:OrderedGatedTier", queue_depth=2)
    gated_config["admission"] = {"store_after": 2}  # an ordinary put of a first sighting is deferred, a handoff not
    OrderedGatedTier.WRITTEN.clear()
    with KVStore.from_config(gated_config) as store:
        warm = synthetic_tokens(21, 4 * T)
        store.put(NS, warm, synthetic_kv(warm))  # first sighting: deferred
        assert store.put(NS, warm, synthetic_kv(warm)) == 4 * T  # 2 waiting (and perhaps one at the stalled tier)
        handoff = synthetic_tokens(22, 4 * T)
        assert put_handoff(store, handoff) == 4 * T  # not deferred, none dropped
        GatedTier.GATE.set()
        store.flush()
        stats = store.stats()["filesystem"]
        assert stats["dropped_writes_total{reason=handoff_budget}"] == 0
        wanted = [k.hex() for k in chunk_keys(NS, handoff, T)]
        assert set(wanted) <= set(OrderedGatedTier.WRITTEN)
        written = OrderedGatedTier.WRITTEN
        ordinary = [c for c in written if c not in wanted]
        # at most the one ordinary write the stalled tier had taken came before the handoff's, the others after
        first = written.index(wanted[0])
        assert first <= 1 and written[first:first + 4] == wanted and len(ordinary) in (2, 3), (written, wanted)
        assert written[-1] in ordinary and stats["dropped_writes_total{reason=queue_full}"] == 4 - len(ordinary)
        assert store.drop_dram() >= 4  # nothing stays pinned


def test_a_handoff_queues_again_what_dram_held_and_the_tier_never_got(redis_server, unique_prefix: str) -> None:
    """The prefill engine's DRAM holds a prompt whose writes to the shared tier failed (Redis stalled): the handoff
    writes them to the tier again, since the decode engine can read them only there. Chunks a write confirmed in
    the tier are not queued again."""
    import redis

    config = store_config(None)
    config["tiers"] = [{"type": "redis", "url": redis_server.url, "key_prefix": unique_prefix,
                        "socket_timeout": 0.2, "retry_seconds": 0}]
    tokens = synthetic_tokens(24, 4 * T)
    client = redis.Redis.from_url(redis_server.url)
    with KVStore.from_config(config) as prefill, KVStore.from_config(config) as decode:
        client.execute_command("CLIENT", "PAUSE", 1500, "WRITE")  # the writes stall and fail
        prefill.put(NS, tokens, synthetic_kv(tokens))
        prefill.flush()
        time.sleep(1.6)
        assert decode.lookup(NS, tokens) == 0
        assert put_handoff(prefill, tokens) == 4 * T  # all in the prefill's DRAM already
        prefill.flush()
        assert decode.lookup(NS, tokens) == 4 * T
        present = prefill.stats()["redis"]["present_writes_total"]
        assert put_handoff(prefill, tokens) == 4 * T  # confirmed now: nothing queued, nothing asked
        prefill.flush()
        assert prefill.stats()["redis"]["present_writes_total"] == present


def test_a_handoff_past_its_budget_is_dropped_and_counted(gated_config) -> None:
    gated_config["tiers"][0]["handoff_queue_bytes"] = 1  # one handoff write at a time fits, no more
    with KVStore.from_config(gated_config) as store:
        tokens = synthetic_tokens(23, 4 * T)
        assert put_handoff(store, tokens) == 4 * T  # all in DRAM all the same
        GatedTier.GATE.set()
        store.flush()
        assert 2 <= store.stats()["filesystem"]["dropped_writes_total{reason=handoff_budget}"] <= 3


def test_dram_budget_is_respected_and_evicts(make_store) -> None:
    store = make_store(None, dram="64KiB")  # 16 KiB pages: room for a few 2 KiB... shards of 4 KiB
    for i in range(50):
        tokens = synthetic_tokens(200 + i, 2 * T)
        store.put(NS, tokens, synthetic_kv(tokens, heads=16))
        assert store.dram.used_bytes <= store.dram.capacity_bytes
    stats = store.stats()
    assert stats["dram"]["evictions_total"] > 0
    last = synthetic_tokens(249, 2 * T)
    assert torch.equal(store.get(NS, last), synthetic_kv(last, heads=16))


def test_a_failing_tier_never_reaches_the_caller(make_store, tmp_path: Path, caplog) -> None:
    store = make_store()
    tier = store.tiers[0]

    def broken_put(key, parts):
        raise TierError("disk on fire")

    tier.put = broken_put  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        for i in range(5):
            tokens = synthetic_tokens(300 + i, T)
            store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
    stats = store.stats()["filesystem"]
    # One failed write puts the tier to rest for retry_seconds; the writes meanwhile are dropped, counted.
    assert stats["write_errors_total"] == 1 and stats["dropped_writes_total{reason=tier_unavailable}"] == 4
    assert sum("failing" in r.message for r in caplog.records) == 1  # logged once per outage
    tokens = synthetic_tokens(300, T)
    assert torch.equal(store.get(NS, tokens), synthetic_kv(tokens))


def test_offset_puts_and_gets_only_the_tail(make_store) -> None:
    store = make_store()
    tokens = synthetic_tokens(400, 5 * T)
    kv = synthetic_kv(tokens)
    assert store.put(NS, tokens[:2 * T], kv[:, :, :, :2 * T]) == 2 * T
    # The caller knows the first two chunks are stored: it hands over only the tail's KV.
    assert store.put(NS, tokens, kv[:, :, :, 2 * T:], offset=2 * T) == 5 * T
    assert torch.equal(store.get(NS, tokens), kv)
    assert torch.equal(store.get(NS, tokens, offset=3 * T), kv[:, :, :, 3 * T:])
    other = synthetic_tokens(401, 5 * T)  # same tail tokens after another prefix: other keys
    assert store.get(NS, other[:2 * T] + tokens[2 * T:], offset=2 * T) is None
    with pytest.raises(ValueError, match="offset"):
        store.put(NS, tokens, kv, offset=T + 1)
    with pytest.raises(ValueError, match="after offset"):
        store.put(NS, tokens, kv, offset=T)
    with pytest.raises(ValueError, match="offset 80"):
        store.get(NS, tokens, offset=5 * T)


@pytest.mark.parametrize(("write_tp", "read_tp"), [(1, 1), (1, 2), (4, 2), (2, 4)])
@pytest.mark.parametrize("where", ["dram", "disk", "fragmented"])
@pytest.mark.parametrize("streamed", [False, True], ids=["planned first", "streamed"])
def test_load_hands_over_exactly_what_get_returns(make_store, write_tp: int, read_tp: int, where: str,
                                                  streamed: bool) -> None:
    """load's views (runs of DRAM pages, head slices, shards assembled from pieces, bytes read from disk) hold
    the same KV as get, chunk by chunk, and every pin is released afterwards; streamed (a chunk at a time, as it
    is read) or not."""
    # Pages of 4 KiB against 1-4 KiB shards: entries share pages' strides; "fragmented" leaves gaps and splits.
    store = make_store(dram="96KiB" if where == "fragmented" else "8MiB", page_bytes="4KiB")
    tokens = synthetic_tokens(20, 5 * T)
    kv = synthetic_kv(tokens, heads=4)
    per = 4 // write_tp
    for rank in range(write_tp):
        store.put(NS, tokens, kv[:, :, rank * per:(rank + 1) * per].clone(), tp_rank=rank, tp_size=write_tp)
    if where != "dram":
        store.flush()
        store.drop_dram()
    if where == "fragmented":  # other entries in between, so promoted chunks land in scattered pages
        for seed in range(30, 36):
            other = synthetic_tokens(seed, T)
            store.put(NS, other, synthetic_kv(other, heads=4))
    per = 4 // read_tp
    for rank in range(read_tp):
        want = kv[:, :, rank * per:(rank + 1) * per, T:]  # from the second chunk on
        got = torch.empty_like(want)
        seen: list[int] = []

        def sink(first: int, views: torch.Tensor) -> None:
            for j in range(views.shape[0]):
                seen.append(first + j)  # noqa: B023 the sink is used by this iteration's load only
                got[:, :, :, (first + j) * T:(first + j + 1) * T] = views[j]  # noqa: B023 as above

        assert store.load(NS, tokens, sink, layers=2, head_dim=8, dtype=torch.bfloat16, tp_rank=rank,
                          tp_size=read_tp, offset=T, streamed=streamed) == 4 * T
        assert (seen if streamed else sorted(seen)) == [0, 1, 2, 3] and torch.equal(got, want)
    store.flush()
    assert store.dram.audit()["refs"] == 0 and store.dram.audit()["pending"] == 0


@pytest.mark.parametrize("streamed", [False, True], ids=["planned first", "streamed"])
def test_a_sink_that_raises_leaves_nothing_pinned(make_store, streamed: bool) -> None:
    store = make_store()
    tokens = synthetic_tokens(21, 3 * T)
    store.put(NS, tokens, synthetic_kv(tokens))
    store.flush()
    if streamed:  # the first chunk in DRAM, the rest read from the disk after the sink fails on it
        store.drop_dram()
        store.get(NS, tokens[:T])

    def sink(first: int, views: torch.Tensor) -> None:
        raise RuntimeError("the engine's copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        store.load(NS, tokens, sink, layers=2, head_dim=8, dtype=torch.bfloat16, streamed=streamed)
    assert settled(store) == CLEAN_AUDIT  # (reads ahead still under way give their entries back as they end)
    assert store.load(NS, synthetic_tokens(22, T), sink, layers=2, head_dim=8, dtype=torch.bfloat16) == 0


def test_loading_holds_every_view_pinned_until_its_block_ends(make_store) -> None:
    """loading hands a load's views all at once (the connector copies them layer by layer, on another thread,
    while the engine runs): while the block runs, no eviction takes their pages (drop_dram evicts nothing of
    them), and they hold the stored KV; once it ends nothing is pinned. A miss is a block with no views; an
    exception in the block releases the pins too."""
    store = make_store()
    tokens = synthetic_tokens(24, 4 * T)
    kv = synthetic_kv(tokens)
    store.put(NS, tokens, kv)
    store.flush()
    shape = {"layers": 2, "head_dim": 8, "dtype": torch.bfloat16}
    with store.loading(NS, tokens, **shape, offset=T) as loaded:
        assert loaded.tokens == 3 * T and sum(v.shape[0] for _, v in loaded.views) == 3
        store.drop_dram()  # the held chunks are in use: not evicted under the views
        heads = HeadRange(0, kv.shape[2], kv.shape[2])
        assert [store.in_dram(NS.id, key.hex(), heads) for key in chunk_keys(NS, tokens, T)] == \
            [False, True, True, True]
        got = torch.cat([v for _, v in loaded.views]).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
        assert torch.equal(got, kv[:, :, :, T:])
    assert store.dram.audit()["refs"] == 0 and loaded.views == []  # none kept past the pins
    with store.loading(NS, synthetic_tokens(25, T), **shape) as missed:
        assert missed.views == [] and missed.tokens == 0
    with pytest.raises(RuntimeError, match="engine failed"), store.loading(NS, tokens, **shape):
        raise RuntimeError("the engine failed mid-copy")
    assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def on_disk(make_store, seed: int, chunks: int) -> tuple[KVStore, list[int], torch.Tensor]:  # type: ignore[no-untyped-def]
    """A store whose DRAM pages are 4 KiB, holding ``chunks`` chunks (4 KV heads) on its disk only."""
    store = make_store(page_bytes="4KiB")
    tokens = synthetic_tokens(seed, chunks * T)
    kv = synthetic_kv(tokens, heads=4)
    store.put(NS, tokens, kv)
    store.flush()
    store.drop_dram()
    return store, tokens, kv


def read_by_layers(store: KVStore, tokens: list[int], layers: int = 2) -> tuple[int, torch.Tensor | None]:
    """A load by layers as the vLLM connector runs one: every layer read, then copied out, in order; the tokens
    verified and the KV copied (None when nothing was found)."""
    with store.loading(NS, tokens, layers=layers, head_dim=8, dtype=torch.bfloat16, by_layers=True) as loaded:
        if not loaded.views:
            return 0, None
        out = torch.empty(layers, 2, 4, loaded.views[-1][0] * T + loaded.views[-1][1].shape[0] * T, 8,
                          dtype=torch.bfloat16)
        for layer in range(layers):
            loaded.read_layer(layer)
            for first, kv in loaded.views:
                span = slice(first * T, (first + kv.shape[0]) * T)
                out[layer, :, :, span] = kv[:, layer].permute(1, 2, 0, 3, 4).flatten(2, 3)
        return loaded.verified(), out


def test_a_load_by_layers_reads_a_disks_shards_a_layer_at_a_time_and_verifies_them(make_store, tmp_path) -> None:
    """From a disk, a load by layers opens each shard and reads its payload a layer at a time into DRAM, hashing
    as it goes: the KV copied out is exact, and once verified the shards are promoted into DRAM (the next load
    needs no disk). A shard with one flipped byte in its last layer fails its checksum only once all of it is
    read: the tokens verified stop at its chunk, the file is removed and counted, nothing of it stays in DRAM.
    Nothing leaks: no page, no reservation, no open file."""
    store, tokens, kv = on_disk(make_store, 26, 4)
    fds = len(os.listdir("/proc/self/fd"))
    assert store.lookup(NS, tokens, local_only=True) == 4 * T
    verified, got = read_by_layers(store, tokens)
    assert verified == 4 * T and got is not None and torch.equal(got, kv)
    heads = HeadRange(0, 4, 4)
    assert all(store.in_dram(NS.id, key.hex(), heads) for key in chunk_keys(NS, tokens, T))  # promoted

    store.drop_dram()
    third = next((tmp_path / "fs").rglob(f"{chunk_keys(NS, tokens, T)[2].hex()}.*.kv"))
    blob = bytearray(third.read_bytes())
    blob[-3] ^= 0x10  # in the last layer's bytes: seen by the checksum only at the end
    third.write_bytes(blob)
    before = store.stats()["filesystem"]["corrupt_objects_total"]
    verified, got = read_by_layers(store, tokens)
    assert verified == 2 * T and got is not None and torch.equal(got[:, :, :, :2 * T], kv[:, :, :, :2 * T])
    assert not third.exists() and store.stats()["filesystem"]["corrupt_objects_total"] == before + 1
    assert [store.in_dram(NS.id, key.hex(), heads) for key in chunk_keys(NS, tokens, T)] == [True, True, False, True]
    assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_load_by_layers_that_stops_early_promotes_nothing_unverified(make_store) -> None:
    """The caller's block ends before every layer is read (the engine failed mid-step): the shards opened for it
    are aborted, never promoted, their files closed; the next load reads them again from the disk, exactly."""
    store, tokens, kv = on_disk(make_store, 27, 3)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError, match="mid-step"), \
            store.loading(NS, tokens, layers=2, head_dim=8, dtype=torch.bfloat16, by_layers=True) as loaded:
        loaded.read_layer(0)
        raise RuntimeError("the engine failed mid-step")
    assert not any(store.in_dram(NS.id, key.hex(), HeadRange(0, 4, 4)) for key in chunk_keys(NS, tokens, T))
    assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}
    assert len(os.listdir("/proc/self/fd")) == fds
    verified, got = read_by_layers(store, tokens)
    assert verified == 3 * T and got is not None and torch.equal(got, kv)


def test_a_load_by_layers_serves_nothing_before_it_is_verified(make_store, tmp_path, monkeypatch) -> None:
    """Between the layers' reads the shards are only reserved: not in DRAM for anyone else (another load of the
    same prompt reads the disk itself, exactly), layer 1 not read yet. Loaded from the second chunk on with the
    third corrupt, the tokens verified stop at the third chunk (counted from the load's first). verified is
    asked once: asked again it answers the same; asked before every layer is read, the file is not blamed (not
    removed, not counted); asked after the block, it refuses."""
    from kvtier.tiers.filesystem import reads as fs_reads

    store, tokens, kv = on_disk(make_store, 28, 4)
    shape = {"layers": 2, "head_dim": 8, "dtype": torch.bfloat16}
    heads = HeadRange(0, 4, 4)
    keys = chunk_keys(NS, tokens, T)
    reads: list[tuple[int, int]] = []  # (offset in the payload, bytes) of each piece read
    real = fs_reads.FileRanges.read_into

    def read_into(self, offset: int, buffers) -> None:  # type: ignore[no-untyped-def]
        reads.append((offset, sum(len(b) for b in buffers)))
        real(self, offset, buffers)

    monkeypatch.setattr(fs_reads.FileRanges, "read_into", read_into)
    layer_bytes = kv[:, :, :, :T].numel() * kv.element_size() // 2  # a chunk's payload holds 2 layers
    with store.loading(NS, tokens, **shape, by_layers=True) as loaded:
        loaded.read_layer(0)
        assert reads == [(0, layer_bytes)] * 4  # layer 0 of each shard, nothing more
        assert store.dram.audit()["pending"] == 4 and not any(store.in_dram(NS.id, k.hex(), heads) for k in keys)
        first, view = loaded.views[0]
        assert torch.equal(view[0, 0], kv[0, :, :, first * T:(first + 1) * T])  # layer 0 read
        assert torch.equal(store.get(NS, tokens), kv)  # another read: from the disk, verified
        before = store.stats()["filesystem"]["corrupt_objects_total"]
        assert loaded.verified() == 0 and loaded.verified() == 0  # not read whole: nothing served
    assert store.stats()["filesystem"]["corrupt_objects_total"] == before
    assert len(list((tmp_path / "fs").rglob("*.kv"))) == 4  # no file blamed
    assert loaded.verified() == 0  # its answer stands after the block
    with store.loading(NS, tokens, **shape, by_layers=True) as unasked:
        unasked.read_layer(0)
    with pytest.raises(RuntimeError, match="after its block"):  # its shards were dropped unverified
        unasked.verified()
    store.drop_dram()
    third = next((tmp_path / "fs").rglob(f"{keys[2].hex()}.*.kv"))
    blob = bytearray(third.read_bytes())
    blob[-1] ^= 0x02
    third.write_bytes(blob)
    with store.loading(NS, tokens, **shape, offset=T, by_layers=True) as loaded:
        for layer in range(2):
            loaded.read_layer(layer)
        assert loaded.verified() == T and loaded.verified() == T  # the second chunk; the third failed
    assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def test_a_load_by_layers_refuses_a_file_swapped_for_another_chunks(make_store, tmp_path) -> None:
    """A writer to the disk puts the first chunk's file (a valid object, the same size) under the second chunk's
    name: its header names another key, so the load by layers refuses it when it opens it, before any of it is
    read or copied; the second chunk is a miss (the load ends before it), the file is removed and counted."""
    store, tokens, kv = on_disk(make_store, 30, 3)
    keys = chunk_keys(NS, tokens, T)
    first, second = (next((tmp_path / "fs").rglob(f"{k.hex()}.*.kv")) for k in keys[:2])
    second.write_bytes(first.read_bytes())
    before = store.stats()["filesystem"]["corrupt_objects_total"]
    verified, got = read_by_layers(store, tokens)
    assert verified == T and got is not None and torch.equal(got[:, :, :, :T], kv[:, :, :, :T])
    assert not second.exists() and store.stats()["filesystem"]["corrupt_objects_total"] == before + 1
    assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def test_a_file_that_fails_to_close_leaks_no_reservation(make_store, monkeypatch) -> None:
    """Closing a shard's file raises (EIO on a network filesystem): every other shard of the load is still
    dropped or verified, no reservation stays pending, and the chunks before it are served."""
    from kvtier.tiers.filesystem import reads as fs_reads

    store, tokens, _ = on_disk(make_store, 29, 3)
    real = fs_reads.FileRanges.close
    calls = [0]

    def close(self) -> None:  # type: ignore[no-untyped-def]
        calls[0] += 1
        real(self)
        if calls[0] == 2:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(fs_reads.FileRanges, "close", close)
    with pytest.raises(OSError, match="Input/output"), \
            store.loading(NS, tokens, layers=2, head_dim=8, dtype=torch.bfloat16, by_layers=True) as loaded:
        for layer in range(2):
            loaded.read_layer(layer)
        loaded.verified()
    assert calls[0] == 3
    assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


class ReadAheadTier(FilesystemTier):
    """A real filesystem tier read ahead on threads, as a server's is (Redis, S3), that logs each shard it reads."""

    read_ahead = True
    LOG: ClassVar[list[str]] = []

    def get_into(self, key, header_len, payload):  # type: ignore[no-untyped-def]
        self.LOG.append(f"read {key.chunk}")
        return super().get_into(key, header_len, payload)


def test_a_streamed_load_hands_each_chunk_over_while_the_next_are_read(tmp_path: Path) -> None:
    """A load from a tier read ahead (a shared tier's, loaded beside vLLM's steps) copies each chunk as soon as it
    is read, while the next ones are read: the first chunk reaches the sink before the last one is read. Not
    streamed, every read ends before the first copy."""
    cfg = store_config(tmp_path / "fs")
    cfg["tiers"][0].update(type="tests.store.test_kvstore:ReadAheadTier", name="filesystem")
    tokens = synthetic_tokens(24, 8 * T)
    kv = synthetic_kv(tokens)
    chunks = [k.hex() for k in chunk_keys(NS, tokens, T)]
    with KVStore.from_config(cfg) as store:
        store.put(NS, tokens, kv)
        store.flush()
        for streamed in (True, False):
            store.drop_dram()
            ReadAheadTier.LOG.clear()
            got = torch.empty_like(kv)

            def sink(first: int, views: torch.Tensor) -> None:
                ReadAheadTier.LOG.append(f"copy {first}")
                for j in range(views.shape[0]):
                    got[:, :, :, (first + j) * T:(first + j + 1) * T] = views[j]  # noqa: B023 this load's

            assert store.load(NS, tokens, sink, layers=2, head_dim=8, dtype=torch.bfloat16,
                              streamed=streamed) == 8 * T
            assert torch.equal(got, kv)
            log = ReadAheadTier.LOG
            assert sorted(e for e in log if e.startswith("read")) == sorted(f"read {c}" for c in chunks)
            if streamed:
                assert log.index("copy 0") < log.index(f"read {chunks[-1]}")
                assert [e for e in log if e.startswith("copy")] == [f"copy {i}" for i in range(8)]
            else:
                assert log.index("copy 0") > max(log.index(f"read {c}") for c in chunks)
        assert store.dram.audit()["refs"] == 0 and store.dram.audit()["pending"] == 0


class GatedReadsTier(FilesystemTier):
    """A real filesystem tier read ahead whose reads wait for ``GATE``, logging when they start and end and when the
    tier closes."""

    read_ahead = True
    GATE = threading.Event()
    LOG: ClassVar[list[str]] = []

    def get_into(self, key, header_len, payload):  # type: ignore[no-untyped-def]
        self.LOG.append("read")
        assert self.GATE.wait(timeout=30), "gate never opened"
        try:
            return super().get_into(key, header_len, payload)
        finally:
            self.LOG.append("read ended")

    def close(self) -> None:
        self.LOG.append("closed")
        super().close()


def test_a_store_closing_during_reads_ahead_closes_its_tier_only_after_them(tmp_path: Path) -> None:
    """Reads ahead still running when the store closes are waited for before the tier closes, and none starts after
    it (a Redis read would open new connections, a file read would use a closed directory's descriptor)."""
    cfg = store_config(tmp_path / "fs")
    cfg["tiers"][0].update(type="tests.store.test_kvstore:GatedReadsTier", name="filesystem")
    tokens = synthetic_tokens(26, 8 * T)
    GatedReadsTier.GATE.set()
    store = KVStore.from_config(cfg)
    store.put(NS, tokens, synthetic_kv(tokens))
    store.flush()
    store.drop_dram()
    GatedReadsTier.GATE.clear()
    GatedReadsTier.LOG.clear()
    raised: list[BaseException] = []

    def get() -> None:
        try:
            store.get(NS, tokens)
        except BaseException as exc:  # noqa: BLE001 checked below
            raised.append(exc)

    loading = threading.Thread(target=get, daemon=True)
    loading.start()
    deadline = time.monotonic() + 10
    while GatedReadsTier.LOG.count("read") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    closing = threading.Thread(target=store.close)
    closing.start()
    time.sleep(0.2)
    assert "closed" not in GatedReadsTier.LOG  # waiting for the reads under way
    GatedReadsTier.GATE.set()
    closing.join(timeout=10)
    loading.join(timeout=10)
    log = GatedReadsTier.LOG
    assert not closing.is_alive() and "closed" in log
    closed = log.index("closed")
    assert "read" not in log[closed:] and log[:closed].count("read") == log[:closed].count("read ended")
    # The get that was under way fails at its next read ahead (the store is closed); none other is possible.
    assert [str(e) for e in raised] in ([], ["kvtier-read-filesystem: submit after close (no thread would run it)"])


class ListedTier(FilesystemTier):
    """A real filesystem tier that answers heads a listing per chunk, as S3 does, counting the chunks asked."""

    heads_in_one_call = False
    read_ahead = True
    ASKED: ClassVar[list[list[str]]] = []  # the chunks of each question
    READ: ClassVar[list[str]] = []  # the shards read, by name
    THREADS: ClassVar[list[str]] = []  # the threads that read them

    def heads(self, namespace, chunks):  # type: ignore[no-untyped-def]
        self.ASKED.append(list(chunks))
        return super().heads(namespace, chunks)

    def get_into(self, key, header_len, payload):  # type: ignore[no-untyped-def]
        got = super().get_into(key, header_len, payload)
        self.READ.append(key.name if got is not None else f"missing {key.name}")
        self.THREADS.append(threading.current_thread().name)
        return got

    def get(self, key):  # type: ignore[no-untyped-def]
        self.READ.append(f"bytes {key.name}")
        return super().get(key)


@pytest.mark.parametrize(("write_tp", "read_tp"), [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_a_read_from_a_tier_listed_chunk_by_chunk_asks_only_where_its_own_shard_is_not_there(
        tmp_path: Path, write_tp: int, read_tp: int) -> None:
    """A read from a tier that lists each chunk apart (S3) takes the shard of its own heads as what each chunk holds
    and reads it, asking nothing, where the KV was written at the reader's TP degree; where it was not, the first
    chunk's own shard is missing, and that chunk and all after it are asked about in one question, then read
    from the answer (once each): the same KV either way."""
    cfg = store_config(tmp_path / "fs")
    cfg["tiers"][0].update(type="tests.store.test_kvstore:ListedTier", name="filesystem")
    tokens = synthetic_tokens(25, 4 * T)
    kv = synthetic_kv(tokens, heads=4)
    with KVStore.from_config(cfg) as store:
        per = 4 // write_tp
        for rank in range(write_tp):
            store.put(NS, tokens, kv[:, :, rank * per:(rank + 1) * per].clone(), tp_rank=rank, tp_size=write_tp)
        store.flush()
        per = 4 // read_tp
        for rank in range(read_tp):
            store.drop_dram()  # (a rank's read promotes whole shards: the next would find them in DRAM)
            ListedTier.ASKED.clear()
            ListedTier.READ.clear()
            ListedTier.THREADS.clear()
            got = torch.empty_like(kv[:, :, rank * per:(rank + 1) * per])

            def sink(first: int, views: torch.Tensor) -> None:
                for j in range(views.shape[0]):
                    got[:, :, :, (first + j) * T:(first + j + 1) * T] = views[j]  # noqa: B023 this load's

            assert store.load(NS, tokens, sink, layers=2, head_dim=8, dtype=torch.bfloat16, tp_rank=rank,
                              tp_size=read_tp, kv_heads=4) == 4 * T
            assert torch.equal(got, kv[:, :, rank * per:(rank + 1) * per])
            chunks = [k.hex() for k in chunk_keys(NS, tokens, T)]
            asked = [] if write_tp == read_tp else [chunks]  # nothing, or every chunk in one question
            assert asked == ListedTier.ASKED
            found = [name for name in ListedTier.READ if not name.startswith("missing")]
            assert len(found) == len(set(found)) == 4 * max(1, write_tp // read_tp)  # each shard it needs, once
            # read ahead, also after a wrong guess (the wrong guesses' reads give their slots back)
            assert sum(t.startswith("kvtier-read") for t in ListedTier.THREADS) >= len(found) - 1
        assert settled(store) == CLEAN_AUDIT  # (guessed reads ahead that missed give their entries back)


def test_a_wrong_guess_among_right_ones_reads_each_shard_once_and_leaks_nothing(tmp_path: Path) -> None:
    """The first chunk written at another TP degree, the rest at the reader's: the guesses of the others, read ahead
    already, stand; the first is asked about with them and read once; nothing is left reserved."""
    cfg = store_config(tmp_path / "fs")
    cfg["tiers"][0].update(type="tests.store.test_kvstore:ListedTier", name="filesystem")
    tokens = synthetic_tokens(27, 3 * T)
    kv = synthetic_kv(tokens, heads=4)
    with KVStore.from_config(cfg) as store:
        store.put(NS, tokens[:T], kv[:, :, :, :T].clone())  # the first chunk whole (TP 1)
        for rank in range(2):  # the rest per rank (TP 2)
            store.put(NS, tokens, kv[:, :, rank * 2:(rank + 1) * 2, T:].clone(), tp_rank=rank, tp_size=2, offset=T)
        store.flush()
        store.drop_dram()
        ListedTier.READ.clear()
        got = torch.empty_like(kv[:, :, :2])

        def sink(first: int, views: torch.Tensor) -> None:
            for j in range(views.shape[0]):
                got[:, :, :, (first + j) * T:(first + j + 1) * T] = views[j]

        assert store.load(NS, tokens, sink, layers=2, head_dim=8, dtype=torch.bfloat16, tp_size=2,
                          kv_heads=4) == 3 * T
        assert torch.equal(got, kv[:, :, :2])
        found = [name.removeprefix("bytes ") for name in ListedTier.READ if not name.startswith("missing")]
        assert len(found) == len(set(found)) == 3
        assert settled(store) == CLEAN_AUDIT


@pytest.mark.parametrize("streamed", [False, True], ids=["planned first", "streamed"])
def test_a_load_hands_over_the_chunks_before_a_missing_one(make_store, tmp_path, streamed: bool) -> None:
    store = make_store()
    tokens = synthetic_tokens(23, 4 * T)
    kv = synthetic_kv(tokens)
    store.put(NS, tokens, kv)
    store.flush()
    store.drop_dram()
    third = chunk_keys(NS, tokens, T)[2].hex()
    next((tmp_path / "fs").rglob(f"{third}.*.kv")).unlink()  # gone from the disk
    got: dict[int, torch.Tensor] = {}

    def sink(first: int, views: torch.Tensor) -> None:
        for j in range(views.shape[0]):
            got[first + j] = views[j].clone()

    assert store.load(NS, tokens, sink, layers=2, head_dim=8, dtype=torch.bfloat16, streamed=streamed) == 2 * T
    assert sorted(got) == [0, 1] and all(torch.equal(got[i], kv[:, :, :, i * T:(i + 1) * T]) for i in got)
    assert store.get(NS, tokens) is None  # get is all or nothing


def test_lookup_each_answers_each_named_chunk_on_its_own(make_store, tmp_path) -> None:
    """Named chunks (an engine's own keys) stand alone: one missing does not hide the ones after it, in DRAM, on
    a disk this store wrote, and on a disk another process wrote after this store started (not in its index)."""
    from kvtier.keys import NamedChunks

    names = [bytes([i]) * 32 for i in range(6)]
    kv = synthetic_kv(list(range(48)), layers=2, heads=1, head_dim=8)
    writer, reader = make_store(), make_store()  # same directory; the reader's index is built before the writes
    held = [names[i] for i in (1, 3, 5)]
    assert writer.put(NS, NamedChunks(held, 16), kv) == 48
    writer.flush()
    assert writer.lookup_each(NS, NamedChunks(names, 16), kv_heads=1) == [False, True, False, True, False, True]
    writer.drop_dram()
    assert writer.lookup_each(NS, NamedChunks(names, 16), kv_heads=1) == [False, True, False, True, False, True]
    assert reader.lookup_each(NS, NamedChunks(names, 16), kv_heads=1) == [False, True, False, True, False, True]
    assert reader.lookup(NS, NamedChunks(names, 16)) == 0  # (a prefix lookup stops at the first missing)
