"""The store against tiers that misbehave: objects whose headers lie, tiers that raise anything, a DRAM pool
under pressure, a slow tier holding DRAM, a metrics port. Each case is a miss or a counted event, never wrong KV,
never an exception out of lookup or get, never leaked DRAM."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvtier import KVStore, chunk_keys, frame, load_config
from kvtier.dram import Refused
from kvtier.errors import ObjectError, TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.store import prefetch
from kvtier.store.prefetch import Prefetch
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.tiers.base import Buffer, StoredObject, Tier
from tests.conftest import CLEAN_AUDIT, NS, settled

T = 16


class DictTier(Tier):
    """An in-memory tier the tests can fill with any bytes, and make raise on demand."""

    def __init__(self, name: str = "mem") -> None:
        super().__init__(name, None)
        self.objects: dict[ShardKey, bytes] = {}
        self.raise_on: dict[str, BaseException] = {}  # method name -> exception to raise
        self.calls: dict[str, int] = {}
        self.asked: list[int] = []  # how many keys each heads() call named

    def _enter(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if method in self.raise_on:
            raise self.raise_on[method]

    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        self._enter("put")
        self.objects[key] = b"".join(bytes(p) for p in parts)

    def get(self, key: ShardKey) -> Buffer | None:
        self._enter("get")
        return self.objects.get(key)

    def delete(self, key: ShardKey) -> bool:
        self._enter("delete")
        return self.objects.pop(key, None) is not None

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        self._enter("heads")
        self.asked.append(len(chunks))
        return [[k.heads for k in self.objects if k.namespace == namespace and k.chunk == c] for c in chunks]

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        return iter([])


def open_store(tier: Tier, dram: str = "8MiB", **spec: object) -> KVStore:
    cfg = load_config({"chunk_tokens": T, "dram": {"capacity_bytes": dram, "page_bytes": "4KiB"},
                       "tiers": [{"type": "filesystem", "name": tier.name, "path": "/unused", **spec}]})
    return KVStore(cfg, tiers=[tier])


@pytest.fixture
def tier() -> Iterator[DictTier]:
    yield DictTier()


def shard_bytes(key: ShardKey, kv: torch.Tensor, *, tokens: int | None = None) -> bytes:
    """A valid stored object for ``key`` holding ``kv`` (one chunk, ``[layers, 2, heads, tokens, dim]``)."""
    meta = frame.ShardMeta(kv.shape[0], kv.shape[3] if tokens is None else tokens, kv.shape[4], kv.dtype, key.heads)
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    return frame.encode_header(key, meta, [payload]) + payload


def keys_of(tokens: list[int]) -> list[ShardKey]:
    return [ShardKey(NS.id, k.hex(), HeadRange(0, 4, 4)) for k in chunk_keys(NS, tokens, T)]


# -- item 5: a tier writer must not change what a reader gets --------------------------------------------------
def test_a_header_claiming_fewer_tokens_is_a_counted_removed_miss(tier: DictTier) -> None:
    tokens = synthetic_tokens(1, 2 * T)
    kv = synthetic_kv(tokens)
    with open_store(tier) as store:
        store.put(NS, tokens, kv)
        store.flush()
    _, second = keys_of(tokens)
    # A 1-token shard under the second chunk's key: checksums valid, shape wrong. Broadcasting it over the
    # chunk would serve KV of one token for sixteen.
    tier.objects[second] = shard_bytes(second, kv[:, :, :, T:T + 1])
    with open_store(tier) as fresh:
        assert fresh.lookup(NS, tokens) == 2 * T  # the tier lists it; only reading tells
        assert fresh.get(NS, tokens) is None
        assert second not in tier.objects  # removed
        assert fresh.stats()["mem"]["corrupt_objects_total"] == 1
        assert fresh.stats()["mem"].get("promotions_total", 0) == 1  # the good first chunk only
        assert torch.equal(fresh.get(NS, tokens[:T]), kv[:, :, :, :T])


@pytest.mark.parametrize("with_out", [True, False])
def test_a_relabelled_dtype_is_a_miss(tier: DictTier, with_out: bool) -> None:
    tokens = synthetic_tokens(2, 2 * T)
    kv = synthetic_kv(tokens)
    first, second = keys_of(tokens)
    tier.objects[first] = shard_bytes(first, kv[:, :, :, :T])
    tier.objects[second] = shard_bytes(second, kv[:, :, :, T:].view(torch.float16))  # same bytes, other dtype
    with open_store(tier) as store:
        out = torch.empty_like(kv) if with_out else None
        assert store.get(NS, tokens, out=out) is None
        assert second not in tier.objects and first in tier.objects
        assert store.stats()["mem"]["corrupt_objects_total"] == 1


def test_the_callers_buffer_fixes_the_expected_shape(tier: DictTier) -> None:
    tokens = synthetic_tokens(3, T)
    kv = synthetic_kv(tokens, layers=3)
    (key,) = keys_of(tokens)
    tier.objects[key] = shard_bytes(key, kv)
    with open_store(tier) as store:
        assert store.get(NS, tokens, out=torch.empty(2, 2, 4, T, 8, dtype=torch.bfloat16)) is None  # 3 layers
        assert key not in tier.objects


def test_a_shape_put_in_this_process_is_expected_of_tier_objects(tier: DictTier) -> None:
    tokens = synthetic_tokens(4, 2 * T)
    with open_store(tier) as store:
        store.put(NS, tokens[:T], synthetic_kv(tokens[:T]))  # 2 layers, head dim 8
        _, second = keys_of(tokens)
        tier.objects[second] = shard_bytes(second, synthetic_kv(tokens, head_dim=16)[:, :, :, T:])
        assert store.get(NS, tokens) is None
        assert second not in tier.objects


def test_header_with_zero_layers_is_a_frame_error() -> None:
    key = ShardKey(NS.id, "ab" * 16, HeadRange(0, 4, 4))
    meta = frame.ShardMeta(0, T, 8, torch.bfloat16, key.heads)
    blob = frame.encode_header(key, meta, [b""])
    with pytest.raises(frame.FrameError, match="layers"):
        frame.decode(blob, expected=key)


@pytest.mark.parametrize("exc", [KeyError("field"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
                                 RuntimeError("plugin bug"), ValueError("bad reply")])
def test_any_exception_from_a_tier_is_a_miss_not_an_outage(tier: DictTier, exc: Exception, caplog) -> None:
    tokens = synthetic_tokens(5, 2 * T)
    kv = synthetic_kv(tokens)
    with open_store(tier) as store:
        store.put(NS, tokens, kv)
        store.flush()
        store.drop_dram()
        tier.raise_on = {"heads": exc, "get": exc}
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                assert store.lookup(NS, tokens) == 0
                assert store.get(NS, tokens) is None
        assert tier.calls["heads"] >= 3  # still asked every time: a broken object is not a dead tier
        logged = [r for r in caplog.records if type(exc).__name__ in r.getMessage()]
        assert 1 <= len(logged) <= 2  # once per kind (lookup, get), not once per call
        assert store.stats()["mem"]["read_errors_total"] >= 6
        tier.raise_on = {}
        assert torch.equal(store.get(NS, tokens), kv)  # the tier serves again at once
        assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


@pytest.mark.parametrize("answer", [None, [None, None], [[]], [["0-4of4"], []], "garbage"])
def test_a_malformed_heads_answer_is_a_miss(tier: DictTier, monkeypatch, answer: object) -> None:
    tokens = synthetic_tokens(12, 2 * T)
    with open_store(tier) as store:
        monkeypatch.setattr(tier, "heads", lambda namespace, chunks: answer)
        assert store.lookup(NS, tokens) == 0 and store.get(NS, tokens) is None
        assert store.stats()["mem"]["read_errors_total"] >= 1


def test_shards_claiming_another_head_count_never_make_get_raise(tier: DictTier) -> None:
    tokens = synthetic_tokens(13, T)
    kv = synthetic_kv(tokens)
    (key,) = keys_of(tokens)
    with open_store(tier) as store:
        store.put(NS, tokens, kv)
        store.flush()
        store.drop_dram()
        odd = ShardKey(key.namespace, key.chunk, HeadRange(0, 1, 3))  # a writer claiming 3 KV heads
        tier.objects[odd] = shard_bytes(odd, kv[:, :, :1])
        for size in (1, 2, 4):
            for rank in range(size):
                got = store.get(NS, tokens, tp_rank=rank, tp_size=size)
                per = 4 // size
                assert got is not None and torch.equal(got, kv[:, :, rank * per:(rank + 1) * per])
        assert store.lookup(NS, tokens) == T


def test_a_wrong_shape_promoted_into_dram_is_dropped_then_replaced(tier: DictTier) -> None:
    tokens = synthetic_tokens(14, T)
    kv = synthetic_kv(tokens)
    (key,) = keys_of(tokens)
    tier.objects[key] = shard_bytes(key, synthetic_kv(tokens, layers=1))  # checksums fine, one layer
    with open_store(tier) as store:
        assert store.get(NS, tokens).shape[0] == 1  # nothing expected: the shard's own shape is served ...
        assert store.get(NS, tokens, out=torch.empty_like(kv)) is None  # ... never into a 2-layer buffer
        assert store.stats()["dram"]["corrupt_objects_total"] == 1
        assert store.put(NS, tokens, kv) == T  # the engine computes it again: stored, not "already held"
        out = torch.empty_like(kv)
        assert store.get(NS, tokens, out=out) is out and torch.equal(out, kv)
        store.flush()
        assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def test_an_object_error_is_a_removed_corrupt_miss(tier: DictTier) -> None:
    tokens = synthetic_tokens(6, T)
    with open_store(tier) as store:
        store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
        store.drop_dram()
        tier.raise_on = {"get": ObjectError("WRONGTYPE")}
        assert store.get(NS, tokens) is None
        assert tier.calls.get("delete") == 1
        assert store.stats()["mem"]["corrupt_objects_total"] == 1
        assert store.stats()["mem"].get("read_errors_total", 0) == 0


def test_a_tier_error_rests_the_tier(tier: DictTier) -> None:
    tokens = synthetic_tokens(7, T)
    with open_store(tier, retry_seconds=60) as store:
        store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
        store.drop_dram()
        tier.raise_on = {"heads": TierError("connection refused")}
        assert store.lookup(NS, tokens) == 0
        calls = tier.calls["heads"]
        assert store.lookup(NS, tokens) == 0 and tier.calls["heads"] == calls  # resting: not asked again


# -- items 13-15: DRAM accounting ---------------------------------------------------------------------------
def test_a_put_stops_at_the_first_chunk_that_does_not_fit(tier: DictTier, monkeypatch) -> None:
    tokens = synthetic_tokens(8, 4 * T)
    with open_store(tier) as store:
        reserve = store.dram.reserve_chunks

        def third_is_full(chunks, meta, owner=None, prefix=()):  # e.g. every page pinned then, freed just after
            assert len(chunks) == 4 and not prefix
            return [*reserve(chunks[:2], meta, owner), Refused.FULL]  # the fourth is not reserved (tests/test_dram.py)

        monkeypatch.setattr(store.dram, "reserve_chunks", third_is_full)
        assert store.put(NS, tokens, synthetic_kv(tokens)) == 2 * T
        store.flush()
        assert len(tier.objects) == 2 and len(store.dram) == 2
        assert store.stats()["dram"]["dropped_writes_total{reason=dram_full}"] == 1


def test_a_failed_promotion_copy_releases_its_reservation(tier: DictTier, monkeypatch) -> None:
    """Both ways a shard reaches DRAM from a tier: read whole and copied in (the first shard of a process, whose
    shape is not known yet), and read straight into its reserved pages (the rest). A failure in either leaves
    no reservation behind."""
    tokens = synthetic_tokens(9, 2 * T)
    kv = synthetic_kv(tokens)
    with open_store(tier) as store:
        store.put(NS, tokens, kv)
    with open_store(tier) as store:  # a new process
        real = store.dram.write_bytes
        monkeypatch.setattr(store.dram, "write_bytes", lambda entry, payload: (_ for _ in ()).throw(MemoryError()))
        with pytest.raises(MemoryError):
            store.get(NS, tokens)
        assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}
        monkeypatch.setattr(store.dram, "write_bytes", real)
        read_into, calls = tier.get_into, []

        def broken(key, header_len, payload):  # the second shard, read into its pages: the tier breaks midway
            calls.append(key)
            raise RuntimeError("connection reset midway")

        monkeypatch.setattr(tier, "get_into", broken)
        assert store.get(NS, tokens) is None and calls  # a miss, counted; the tier stays in use
        assert store.stats()[tier.name]["read_errors_total"] == len(calls)
        assert store.dram.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}
        monkeypatch.setattr(tier, "get_into", read_into)
        assert torch.equal(store.get(NS, tokens), kv)  # promoted now: nothing was left pending


# -- item 16: a slow tier pins at most queue_bytes of DRAM ---------------------------------------------------
class GateTier(DictTier):
    def __init__(self) -> None:
        super().__init__("gated")
        self.gate = threading.Event()

    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        self.gate.wait(30)
        super().put(key, parts)


def test_queued_bytes_are_bounded_per_tier() -> None:
    tier = GateTier()
    tokens = synthetic_tokens(10, 8 * T)  # 8 chunks of 4 KiB
    with open_store(tier, queue_depth=64, queue_bytes="12KiB") as store:
        store.put(NS, tokens, synthetic_kv(tokens))
        writer = store._writes.writers[0]
        assert writer.queued_bytes <= 12 * 1024
        dropped = store.stats()["gated"]["dropped_writes_total{reason=queue_full}"]
        assert dropped >= 4  # one in the stalled put, at most three queued: the rest dropped, not pinned
        assert store.dram.audit()["refs"] == 8 - dropped
        tier.gate.set()
        store.flush()
        assert store.dram.audit()["refs"] == 0 and writer.queued_bytes == 0


# -- item 11: a chunk the tier already holds is not written again ----------------------------------------------
def test_cascade_skips_objects_the_tier_holds(tier: DictTier) -> None:
    tokens = synthetic_tokens(11, 3 * T)
    kv = synthetic_kv(tokens)
    with open_store(tier) as store:
        store.put(NS, tokens, kv)
        store.flush()
        store.drop_dram()
        store.put(NS, tokens, kv)  # computed again (e.g. after a failed load): back in DRAM, already in the tier
        store.flush()
        assert tier.calls["put"] == 3
        assert store.stats()["mem"]["present_writes_total"] == 3


def test_a_failing_exists_never_stops_the_writes(tier: DictTier) -> None:
    tokens = synthetic_tokens(15, 3 * T)
    with open_store(tier, retry_seconds=60) as store:
        tier.exists = lambda key: (_ for _ in ()).throw(ObjectError("damaged marker"))  # type: ignore[method-assign]
        store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
        assert len(tier.objects) == 3  # asking failed, writing went ahead
        assert store.stats()["mem"].get("dropped_writes_total{reason=tier_unavailable}", 0) == 0


def test_put_after_close_is_an_error_not_a_leak(tier: DictTier) -> None:
    store = open_store(tier)
    store.close()
    tokens = synthetic_tokens(16, T)
    with pytest.raises(RuntimeError, match="after close"):
        store.put(NS, tokens, synthetic_kv(tokens))
    assert store.dram.audit()["refs"] == 0


def test_a_deferred_pool_is_allocated_by_its_first_put(tier: DictTier) -> None:
    cfg = load_config({"chunk_tokens": T, "dram": {"capacity_bytes": "1MiB", "page_bytes": "4KiB"}})
    with KVStore(cfg, tiers=[tier], allocate_dram=False) as store:
        tokens = synthetic_tokens(17, T)
        assert not store.dram.allocated and store.lookup(NS, tokens) == 0
        assert not store.dram.allocated  # a lookup needs only the index
        store.put(NS, tokens, synthetic_kv(tokens))
        assert store.dram.allocated and torch.equal(store.get(NS, tokens), synthetic_kv(tokens))


# -- item 17: close frees the metrics port -------------------------------------------------------------------
def test_close_stops_the_metrics_server(tier: DictTier) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = KVStore(load_config({"chunk_tokens": T, "dram": {"capacity_bytes": "1MiB"}, "metrics_port": port}),
                    tiers=[])
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    store.close()
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))  # free again


def test_a_read_after_close_pins_nothing(tier: DictTier) -> None:
    front, back = DictTier("front"), tier
    tokens = synthetic_tokens(18, T)
    (key,) = keys_of(tokens)
    back.objects[key] = shard_bytes(key, synthetic_kv(tokens))
    cfg = load_config({"chunk_tokens": T, "dram": {"capacity_bytes": "1MiB", "page_bytes": "4KiB"},
                       "tiers": [{"type": "filesystem", "name": n, "path": "/unused"} for n in ("front", "mem")]})
    store = KVStore(cfg, tiers=[front, back])
    store.close()
    assert store.get(NS, tokens) is not None  # a tier that still answers (a network client reconnects)
    assert store.dram.audit()["refs"] == 0  # the promotion's write to the front tier was refused, not pinned
    store.flush()  # returns


def test_a_promoted_shard_keeps_its_creation_time(tier: DictTier) -> None:
    front = DictTier("front")
    tokens = synthetic_tokens(19, T)
    (key,) = keys_of(tokens)
    kv = synthetic_kv(tokens)
    meta = frame.ShardMeta(2, T, 8, torch.bfloat16, key.heads)
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    tier.objects[key] = frame.encode_header(key, meta, [payload], created=1_000_000.0) + payload
    cfg = load_config({"chunk_tokens": T, "dram": {"capacity_bytes": "1MiB", "page_bytes": "4KiB"},
                       "tiers": [{"type": "filesystem", "name": n, "path": "/unused"} for n in ("front", "mem")]})
    with KVStore(cfg, tiers=[front, tier]) as store:
        assert torch.equal(store.get(NS, tokens), kv)
        store.flush()
        assert frame.decode_header(front.objects[key]).created == 1_000_000.0  # its TTL is not restarted


# -- reads from a tier across a network: asked once, read ahead, bounded ---------------------------------------
class SlowTier(DictTier):
    """A network tier whose reads take ``delay`` seconds each; records how many run at once."""

    read_ahead = True

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.running = self.most = 0
        self._lock = threading.Lock()

    def get(self, key: ShardKey) -> Buffer | None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.delay)
            return super().get(key)
        finally:
            with self._lock:
                self.running -= 1


def stored(tier: Tier, seed: int, chunks: int) -> tuple[list[int], torch.Tensor]:
    """A prompt of ``chunks`` chunks and its KV, put through a store of its own into ``tier`` (written through)."""
    tokens = synthetic_tokens(seed, chunks * T)
    kv = synthetic_kv(tokens)
    with open_store(tier, dram="16MiB") as store:
        store.put(NS, tokens, kv)
        store.flush()
    return tokens, kv


def test_a_get_from_a_network_tier_asks_once_and_reads_ahead_within_its_bound() -> None:
    from kvtier import store as store_module

    tier = SlowTier(0.2)  # long enough for the reads to meet however late a loaded machine starts each
    tokens, kv = stored(tier, 3, 8)
    with open_store(tier, dram="16MiB") as fresh:
        tier.calls.clear()
        start = time.monotonic()
        assert torch.equal(fresh.get(NS, tokens), kv)
        took = time.monotonic() - start
        assert tier.calls["heads"] == 1  # one question for all 8 chunks, not one (or three round trips) each
        assert tier.calls["get"] == 8
        assert tier.most == store_module.READ_AHEAD  # reads overlap, but never more than the bound hold buffers
        assert took < 8 * 0.2 * 0.75  # serial reads would take 1.6 s, two rounds of four 0.4 s
    del tier.objects[keys_of(tokens)[3]]  # the 4th chunk vanishes: the load stops there, reads beyond are dropped
    with open_store(tier, dram="16MiB") as fresh:
        out = torch.zeros(kv.shape[0], 2, 4, 8 * T, kv.shape[4], dtype=kv.dtype)

        def sink(first: int, got: torch.Tensor) -> None:
            for i in range(got.shape[0]):
                out[:, :, :, (first + i) * T:(first + i + 1) * T] = got[i]

        assert fresh.load(NS, tokens, sink, layers=kv.shape[0], head_dim=kv.shape[4], dtype=kv.dtype) == 3 * T
        assert torch.equal(out[:, :, :, :3 * T], kv[:, :, :, :3 * T])
        assert tier.most == store_module.READ_AHEAD
    inline = SlowTier(0.01)
    inline.read_ahead = False  # e.g. Redis: one read at a time, on the caller's thread
    stored(inline, 3, 8)
    with open_store(inline, dram="16MiB") as fresh:
        inline.calls.clear()
        assert torch.equal(fresh.get(NS, tokens), kv)
        assert inline.calls["heads"] == 1 and inline.calls["get"] == 8 and inline.most == 1


def test_reads_ahead_go_straight_into_dram_and_a_miss_leaves_nothing_reserved() -> None:
    """With the shape known, each read ahead fills a DRAM entry reserved for it, on a reading thread; a load that
    stops at a missing chunk leaves the entries read ahead beyond it to be aborted as their reads end (their
    pages are written until then; the load does not wait): none is left reserved, and a later put stores them."""
    tier = SlowTier(0.02)
    tokens, kv = stored(tier, 6, 8)
    readers: dict[ShardKey, str] = {}
    plain_get_into = tier.get_into

    def get_into(key: ShardKey, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
        readers[key] = threading.current_thread().name
        return plain_get_into(key, header_len, payload)

    tier.get_into = get_into  # type: ignore[method-assign]
    del tier.objects[keys_of(tokens)[5]]
    shape = {"layers": kv.shape[0], "head_dim": kv.shape[4], "dtype": kv.dtype}
    with open_store(tier, dram="16MiB") as fresh:
        loaded: list[torch.Tensor] = []
        assert fresh.load(NS, tokens, lambda first, got: loaded.append(got.clone()), **shape) == 5 * T
        assert torch.equal(torch.cat(loaded).permute(1, 2, 3, 0, 4, 5).flatten(3, 4), kv[:, :, :, :5 * T])
        assert fresh.held(NS, tokens, kv_heads=4) == 5 * T
        assert settled(fresh) == CLEAN_AUDIT  # the load did not wait for them: aborted as each read ends
        # chunks 0-4 read into DRAM pages, none on the caller's thread; 6 and 7 read ahead of the miss at 5 unless
        # cancelled before they ran
        keys = keys_of(tokens)
        assert set(keys[:5]) <= set(readers) <= set(keys) - {keys[5]}, readers
        assert all(name.startswith("kvtier-read") for name in readers.values()), readers
        fresh.put(NS, tokens, kv)
        assert fresh.held(NS, tokens, kv_heads=4) == 8 * T  # 6 and 7 were not left reserved ("present")
        tier.objects.clear()
        assert torch.equal(fresh.get(NS, tokens), kv)


def test_reads_ahead_of_a_failed_read_are_not_waited_for_and_leave_nothing_reserved() -> None:
    """A tier read failing mid-load rests the tier: the reads already started beyond it are not waited for, and
    their entries are aborted as each ends."""
    tier = SlowTier(1.0)
    tokens, kv = stored(tier, 7, 8)
    failing = keys_of(tokens)[2]
    plain_get = tier.get

    def get(key: ShardKey) -> Buffer | None:
        if key == failing:
            time.sleep(0.05)
            raise TierError("mem: the server went away")
        return plain_get(key)

    tier.get = get  # type: ignore[method-assign]
    shape = {"layers": kv.shape[0], "head_dim": kv.shape[4], "dtype": kv.dtype}
    with open_store(tier, dram="16MiB", retry_seconds=60) as fresh:
        start = time.monotonic()
        assert fresh.load(NS, tokens, lambda first, got: None, **shape) == 2 * T
        # chunks 0 and 1 are read together (1 s), then 2 (fails at 1.05 s) and 3 (ends at 2 s): the load ends at
        # the failure, not waiting for 3
        assert time.monotonic() - start < 1.05 + 0.5
        assert settled(fresh) == CLEAN_AUDIT
        assert fresh.held(NS, tokens, kv_heads=4) == 2 * T  # what was read beyond the failure was not kept


def test_read_ahead_holds_at_most_its_bound_of_fetched_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads that finish faster than the store takes them do not pile up: at most READ_AHEAD started and not
    yet taken (their bytes held), however long the prompt."""
    from kvtier import store as store_module

    tier = SlowTier(0.0)
    tokens, kv = stored(tier, 4, 16)
    held: list[int] = []
    real = Prefetch.read_ahead

    def watched(self: Prefetch, read: object) -> None:
        real(self, read)
        time.sleep(0.002)  # the reads run ahead meanwhile
        held.append(len(read.started))  # type: ignore[attr-defined]

    monkeypatch.setattr(Prefetch, "read_ahead", watched)
    with open_store(tier, dram="16MiB") as fresh:
        assert torch.equal(fresh.get(NS, tokens), kv)
    assert held and max(held) == store_module.READ_AHEAD


class BatchTier(SlowTier):
    """A network tier that reads in batches (Mooncake's batch get): each get_into_many takes ``delay`` seconds;
    records each batch's size and thread. ``answers`` replaces the answer for a key (an exception, say)."""

    read_ahead = False
    batch_reads = True

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.batches: list[tuple[int, str]] = []
        self.answers: dict[ShardKey, Exception] = {}
        # When set, every batch but the one reading ``first`` (a load's first chunk) waits for it. Which batch's
        # reading thread gets here first is the threads' race: a batch is picked by what it reads.
        self.gate: threading.Event | None = None
        self.first: ShardKey | None = None

    def get_into_many(self, reads: Sequence[tuple[ShardKey, int, Sequence[memoryview]]]) \
            -> list[bytes | Exception | None]:
        self.batches.append((len(reads), threading.current_thread().name))
        self._enter("get_into_many")
        if self.gate is not None and all(key != self.first for key, _, _ in reads):
            assert self.gate.wait(10)
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.delay)
        with self._lock:
            self.running -= 1
        out: list[bytes | Exception | None] = []
        for key, header_len, payload in reads:
            blob = self.objects.get(key)
            out.append(self.answers.get(key) or (None if blob is None else self._split(key, blob, header_len,
                                                                                        payload)))
        return out


def test_a_tier_that_batches_reads_gets_a_loads_shards_in_batches_straight_into_dram() -> None:
    """20 chunks from a batching tier: every shard read by a batch on a reading thread (none alone, none on the
    caller's), at most _BATCH a batch, the batches overlapping, the KV exact. A miss in a batch ends the load
    there; a corrupt answer is counted and removed; a batch that raises a tier error rests the tier. Nothing is
    left reserved."""

    tier = BatchTier(0.2)  # long enough for the batches to meet however late a loaded machine starts each
    tokens, kv = stored(tier, 8, 20)
    shape = {"layers": kv.shape[0], "head_dim": kv.shape[4], "dtype": kv.dtype}
    with open_store(tier, dram="16MiB") as fresh:
        tier.calls.clear()
        loaded: list[torch.Tensor] = []
        assert fresh.load(NS, tokens, lambda first, got: loaded.append(got.clone()), **shape) == 20 * T
        assert torch.equal(torch.cat(loaded).permute(1, 2, 3, 0, 4, 5).flatten(3, 4), kv)
        assert sum(n for n, _ in tier.batches) == 20 and max(n for n, _ in tier.batches) == prefetch._BATCH
        assert all(name.startswith("kvtier-read") for _, name in tier.batches), tier.batches
        assert "get" not in tier.calls and tier.calls["heads"] == 1
        assert tier.most >= 2  # batches overlap (they were not read one after another)
        assert settled(fresh) == CLEAN_AUDIT
    keys = keys_of(tokens)
    tier.objects.pop(keys[6])
    tier.answers[keys[2]] = ObjectError("mem: not what was stored")
    with open_store(tier, dram="16MiB") as fresh:
        assert fresh.load(NS, tokens, lambda first, got: None, **shape) == 2 * T
        assert fresh.stats()["mem"]["corrupt_objects_total"] == 1 and keys[2] not in tier.objects
        assert settled(fresh) == CLEAN_AUDIT
        assert fresh.held(NS, tokens, kv_heads=4) == 2 * T
    tier.answers.clear()
    tier.raise_on["get_into_many"] = TierError("mem: the server went away")
    with open_store(tier, dram="16MiB", retry_seconds=60) as fresh:
        assert fresh.load(NS, tokens, lambda first, got: None, **shape) == 0
        assert fresh.stats()["mem"]["read_errors_total"] >= 1
        tier.raise_on.clear()
        tier.calls.clear()
        assert fresh.load(NS, tokens, lambda first, got: None, **shape) == 0  # resting: not asked
        assert "get_into_many" not in tier.calls
        assert settled(fresh) == CLEAN_AUDIT


def test_a_batch_still_reading_keeps_its_entries_reserved_after_the_load_gave_up() -> None:
    """The load stops at a corrupt shard in the first batch while the second still writes into its entries:
    those stay reserved (their pages cannot go to anyone) until the batch ends, then are aborted."""
    tier = BatchTier(0.0)
    tokens, kv = stored(tier, 9, 8)
    tier.answers[keys_of(tokens)[1]] = ObjectError("mem: not what was stored")
    tier.gate, tier.first = threading.Event(), keys_of(tokens)[0]
    with open_store(tier, dram="16MiB") as fresh:
        assert fresh.load(NS, tokens, lambda first, got: None, layers=kv.shape[0], head_dim=kv.shape[4],
                          dtype=kv.dtype) == T
        deadline = time.monotonic() + 5  # the first batch's reader hands its last answers over just after
        while fresh.dram.audit()["pending"] > 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fresh.dram.audit()["pending"] == 4  # chunks 4-7, still being written
        tier.gate.set()
        assert settled(fresh) == CLEAN_AUDIT
        assert fresh.held(NS, tokens, kv_heads=4) == T


def test_close_leaves_a_tier_open_while_a_batched_read_is_still_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch stuck in the tier (native code writing into DRAM pages, for Mooncake) when the store closes: close
    waits its bound, then leaves that tier open rather than closing it under the read; a tier with no read in
    it is closed."""

    monkeypatch.setattr(prefetch, "CLOSE_WAIT", 0.2)
    tier = BatchTier(0.0)
    tokens, kv = stored(tier, 14, 8)
    tier.gate, tier.first = threading.Event(), keys_of(tokens)[0]
    closed: list[str] = []
    monkeypatch.setattr(tier, "close", lambda: closed.append("closed"))
    fresh = open_store(tier, dram="16MiB")
    loader = threading.Thread(target=fresh.load, args=(NS, tokens, lambda first, got: None),
                              kwargs={"layers": kv.shape[0], "head_dim": kv.shape[4], "dtype": kv.dtype})
    loader.start()
    deadline = time.monotonic() + 5
    while len(tier.batches) < 2:  # the second batch waits at the gate
        assert time.monotonic() < deadline
        time.sleep(0.01)
    start = time.monotonic()
    fresh.close()
    assert 0.2 <= time.monotonic() - start < 2 and closed == []
    tier.gate.set()
    loader.join(5)
    assert not loader.is_alive()
    idle = BatchTier(0.0)
    monkeypatch.setattr(idle, "close", lambda: closed.append("idle closed"))
    open_store(idle).close()
    assert closed == ["idle closed"]


@pytest.mark.parametrize("one_call", [True, False])
def test_tails_are_asked_about_with_the_chunks_and_a_miss_costs_one_question(one_call: bool) -> None:
    """A network tier holding a prompt's 3 chunks and its tail (blocks of 4). One that answers any number of keys
    in one round trip is asked about the tails with the chunks: one question finds them all. One that pays per
    key (S3) is asked about tails only once chunks were found. A miss is one question either way; a prompt
    diverging in its third chunk gets a second question, for the tails after its second."""
    tier = DictTier()
    tier.heads_in_one_call = one_call
    tokens = synthetic_tokens(50, 3 * T + 8)
    kv = synthetic_kv(tokens)
    with open_store(tier, dram="16MiB") as writer:
        source = lambda first, dst: dst.copy_(  # noqa: E731
            torch.nn.functional.pad(kv, (0, 0, 0, 4 * T - kv.shape[3]))[:, :, :, first * T:(first + dst.shape[0]) * T]
            .unflatten(3, (dst.shape[0], T)).permute(3, 0, 1, 2, 4, 5))
        assert writer.put_from(NS, tokens, source, layers=kv.shape[0], head_dim=kv.shape[4], dtype=kv.dtype,
                               kv_heads=4, tail=True) == 3 * T + 8
        writer.flush()
    with open_store(tier, dram="16MiB") as fresh:
        tier.asked.clear()
        assert fresh.lookup(NS, tokens + [1, 2], tail_block=4) == 3 * T + 8
        assert tier.asked == ([3 + 2] if one_call else [3, 2])  # 3 chunks, tails of 8 and 4 tokens
        tier.asked.clear()
        assert fresh.lookup(NS, synthetic_tokens(51, 3 * T + 8), tail_block=4) == 0
        assert tier.asked == ([3 + 2] if one_call else [3])
        tier.asked.clear()
        assert fresh.lookup(NS, tokens[:2 * T] + synthetic_tokens(52, T + 8), tail_block=4) == 2 * T
        assert tier.asked == ([3 + 2, 3] if one_call else [3, 3])  # then the tails after the 2nd: 12, 8, 4


def test_reads_ahead_never_evict_the_chunks_the_same_read_holds_in_dram() -> None:
    """DRAM full, a load's first 2 chunks its oldest entries (held nowhere else), its other 4 in a network tier:
    the DRAM entries its reads ahead reserve evict other prompts' chunks, never its own first two."""
    tier = BatchTier(0.0)
    tokens, kv = stored(tier, 12, 6)
    keys = keys_of(tokens)
    shape = {"layers": kv.shape[0], "head_dim": kv.shape[4], "dtype": kv.dtype}
    with open_store(tier, dram="24KiB") as fresh:  # 6 chunks of 4 KiB
        assert fresh.load(NS, tokens[:2 * T], lambda first, got: None, **shape) == 2 * T  # now in DRAM
        del tier.objects[keys[0]], tier.objects[keys[1]]  # and nowhere else
        other = synthetic_tokens(13, 4 * T)
        fresh.put(NS, other, synthetic_kv(other))  # DRAM full, its entries more recently used
        fresh.flush()
        loaded: list[torch.Tensor] = []
        assert fresh.load(NS, tokens, lambda first, got: loaded.append(got.clone()), **shape) == 6 * T
        assert torch.equal(torch.cat(loaded).permute(1, 2, 3, 0, 4, 5).flatten(3, 4), kv)
        assert settled(fresh) == CLEAN_AUDIT


def test_a_tier_that_said_it_lacks_a_shard_is_not_asked_for_it_and_local_only_reads_skip_remote_tiers() -> None:
    front, back = DictTier("front"), DictTier("back")
    tokens = synthetic_tokens(5, 2 * T)
    kv = synthetic_kv(tokens)
    cfg = load_config({"chunk_tokens": T, "dram": {"capacity_bytes": "8MiB", "page_bytes": "4KiB"},
                       "tiers": [{"type": "filesystem", "name": n, "path": "/unused"} for n in ("front", "back")]})
    with KVStore(cfg, tiers=[front, back]) as store:
        store.put(NS, tokens, kv)
        store.flush()
    front.objects.clear()  # only the back tier holds the chunks now
    with KVStore(cfg, tiers=[front, back]) as fresh:
        front.calls.clear()
        back.calls.clear()
        assert torch.equal(fresh.get(NS, tokens), kv)
        assert "get" not in front.calls  # it answered "none" to the one batched question; never asked again
        assert back.calls == {"heads": 1, "get": 2}
    assert len(front.objects) == 2  # what was read from the back tier was also written to the front one
    front.objects.clear()
    front.local = True  # e.g. a local disk in front of Redis: a load that must not wait on a network
    with KVStore(cfg, tiers=[front, back]) as fresh:
        back.calls.clear()
        out: list[int] = []
        assert fresh.load(NS, tokens, lambda first, got: out.append(first), layers=kv.shape[0],
                          head_dim=kv.shape[4], dtype=kv.dtype, local_only=True) == 0
        assert not out and back.calls == {}  # a miss, never a call to the remote tier
