from __future__ import annotations

import pytest
import torch

from kvtier.dram import DramEntry, DramPool, Refused, _FreePages
from kvtier.eviction import LRUPolicy, PrefixLRUPolicy
from kvtier.frame import ShardMeta
from kvtier.keys import HeadRange, ShardKey

PAGE = 4096
META = ShardMeta(num_layers=2, chunk_tokens=16, head_dim=16, dtype=torch.bfloat16, heads=HeadRange(0, 4, 4))  # 8 KiB


def skey(i: int) -> ShardKey:
    return ShardKey("0" * 32, f"{i:032x}", HeadRange(0, 4, 4))


def write(pool: DramPool, entry: DramEntry, shard: torch.Tensor) -> None:
    pool.fill_chunks(lambda first, dst: dst.copy_(shard.unsqueeze(0)), [(0, entry)], shard.device)


def put(pool: DramPool, i: int, parent: int | None = None, fill: float | None = None) -> DramEntry:
    entry = pool.reserve(skey(i), META, None if parent is None else skey(parent).chunk)
    assert isinstance(entry, DramEntry)
    write(pool, entry, torch.full(META.shape, float(i if fill is None else fill), dtype=META.dtype))
    pool.commit(entry)
    return entry


def resident(pool: DramPool) -> set[int]:
    return {int(k.chunk, 16) for k in pool._by_key}


def test_shards_live_inside_the_preallocated_arena() -> None:
    pool = DramPool(16 * PAGE, PAGE, LRUPolicy())
    arena = pool._arena.untyped_storage().data_ptr()
    for i in range(30):  # far more than fit: evicts and reuses pages
        entry = put(pool, i)
        view = pool.tensor(entry)
        assert view.untyped_storage().data_ptr() == arena  # a view of the arena, no new allocation
        assert torch.equal(view, torch.full(META.shape, float(i), dtype=META.dtype))
        assert pool.used_bytes <= pool.capacity_bytes
    assert len(pool) == 8


def test_lru_evicts_least_recently_used() -> None:
    pool = DramPool(6 * PAGE, PAGE, LRUPolicy())  # three 2-page shards
    for i in range(3):
        put(pool, i)
    pool.release(pool.acquire(skey(0).namespace, skey(0).chunk, [skey(0).heads])[0])  # use 0
    put(pool, 3)
    assert resident(pool) == {0, 2, 3}


def test_prefix_policy_evicts_descendants_first() -> None:
    pool = DramPool(8 * PAGE, PAGE, PrefixLRUPolicy())  # four shards
    put(pool, 0)
    put(pool, 1, parent=0)
    put(pool, 2, parent=1)
    put(pool, 10)
    pool.release(pool.acquire(skey(2).namespace, skey(2).chunk, [skey(2).heads])[0])  # the tail is fresh
    # 0 is the least recently used, but 0 and 1 have resident children; of the leaves 2 and 10, 10 is older.
    put(pool, 11, parent=10)
    assert resident(pool) == {0, 1, 2, 11}
    put(pool, 12)  # leaves now 2 and 11: 2 is older
    assert resident(pool) == {0, 1, 11, 12}


def test_pinned_entries_are_never_evicted() -> None:
    pool = DramPool(4 * PAGE, PAGE, LRUPolicy())  # two shards
    a = put(pool, 0)
    put(pool, 1)
    pinned = pool.acquire(a.key.namespace, a.key.chunk, [a.key.heads])
    put(pool, 2)
    assert resident(pool) == {0, 2}
    pool.acquire(skey(2).namespace, skey(2).chunk, [skey(2).heads])
    assert pool.reserve(skey(3), META, None) == "full"  # everything is in use
    pool.release(pinned[0])
    put(pool, 3)
    assert resident(pool) == {2, 3}


def test_a_refusal_is_its_name_as_a_string() -> None:
    # a str mixin (StrEnum is 3.11's): equal to, printed and formatted as the old sentinels, on every Python
    assert Refused.FULL == "full" and Refused.PRESENT == "present"
    assert str(Refused.FULL) == f"{Refused.FULL}" == "full"
    assert isinstance(Refused.PRESENT, str)


def test_reserved_entries_are_invisible_until_commit_and_abort_frees() -> None:
    pool = DramPool(4 * PAGE, PAGE, LRUPolicy())
    entry = pool.reserve(skey(0), META, None)
    assert isinstance(entry, DramEntry)
    assert pool.ranges(skey(0).namespace, skey(0).chunk) == []
    assert pool.reserve(skey(0), META, None) == "present"
    pool.abort(entry)
    assert pool.used_bytes == 0
    put(pool, 0)
    assert pool.ranges(skey(0).namespace, skey(0).chunk) == [HeadRange(0, 4, 4)]


def test_fragmented_pages_still_round_trip() -> None:
    pool = DramPool(7 * PAGE, PAGE, LRUPolicy())
    small = ShardMeta(2, 16, 8, torch.bfloat16, HeadRange(0, 2, 2))  # 2 KiB: one page
    entries = []
    for i in range(7):
        e = pool.reserve(skey(i), small, None)
        assert isinstance(e, DramEntry)
        write(pool, e, torch.full(small.shape, float(i), dtype=small.dtype))
        pool.commit(e)
        entries.append(e)
    for i in (0, 2, 4, 6):  # free every other page
        pool.release(pool.acquire(skey(i).namespace, skey(i).chunk, [skey(i).heads])[0])
    pool._lock.acquire()
    for i in (0, 2, 4):
        pool._evict(entries[i])
    pool._lock.release()
    data = torch.arange(META.nbytes // 2, dtype=torch.bfloat16).view(META.shape)  # 2 pages, none adjacent
    e = pool.reserve(skey(99), META, None)
    assert isinstance(e, DramEntry) and len(e.extents) == 2
    write(pool, e, data)
    pool.commit(e)
    assert torch.equal(pool.tensor(e), data)
    assert bytes(b"".join(bytes(v) for v in pool.views(e))) == data.view(torch.uint8).numpy().tobytes()


def test_free_pages_coalesce() -> None:
    free = _FreePages(10)
    a, b, c = free.take(3), free.take(3), free.take(4)
    assert free.take(1) is None
    free.give(b)
    free.give(a)
    free.give(c)
    assert free.take(10) == [(0, 10)]


def test_consecutive_and_scattered_chunks_land_in_their_entries() -> None:
    pool = DramPool(40 * PAGE, PAGE, LRUPolicy())
    kv = torch.arange(2 * 2 * 4 * 16 * 16 * 8, dtype=torch.float32).to(torch.bfloat16).view(2, 2, 4, 16 * 8, 16)
    holes = [pool.reserve(skey(100 + i), META, None) for i in range(3)]  # 2 pages each, pages 0-5
    entries = []
    for i in range(8):
        if i == 3:  # free a hole so chunk 3 lands before the others: runs break around it
            pool.abort(holes[1])
        e = pool.reserve(skey(i), META, None)
        assert isinstance(e, DramEntry)
        entries.append((i, e))
    assert len(pool.runs(entries, torch.device("cpu"))) >= 2
    def fill(first: int, dst: torch.Tensor) -> None:
        dst.copy_(kv[:, :, :, first * 16:(first + dst.shape[0]) * 16].unflatten(3, (dst.shape[0], 16))
                  .permute(3, 0, 1, 2, 4, 5))

    pool.fill_chunks(fill, [entries[j] for j in (0, 1, 2, 3, 5, 6, 7)], torch.device("cpu"))  # chunk 4 skipped
    for i, e in entries:
        if i != 4:
            pool.commit(e)
            assert torch.equal(pool.tensor(e), kv[:, :, :, i * 16:(i + 1) * 16]), i


def test_a_reservation_that_cannot_fit_evicts_nothing() -> None:
    pool = DramPool(8 * PAGE, PAGE, LRUPolicy())  # four 2-page shards
    for i in range(4):
        put(pool, i)
    busy = pool.acquire(skey(0).namespace, skey(0).chunk, [skey(0).heads])  # pinned: 2 pages cannot be freed
    big = ShardMeta(num_layers=7, chunk_tokens=16, head_dim=16, dtype=torch.bfloat16, heads=HeadRange(0, 4, 4))
    assert pool.reserve(skey(9), big, None) == "full"  # needs 7 pages; only 6 could be freed
    assert resident(pool) == {0, 1, 2, 3}  # nothing was evicted for a reservation that fails anyway
    assert pool.audit()["idle_mismatch"] == 0
    pool.release(busy[0])
    entry = pool.reserve(skey(9), big, None)  # with 0 idle again, 8 pages can be freed
    assert isinstance(entry, DramEntry)
    pool.abort(entry)
    assert pool.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def test_each_watcher_reads_the_changes_since_it_began() -> None:
    pool = DramPool(4 * PAGE, PAGE, LRUPolicy())  # two shards
    put(pool, 0)
    first = pool.watch()
    put(pool, 1)
    second = pool.watch()  # each reader sees what happened since it began, whatever the other took
    put(pool, 2)  # evicts 0
    pool.discard(pool.acquire(skey(1).namespace, skey(1).chunk, [skey(1).heads])[0])
    assert pool.take_changes(first) == [(skey(1), True), (skey(0), False), (skey(2), True), (skey(1), False)]
    assert pool.take_changes(first) == []
    assert pool.take_changes(second) == [(skey(0), False), (skey(2), True), (skey(1), False)]


def test_a_put_of_many_chunks_takes_consecutive_pages_after_evicting() -> None:
    """Evicting an old prefix leaf first frees its pages back to front; reserved together, the new chunks still
    get one run of pages (one copy for the whole put), where chunk-by-chunk reservations got one run each."""
    pool = DramPool(8 * PAGE, PAGE, PrefixLRUPolicy())  # four 2-page shards
    for i in range(4):
        put(pool, i, parent=i - 1 if i else None)
    got = pool.reserve_chunks([(skey(10 + i), skey(9 + i).chunk if i else None) for i in range(3)], META)
    entries = [e for e in got if isinstance(e, DramEntry)]
    assert len(entries) == 3 and resident(pool) == {0}
    assert len(pool.runs(list(enumerate(entries)), torch.device("cpu"))) == 1
    for e in entries:
        pool.abort(e)
    assert pool.audit()["lost_pages"] == 0


def test_a_held_child_does_not_keep_its_missing_parent_out() -> None:
    """Chunk 1 is held but its parent 0 is not (LRU evicted it): storing 0 may evict 1, as storing chunk by chunk
    would, rather than refusing the prefix to keep a chunk no lookup reaches without it."""
    pool = DramPool(4 * PAGE, PAGE, LRUPolicy())
    put(pool, 1, parent=0)
    busy = put(pool, 7)
    pool.acquire(busy.key.namespace, busy.key.chunk, [busy.key.heads])
    got = pool.reserve_chunks([(skey(0), None), (skey(1), skey(0).chunk)], META)
    assert isinstance(got[0], DramEntry) and got[1:] == ["full"]
    pool.abort(got[0])  # type: ignore[arg-type]
    pool.release(busy)
    assert pool.audit()["lost_pages"] == 0


@pytest.mark.parametrize("given", ["held", "prefix"])
def test_a_put_never_evicts_its_own_prefix(given: str) -> None:
    """Chunks 0 and 1 are the prompt's prefix (found held by this put, or named as the ``prefix`` of a put from an
    offset, as the vLLM connector stores); chunk 7 is being read. Room for chunk 3 could come only from evicting
    0 (the least recently used): that would leave 2 and 3 stored and never found, so the put stops there."""
    pool = DramPool(8 * PAGE, PAGE, LRUPolicy())  # four 2-page shards
    put(pool, 0)
    put(pool, 1, parent=0)
    busy = put(pool, 7)
    put(pool, 8)
    pool.acquire(busy.key.namespace, busy.key.chunk, [busy.key.heads])
    chain = [(skey(i), skey(i - 1).chunk if i else None) for i in range(4)]
    if given == "held":
        got = pool.reserve_chunks(chain, META)
        assert got[:2] == ["present", "present"]
    else:
        got = [Refused.PRESENT, Refused.PRESENT,
               *pool.reserve_chunks(chain[2:], META, prefix=[skey(0), skey(1)])]
    assert isinstance(got[2], DramEntry) and got[3:] == ["full"]  # 2 took 8's pages; 3 found no room
    assert resident(pool) == {0, 1, 7}
    pool.abort(got[2])  # type: ignore[arg-type]
    pool.release(busy)
    assert pool.audit()["lost_pages"] == 0


def test_a_key_listed_twice_is_reserved_once() -> None:
    pool = DramPool(8 * PAGE, PAGE, LRUPolicy())
    got = pool.reserve_chunks([(skey(1), None), (skey(1), None)], META)
    assert isinstance(got[0], DramEntry) and got[1] == "present"
    pool.commit(got[0])  # type: ignore[arg-type]
    assert pool.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def test_an_empty_reservation_allocates_nothing() -> None:
    pool = DramPool(8 * PAGE, PAGE, LRUPolicy(), allocate=False)
    assert pool.reserve_chunks([], META) == [] and not pool.allocated


def test_reserving_chunks_stops_at_the_first_that_cannot_fit() -> None:
    pool = DramPool(6 * PAGE, PAGE, LRUPolicy())
    busy = put(pool, 0)
    pool.acquire(skey(0).namespace, skey(0).chunk, [skey(0).heads])  # pinned: 4 pages can be had
    got = pool.reserve_chunks([(skey(i), None) for i in (0, 1, 2, 3, 4)], META)
    assert got[0] == "present" and isinstance(got[1], DramEntry) and isinstance(got[2], DramEntry)
    assert got[3:] == ["full"]  # chunk 3 does not fit; chunk 4 is not even tried
    for e in got[1:3]:
        pool.abort(e)  # type: ignore[arg-type]
    pool.release(busy)
    assert pool.audit()["lost_pages"] == 0


def test_an_entry_is_served_only_under_its_owner_and_before_its_expiry() -> None:
    """An entry stored under one owner (a tenant key id) is not served under another or none, nor once past its
    expiry: each is discarded when found, and a put of the same key under the right owner replaces it."""
    pool = DramPool(8 * PAGE, PAGE, LRUPolicy())
    key = skey(1)
    for owner, ask, expires in [(b"k1", b"k2", None), (b"k1", None, None), (None, None, 0.0)]:
        entry = pool.reserve(key, META, None, owner)
        assert isinstance(entry, DramEntry)
        entry.expires = expires
        pool.commit(entry)
        assert pool.acquire(key.namespace, key.chunk, [key.heads], ask) is None
        assert pool.ranges(key.namespace, key.chunk) == [] and len(pool) == 0
    stale = pool.reserve(key, META, None, b"k1")
    pool.commit(stale)
    fresh = pool.reserve(key, META, None, b"k2")  # the owner's put replaces what it may not be served
    assert isinstance(fresh, DramEntry)
    pool.commit(fresh)
    (got,) = pool.acquire(key.namespace, key.chunk, [key.heads], b"k2")
    assert got is fresh
    pool.release(got)
    assert pool.discard_owned({b"k2"}) == 1 and len(pool) == 0
    assert pool.audit() == {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def test_the_start_touches_headroom_after_the_pool_within_what_is_available(monkeypatch) -> None:
    import kvtier.dram as dram

    mib = 2**20
    monkeypatch.setattr(dram, "available_memory", lambda: 300 * mib)
    assert dram.warm_headroom(2**30) == 300 * mib - dram.HEADROOM_SPARE  # never near the OOM killer
    monkeypatch.setattr(dram, "available_memory", lambda: 100 * mib)
    assert dram.warm_headroom(2**30) == 0
    monkeypatch.setattr(dram, "available_memory", lambda: None)  # not known: as asked
    assert dram.warm_headroom(8 * mib) == 8 * mib
    touched: list[int] = []
    monkeypatch.setattr(dram, "warm_headroom", touched.append)
    pool = DramPool(16 * PAGE, PAGE, LRUPolicy(), headroom_bytes=2**30, allocate=False)
    assert touched == []  # nothing before the pool is allocated
    pool.allocate()
    pool.allocate()  # idempotent: the headroom is touched once
    assert touched == [16 * PAGE]  # at most the pool's size
    DramPool(16 * PAGE, PAGE, LRUPolicy())
    assert touched == [16 * PAGE, 0]
    assert DramPool(16 * PAGE, PAGE, LRUPolicy(), pin_memory=True, headroom_bytes=2**30,
                    allocate=False)._headroom == 0  # a GPU host's engine computes in GPU memory


def test_headroom_the_os_refuses_is_skipped_not_a_failed_start(monkeypatch, caplog) -> None:
    import kvtier.dram as dram

    def refused(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("cannot allocate memory")

    monkeypatch.setattr(dram, "available_memory", lambda: None)
    monkeypatch.setattr(dram.torch, "empty", refused)
    assert dram.warm_headroom(2**20) == 0
    assert "headroom of 1048576 bytes could not be touched" in caplog.text
