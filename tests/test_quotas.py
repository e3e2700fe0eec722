"""Per-tenant quotas: a tenant past its share of DRAM or of a disk evicts its own least recently used chunks (an
isolated LRU), never another tenant's; a rule is one share, however many salts it matches; on disk a share is the
directory's (every process and thread counts it together) and a reservation against the capacity; quotas on tiers
that cannot keep them are refused naming the field."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import KVStore, Namespace, frame
from kvtier.config import load_config
from kvtier.errors import ConfigError, QuotaFull, TierError
from kvtier.keys import HeadRange, ShardKey, chunk_keys
from kvtier.store import open_tiers
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.testing.tiers import NS_A, NS_B, key as tier_key
from kvtier.tiers import _redis_shares, _shares as tier_shares
from kvtier.tiers._filesystem import FilesystemOptions, FilesystemTier

T = 16
PAGE = 16 * 2**10


def chunk_bytes() -> int:
    """What one chunk takes in DRAM: its payload in whole pages."""
    return -(-payload_bytes() // PAGE) * PAGE


def payload_bytes() -> int:
    kv = synthetic_kv(synthetic_tokens(0, T))
    return kv.numel() * kv.element_size()


def config(tmp_path: Path | None, quota: dict, tiers: list[str] = ()) -> dict:
    cfg: dict = {"chunk_tokens": T, "dram": {"capacity_bytes": "16MiB", "page_bytes": PAGE},
                 "placement": [{"salt": "team-*", "tiers": list(tiers), "quota": quota}, {"tiers": list(tiers)}]}
    if tiers:
        cfg["tiers"] = [{"type": "filesystem", "name": name, "path": str(tmp_path / name), "queue_depth": 4096}
                        for name in tiers]
    return cfg


def ns(salt: str | None) -> Namespace:
    return Namespace(model="m", dtype="bfloat16", cache_salt=salt)


@pytest.fixture
def age(monkeypatch: pytest.MonkeyPatch):
    """Tiers never evict a share's objects used in the last RECENT_SECONDS (a prompt's own chunks): shortened
    here, and ``age()`` lets everything stored so far grow older than that."""
    monkeypatch.setattr(tier_shares, "RECENT_SECONDS", 0.3)
    return lambda: time.sleep(0.35)


def test_a_tenant_past_its_dram_share_evicts_its_own_chunks_only() -> None:
    prompts = {name: synthetic_tokens(i, 3 * T) for i, name in enumerate(("a1", "a2", "pub", "b1"))}
    kvs = {name: synthetic_kv(p) for name, p in prompts.items()}
    cfg = config(None, {"dram": 3 * chunk_bytes()})
    cfg["placement"][:1] = [{"salt": salt, "tiers": [], "quota": {"dram": 3 * chunk_bytes()}}
                            for salt in ("team-a", "team-b", "team-*")]  # a rule, and so a share, per tenant
    with KVStore.from_config(cfg) as store:
        store.put(ns("public"), prompts["pub"], kvs["pub"])
        assert store.put(ns("team-a"), prompts["a1"], kvs["a1"]) == 3 * T
        assert store.put(ns("team-a"), prompts["a2"], kvs["a2"]) == 3 * T  # past its share: a1 goes
        assert store.put(ns("team-b"), prompts["b1"], kvs["b1"]) == 3 * T  # a share of its own
        assert store.get(ns("team-a"), prompts["a1"]) is None
        for tenant, name in (("team-a", "a2"), ("public", "pub"), ("team-b", "b1")):
            assert torch.equal(store.get(ns(tenant), prompts[name]), kvs[name]), name
        assert store.stats()["dram"]["evictions_total"] == 3  # a1's three chunks, nothing of anyone else
        big = synthetic_tokens(9, 5 * T)
        assert store.put(ns("team-c"), big, synthetic_kv(big)) == 3 * T  # the leading chunks that fit its share


def test_a_tenant_past_its_disk_share_evicts_its_own_files_only(tmp_path: Path, age) -> None:
    prompts = [synthetic_tokens(10 + i, 2 * T) for i in range(3)]
    with KVStore.from_config(config(tmp_path, {"disk": 4 * (payload_bytes() + frame.HEADER_LEN) + 100},
                                    ["disk"])) as store:
        store.put(ns("public"), prompts[0], synthetic_kv(prompts[0]))
        for p in prompts:
            store.put(ns("team-a"), p, synthetic_kv(p))
            store.flush()
            age()
        disk = store.tiers[0]
        held = {n.id: sum(1 for _ in disk.list(n.id)) for n in (ns("public"), ns("team-a"))}
        assert held == {ns("public").id: 2, ns("team-a").id: 4}  # team-a's first prompt went, public's stayed
        assert disk.counters()["share_evictions"] == 2
        store.drop_dram()
        assert store.get(ns("team-a"), prompts[0]) is None
        assert torch.equal(store.get(ns("team-a"), prompts[2]), synthetic_kv(prompts[2]))
        assert torch.equal(store.get(ns("public"), prompts[0]), synthetic_kv(prompts[0]))


@pytest.mark.parametrize("placement, message", [
    ([{"salt": "t-*", "tiers": ["disk"], "quota": {"shared": "1GiB"}}],
     r"placement\[0\]\.quota\.shared: not a tier this rule allows; a quota may name dram or disk"),
    ([{"salt": "t-*", "tiers": [], "quota": {"dram": "lots"}}], r"placement\[0\]\.quota\.dram: expected a byte size"),
    ([{"salt": "t-*", "tiers": [], "quota": {"dram": 0}}], r"placement\[0\]\.quota\.dram: must be at least 1 byte"),
    ([{"salt": "t-*", "tiers": [], "quota": []}], r"placement\[0\]\.quota: a mapping of tier name to bytes"),
])
def test_bad_quotas_are_refused_naming_the_field(tmp_path: Path, placement: list, message: str) -> None:
    cfg = {"tiers": [{"type": "filesystem", "name": n, "path": str(tmp_path / n)} for n in ("disk", "shared")],
           "placement": placement}
    with pytest.raises(ConfigError, match=message):
        KVStore.from_config(cfg)


def test_a_quota_on_a_tier_that_cannot_keep_one_is_refused(mooncake_server) -> None:
    cfg = {"tiers": [{"type": "mooncake", "name": "shared", **mooncake_server.tier_options(), "admin_url": None}],
           "placement": [{"salt": "t-*", "tiers": ["shared"], "quota": {"shared": "1GiB"}}]}
    with pytest.raises(ConfigError, match=r"placement\[0\]\.quota\.shared: a quota on a Mooncake tier needs "
                                          r"tiers\[0\]\.admin_url .*to list the share's keys"):
        KVStore.from_config(cfg)


def test_a_quota_on_an_out_of_tree_tier_without_shares_is_refused(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.tiers import TIERS
    from kvtier.tiers._filesystem import FilesystemTier

    class NoShares(FilesystemTier):
        shares = False

    monkeypatch.setitem(TIERS._entries, "no-shares-test", NoShares)
    cfg = {"tiers": [{"type": "no-shares-test", "name": "plain", "path": str(tmp_path / "d")}],
           "placement": [{"salt": "t-*", "tiers": ["plain"], "quota": {"plain": "1GiB"}}]}
    with pytest.raises(ConfigError, match=r"placement\[0\]\.quota\.plain: the NoShares keeps no per-tenant quotas "
                                          r".*quotas apply to dram, filesystem, redis, s3 and mooncake tiers"):
        KVStore.from_config(cfg)


# -- Redis: the shares are counted in the server, over every engine's writes -------------------------------------
SHARD = payload_bytes() + frame.HEADER_LEN  # what one chunk's object takes in Redis (one engine, all heads)


def redis_config(server, prefix: str, quota_shards: int, **tier: object) -> dict:
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "16MiB", "page_bytes": PAGE},
            "tiers": [{"type": "redis", "name": "shared", **server.tier_options(), "key_prefix": prefix,
                       "queue_depth": 4096, **tier}],
            "placement": [{"salt": "team-*", "tiers": ["shared"], "quota": {"shared": quota_shards * SHARD}}]}


def held(store: KVStore, tenant: str) -> int:
    return sum(1 for _ in store.tiers[0].list(ns(tenant).id))


def put(store: KVStore, tenant: str, tokens: list[int]) -> None:
    store.put(ns(tenant), tokens, synthetic_kv(tokens))
    store.flush()


@pytest.fixture(params=["redis", "redis-cluster"])
def shared_redis(request):
    return request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")


def test_a_tenant_past_its_redis_share_evicts_its_own_least_recent_shards_whichever_engine_wrote_them(
        shared_redis, unique_prefix: str, age) -> None:
    """Two engines on one server (a cluster too: a share's keys share a slot): the share counts both engines'
    writes, a read moves a shard to the recent end, one engine evicts the other's shards, another tenant loses
    nothing, and the server never sees the salt."""
    p = [synthetic_tokens(40 + i, 2 * T) for i in range(3)]
    cfg = redis_config(shared_redis, unique_prefix, 4)
    with KVStore.from_config(cfg) as a, KVStore.from_config(cfg) as b:
        put(a, "public", p[0])
        put(a, "team-a", p[0])
        age()
        put(b, "team-a", p[1])  # the share is full: 4 shards, two engines' writes
        age()
        share = a._placement.decide(ns("team-a")).share
        assert a.tiers[0].share_bytes(share) == b.tiers[0].share_bytes(share) == 4 * SHARD
        a.drop_dram()
        assert torch.equal(a.get(ns("team-a"), p[0]), synthetic_kv(p[0]))  # read back from Redis: now recent
        age()
        put(a, "team-a", p[2])  # past the share: the least recently used, p[1] (engine b's), goes
        assert (held(a, "team-a"), held(a, "public")) == (4, 2)
        assert a.tiers[0].share_bytes(share) == 4 * SHARD
        assert a.tiers[0].counters()["share_evictions"] == 2
        client = redis.Redis.from_url(shared_redis.url) if not shared_redis.tier_options().get("cluster") else \
            redis.RedisCluster.from_url(shared_redis.url)
        names = list(client.scan_iter(match=f"{unique_prefix}*"))
        assert any(b"{share:" in n for n in names) and not any(b"team-a" in n for n in names)
    with KVStore.from_config(cfg) as c:  # a third engine finds what the share kept
        assert c.get(ns("team-a"), p[1]) is None
        for tenant, tokens in (("team-a", p[0]), ("team-a", p[2]), ("public", p[0])):
            assert torch.equal(c.get(ns(tenant), tokens), synthetic_kv(tokens))


@pytest.mark.parametrize("tier", ["disk", "redis", "s3", "mooncake"])
def test_a_prompt_larger_than_a_tier_share_keeps_its_leading_chunks(tier: str, tmp_path: Path, request,
                                                                    unique_prefix: str, age) -> None:
    """Its chunks are put together, first chunk first: past the share, an older prompt's chunks are evicted for
    them, then its later chunks are refused, never its first ones evicted (which would leave nothing loadable),
    and nothing is evicted for a chunk that is refused. Putting it again changes nothing."""
    big, older = synthetic_tokens(45, 6 * T), synthetic_tokens(46, 2 * T)
    kv = synthetic_kv(big)
    if tier == "disk":
        cfg = config(tmp_path, {"disk": 4 * SHARD + 100}, ["disk"])
    else:
        make = {"redis": redis_config, "s3": s3_config, "mooncake": mooncake_config}[tier]
        cfg = make(request.getfixturevalue(f"{tier}_server"), unique_prefix, 4)
    with KVStore.from_config(cfg) as store:
        put(store, "team-a", older)
        listed_age() if tier == "s3" else age()
        for _ in range(2):
            put(store, "team-a", big)
            assert held(store, "team-a") == 4
            store.drop_dram()
            assert store.load(ns("team-a"), big, lambda first, chunks: None, layers=kv.shape[0],
                              head_dim=kv.shape[4], dtype=kv.dtype) == 4 * T
            assert torch.equal(store.get(ns("team-a"), big[:4 * T]), kv[:, :, :, :4 * T])
        counters = store.tiers[0].counters()
        assert (counters["share_evictions"], counters["share_refused_writes"]) == (2, 4)  # the older prompt
        assert store.stats()[store.tiers[0].name]["dropped_writes_total{reason=share_full}"] == 4


def test_redis_shards_removed_behind_the_share_stay_counted_until_it_evicts_them(redis_server, unique_prefix: str,
                                                                                 age) -> None:
    """Shards the server dropped by itself (maxmemory, ttl) stay counted, as the least recently used: the next put
    past the quota takes those out first, and the share holds its real shards again. A delete by a process that
    was never told the share (a command) takes the shard out of the count."""
    p = [synthetic_tokens(50 + i, 2 * T) for i in range(3)]
    cfg = redis_config(redis_server, unique_prefix, 4)
    client = redis.Redis.from_url(redis_server.url)  # (the test's own client, not the tier's)
    with KVStore.from_config(cfg) as store:
        put(store, "team-a", p[0])
        age()
        put(store, "team-a", p[1])
        age()
        share = store._placement.decide(ns("team-a")).share
        for chunk in chunk_keys(ns("team-a"), p[0], T):
            client.unlink(f"{unique_prefix}{ns('team-a').id}:{chunk.hex()}")  # as maxmemory would
        assert store.tiers[0].share_bytes(share) == 4 * SHARD  # still counted
        put(store, "team-a", p[2])  # over: p[0]'s counts go, not p[1]'s shards
        assert held(store, "team-a") == 4 and store.tiers[0].share_bytes(share) == 4 * SHARD
        store.drop_dram()
        assert torch.equal(store.get(ns("team-a"), p[1]), synthetic_kv(p[1]))
    (tier,) = open_tiers(load_config(cfg))  # as `kvtier cache purge` opens it: told no share
    try:
        victim = next(iter(tier.list(ns("team-a").id))).key
        assert tier.delete(victim)
        assert tier.share_bytes(share) == 3 * SHARD
    finally:
        tier.close()


def test_a_redis_eviction_that_fails_is_handed_out_again(redis_server, unique_prefix: str, age,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard handed out for deletion stays counted until its deletion is confirmed: one whose deletion failed
    (or whose engine died) is handed out again by a later put, so the share comes back under its quota."""
    p = [synthetic_tokens(55 + i, 2 * T) for i in range(3)]
    cfg = redis_config(redis_server, unique_prefix, 4)
    with KVStore.from_config(cfg) as store:
        put(store, "team-a", p[0])
        age()
        put(store, "team-a", p[1])
        age()
        tier = store.tiers[0]
        real = tier._delete
        monkeypatch.setattr(tier, "_delete", lambda key: (_ for _ in ()).throw(TierError("down")))
        put(store, "team-a", p[2])  # hands out p[0]'s shards; deleting them fails
        share = store._placement.decide(ns("team-a")).share
        assert held(store, "team-a") == 6 and tier.share_bytes(share) == 6 * SHARD  # over, but counted
        monkeypatch.setattr(tier, "_delete", real)
        monkeypatch.setattr(_redis_shares, "_STALE_MS", 100)
        age()
        put(store, "team-a", synthetic_tokens(58, T))  # hands them out again: deleted now
        assert held(store, "team-a") <= 4 and tier.share_bytes(share) == held(store, "team-a") * SHARD


def test_a_redis_eviction_confirmed_after_another_engine_put_the_shard_back_leaves_it_counted(
        redis_server, unique_prefix: str, age) -> None:
    """Engine a's put hands out shard x and a deletes it; engine b puts x back before a confirms: x is stored
    again, so it stays counted (a confirmation takes out only what is still handed out)."""
    cfg = load_config(redis_config(redis_server, unique_prefix, 2))
    (a,), (b,) = open_tiers(cfg), open_tiers(cfg)
    try:
        x, y, z = (ShardKey(ns("team-a").id, f"{i:032x}", HeadRange(0, 4, 4)) for i in range(3))
        for tier in (a, b):
            tier.set_share(x.namespace, "s", 2 * SHARD)
        for key in (x, y):
            a.put(key, [b"k" * SHARD])
        age()
        counted = a._shares.account(z, SHARD)  # a's put of z, past the share
        assert counted is not None and counted.victims == [x]
        a._delete(x)
        b.put(x, [b"k" * SHARD])  # b puts x back (counted again: live)
        a._shares.deleted(counted.share, counted.victims)  # a confirms late
        a.put(z, [b"k" * SHARD])
        stored = {o.key for o in a.list(x.namespace)}
        assert stored == {x, z}  # b's put of x evicted y, the least recently used
        assert a.share_bytes("s") == 2 * SHARD  # x counted: without the check, 1 shard
    finally:
        a.close()
        b.close()


def test_a_redis_share_whose_own_keys_the_server_evicted_starts_anew(redis_server, unique_prefix: str,
                                                                     age) -> None:
    """maxmemory may evict one of the share's keys alone: the share then counts from scratch, and never takes
    that for a reason to delete the tenant's shards."""
    p = [synthetic_tokens(60 + i, 2 * T) for i in range(3)]
    cfg = redis_config(redis_server, unique_prefix, 4)
    client = redis.Redis.from_url(redis_server.url)
    with KVStore.from_config(cfg) as store:
        share = store._placement.decide(ns("team-a")).share
        sid = _redis_shares.share_id(share)
        for i, lost in ((0, "acct"), (1, "lru")):  # the counts; the order (whose shards would then never go)
            put(store, "team-a", p[i])
            age()
            client.unlink(f"{unique_prefix}{{share:{sid}}}:{lost}")  # as maxmemory would
        put(store, "team-a", p[2])
        assert held(store, "team-a") == 6  # nothing deleted
        assert store.tiers[0].share_bytes(share) == 2 * SHARD  # p[2] alone: counting anew


def test_a_brace_in_a_clusters_key_prefix_is_refused(redis_cluster) -> None:
    cfg = {"tiers": [{"type": "redis", **redis_cluster.tier_options(), "key_prefix": "kv{}:"}]}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.key_prefix: no '\{' or '\}' in a cluster"):
        KVStore.from_config(cfg)


_REDIS_TENANTS = ("team-a", "team-b", "public")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from(_REDIS_TENANTS), st.integers(0, 4), st.booleans()),
                min_size=1, max_size=12))
@pytest.mark.parametrize("recent", [0.0, 10.0])
@pytest.mark.parametrize("kind", ["redis", "s3", "mooncake"])
def test_tier_shares_hold_under_any_sequence_of_two_engines_puts_and_gets(request, kind: str, recent: float,
                                                                         ops: list[tuple[int, str, int, bool]]) \
        -> None:
    """Two engines taking turns, any order of puts and cold gets, with no recent shards kept from eviction (an
    eviction at every put past the quota) and with the default window (refusals): no share holds more shards
    in the server than its quota (S3: each put lists the share first), the unlimited tenant keeps every shard,
    and every get is exact or a miss."""
    prefix = f"h{uuid.uuid4().hex[:12]}/"
    make = {"redis": redis_config, "s3": s3_config, "mooncake": mooncake_config}[kind]
    cfg = make(request.getfixturevalue(f"{kind}_server"), prefix, 3)
    cfg["placement"].append({"tiers": ["shared"]})
    default, tier_shares.RECENT_SECONDS = tier_shares.RECENT_SECONDS, recent
    try:
        with KVStore.from_config(cfg) as e0, KVStore.from_config(cfg) as e1:
            engines = (e0, e1)
            public: set[int] = set()
            for engine, tenant, seed, read in ops:
                store = engines[engine]
                tokens = synthetic_tokens(70 + seed, 2 * T)
                if read:
                    store.drop_dram()
                    got = store.get(ns(tenant), tokens)
                    assert got is None or torch.equal(got, synthetic_kv(tokens))
                else:
                    put(store, tenant, tokens)
                    if tenant == "public":
                        public.add(seed)
                for t in ("team-a", "team-b"):
                    assert held(e0, t) <= 3
                assert held(e0, "public") == 2 * len(public)
    finally:
        tier_shares.RECENT_SECONDS = default


_TENANTS = ("team-a", "team-b", "public")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_TENANTS), st.integers(0, 5), st.integers(1, 6), st.booleans()),
                min_size=1, max_size=25))
def test_shares_hold_under_any_sequence_of_puts_and_gets(ops: list[tuple[str, int, int, bool]]) -> None:
    """With room in DRAM for everything, a tenant without a quota never loses a chunk, no share ever holds more
    than its quota, and every get is exact or a miss."""
    quota = 4 * chunk_bytes()
    with KVStore.from_config(config(None, {"dram": quota})) as store:
        public: set[int] = set()
        for tenant, seed, chunks, read in ops:
            tokens = synthetic_tokens(seed, chunks * T)
            kv = synthetic_kv(tokens)
            if read:
                got = store.get(ns(tenant), tokens)
                assert got is None or torch.equal(got, kv)
            else:
                stored = store.put(ns(tenant), tokens, kv)
                if stored:  # what a put reports stored is there
                    assert torch.equal(store.get(ns(tenant), tokens[:stored]), kv[:, :, :, :stored])
                if tenant == "public":
                    public.add((seed, chunks))
            for share in {store._placement.decide(ns(t)).share for t in _TENANTS} - {None}:
                assert store.dram.share_bytes(share) <= quota
            assert store.dram.audit()["share_mismatch"] == 0
        for seed, chunks in public:
            tokens = synthetic_tokens(seed, chunks * T)
            assert torch.equal(store.get(ns("public"), tokens), synthetic_kv(tokens))


def test_a_prompt_larger_than_the_share_keeps_its_leading_chunks_put_after_put() -> None:
    """Putting it again finds those chunks held: they are never evicted to make room for its later ones."""
    big = synthetic_tokens(20, 5 * T)
    kv = synthetic_kv(big)
    with KVStore.from_config(config(None, {"dram": 3 * chunk_bytes()})) as store:
        for _ in range(3):
            assert store.put(ns("team-a"), big, kv) == 3 * T
            assert torch.equal(store.get(ns("team-a"), big[:3 * T]), kv[:, :, :, :3 * T])


def test_reservations_count_against_the_share_before_they_commit() -> None:
    """Reads ahead and concurrent puts reserve before they commit: the share counts them from the reservation."""
    with KVStore.from_config(config(None, {"dram": 2 * chunk_bytes()})) as store:
        ns_a = ns("team-a")
        store._apply_share(ns_a, store._placement.decide(ns_a))
        tokens = synthetic_tokens(21, 3 * T)
        meta = frame.ShardMeta(*synthetic_kv(tokens).shape[:1], T, synthetic_kv(tokens).shape[4],
                               torch.bfloat16, frame.HeadRange(0, synthetic_kv(tokens).shape[2],
                                                               synthetic_kv(tokens).shape[2]))

        keys = [ShardKey(ns_a.id, c.hex(), meta.heads) for c in chunk_keys(ns_a, tokens, T)]
        first, second = store.dram.reserve(keys[0], meta, None), store.dram.reserve(keys[1], meta, None)
        assert store.dram.reserve(keys[2], meta, None) == "full"
        store.dram.abort(first)  # an aborted reservation gives its pages back to the share
        third = store.dram.reserve(keys[2], meta, None)
        assert not isinstance(third, str)
        for entry in (second, third):
            store.dram.abort(entry)
        assert store.dram.share_bytes(store._placement.decide(ns_a).share) == 0


def test_a_disk_share_is_counted_again_after_a_rescan(tmp_path: Path, age) -> None:
    """The tier walks its directory again now and then (other engines write there): the share is counted from
    what the walk finds, and still evicts inside itself."""
    prompts = [synthetic_tokens(30 + i, 2 * T) for i in range(3)]
    file_bytes = payload_bytes() + frame.HEADER_LEN
    with KVStore.from_config(config(tmp_path, {"disk": 4 * file_bytes + 100}, ["disk"])) as store:
        store.put(ns("team-a"), prompts[0], synthetic_kv(prompts[0]))
        store.flush()
        disk = store.tiers[0]
        share = store._placement.decide(ns("team-a")).share
        disk._reindex()
        assert disk.share_bytes(share) == 2 * file_bytes
        for p in prompts[1:]:
            age()
            store.put(ns("team-a"), p, synthetic_kv(p))
            store.flush()
        assert disk.share_bytes(share) == 4 * file_bytes
        assert sum(1 for _ in disk.list(ns("team-a").id)) == 4


# -- S3: each engine counts a share from listings of the bucket ---------------------------------------------------
def s3_config(server, prefix: str, quota_shards: int, **tier: object) -> dict:
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "16MiB", "page_bytes": PAGE},
            "tiers": [{"type": "s3", "name": "shared", **server.tier_options(), "prefix": prefix,
                       "queue_depth": 4096, "share_refresh_seconds": 0, **tier}],
            "placement": [{"salt": "team-*", "tiers": ["shared"], "quota": {"shared": quota_shards * SHARD}}]}


def listed_age() -> None:
    """``age()`` for objects in an S3 listing: S3 lists write times to the second (the server's ``Date`` too),
    so a listed object may count as written up to 2 s after it was."""
    time.sleep(2.0 + tier_shares.RECENT_SECONDS + 0.1)


def test_a_tenant_past_its_s3_share_evicts_its_own_least_recent_objects_whichever_engine_wrote_them(
        s3_server, unique_prefix: str, age) -> None:
    """Two engines on one bucket, the tenant's KV of two models: each engine lists the share before it writes
    (``share_refresh_seconds: 0``), finding the other's namespaces through the share's objects, so it counts the
    other's objects; a read moves an object to the recent end; one engine evicts the other's objects; another
    tenant loses nothing; no object name holds the salt."""
    p = [synthetic_tokens(60 + i, 2 * T) for i in range(3)]
    other = Namespace(model="m2", dtype="bfloat16", cache_salt="team-a")  # the same tenant: the same share
    cfg = s3_config(s3_server, unique_prefix, 4)
    with KVStore.from_config(cfg) as a, KVStore.from_config(cfg) as b:
        put(a, "public", p[0])
        put(a, "team-a", p[0])
        listed_age()
        b.put(other, p[1], synthetic_kv(p[1]))  # the share is full: 4 objects, two engines' writes
        b.flush()
        listed_age()
        share = a._placement.decide(ns("team-a")).share
        assert b._placement.decide(other).share == share
        assert a.tiers[0].share_bytes(share) == b.tiers[0].share_bytes(share) == 4 * SHARD
        a.drop_dram()
        assert torch.equal(a.get(ns("team-a"), p[0]), synthetic_kv(p[0]))  # read back from S3: now recent
        age()
        put(a, "team-a", p[2])  # past the share: the least recently used, p[1] (engine b's), goes
        assert (held(a, "team-a"), held(a, "public"), sum(1 for _ in a.tiers[0].list(other.id))) == (4, 2, 0)
        assert a.tiers[0].share_bytes(share) == 4 * SHARD
        assert a.tiers[0].counters()["share_evictions"] == 2
        names = [obj["Key"] for obj in a.tiers[0]._list(unique_prefix)]
        assert any(n.startswith(f"{unique_prefix}shares/") for n in names)
        assert not any("team-a" in n for n in names)
    with KVStore.from_config(cfg) as c:  # a third engine finds what the share kept
        assert c.get(other, p[1]) is None
        for tenant, tokens in (("team-a", p[0]), ("team-a", p[2]), ("public", p[0])):
            assert torch.equal(c.get(ns(tenant), tokens), synthetic_kv(tokens))


def test_an_s3_share_sees_another_engines_writes_at_its_next_listing(s3_server, unique_prefix: str,
                                                                     age) -> None:
    """Between listings an engine counts only its own writes (the share can pass its quota by the others'); its
    first put once the view is ``share_refresh_seconds`` old (10 s by default) lists the share and brings it back
    under its quota, least recent first."""
    p = [synthetic_tokens(70 + i, 2 * T) for i in range(4)]
    cfg = s3_config(s3_server, unique_prefix, 4, share_refresh_seconds=10.0)
    with KVStore.from_config(cfg) as a, KVStore.from_config(cfg) as b:
        put(a, "team-a", p[0])  # a lists the share: empty
        listed = time.monotonic()
        listed_age()
        put(b, "team-a", p[1])  # b lists: a's two objects and its own two
        listed_age()  # (b's objects are listed to the second)
        put(a, "team-a", p[2])  # a's view is not due: its own four objects, no eviction
        assert time.monotonic() - listed < 10.0, "the machine is too slow for this test's timing"
        assert held(a, "team-a") == 6
        time.sleep(max(0.0, listed + 10.0 - time.monotonic()))
        listed_age()
        put(a, "team-a", p[3])  # listed again: p[0] (a's), then p[1] (b's) go
        assert held(a, "team-a") == 4
        assert a.tiers[0].counters()["share_evictions"] == 4
        a.drop_dram()
        assert a.get(ns("team-a"), p[0]) is None and a.get(ns("team-a"), p[1]) is None
        for tokens in p[2:]:
            assert torch.equal(a.get(ns("team-a"), tokens), synthetic_kv(tokens))


def test_an_s3_share_listing_reads_the_servers_clock(s3_server, unique_prefix: str) -> None:
    """The offset between the server's clock and this engine's comes from the listing's Date (botocore's
    headers, as the server sends them): on one host it is under the Date's second."""
    with KVStore.from_config(s3_config(s3_server, unique_prefix, 4)) as store:
        names, offset = store.tiers[0]._share_members(_redis_shares.share_id("rule0/nobody"))
        assert names == [] and offset is not None and -1.5 < offset < 0.5


def test_bad_s3_share_refresh_is_refused_naming_the_field(s3_server) -> None:
    cfg = {"tiers": [{"type": "s3", "name": "shared", **s3_server.tier_options(), "share_refresh_seconds": -1}]}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.share_refresh_seconds: must be a number of seconds >= 0, "
                                          r"got -1"):
        KVStore.from_config(cfg)


# -- Mooncake: each engine counts a share from the master's key list ---------------------------------------------
def mooncake_config(server, prefix: str, quota_shards: int, **tier: object) -> dict:
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "16MiB", "page_bytes": PAGE},
            "tiers": [{"type": "mooncake", "name": "shared", **server.tier_options(), "key_prefix": prefix,
                       "queue_depth": 4096, "share_refresh_seconds": 0, **tier}],
            "placement": [{"salt": "team-*", "tiers": ["shared"], "quota": {"shared": quota_shards * SHARD}}]}


def test_a_tenant_past_its_mooncake_share_evicts_its_own_least_recent_objects_whichever_engine_wrote_them(
        mooncake_server, unique_prefix: str, age) -> None:
    """As on S3, with no times from Mooncake: another engine's objects age from when this engine first listed
    them; one engine evicts the other's objects; another tenant loses nothing."""
    p = [synthetic_tokens(80 + i, 2 * T) for i in range(3)]
    other = Namespace(model="m2", dtype="bfloat16", cache_salt="team-a")
    cfg = mooncake_config(mooncake_server, unique_prefix, 4)
    with KVStore.from_config(cfg) as a, KVStore.from_config(cfg) as b:
        put(a, "public", p[0])
        put(a, "team-a", p[0])
        age()
        b.put(other, p[1], synthetic_kv(p[1]))  # the share is full: 4 objects, two engines' writes
        b.flush()
        share = a._placement.decide(ns("team-a")).share
        assert a.tiers[0].share_bytes(share) == b.tiers[0].share_bytes(share) == 4 * SHARD  # a first sees b's
        age()
        a.drop_dram()
        assert torch.equal(a.get(ns("team-a"), p[0]), synthetic_kv(p[0]))  # read back: now recent
        age()
        put(a, "team-a", p[2])  # past the share: the least recently used, p[1] (engine b's), goes
        assert (held(a, "team-a"), held(a, "public"), sum(1 for _ in a.tiers[0].list(other.id))) == (4, 2, 0)
        assert a.tiers[0].counters()["share_evictions"] == 2
    with KVStore.from_config(cfg) as c:
        assert c.get(other, p[1]) is None
        for tenant, tokens in (("team-a", p[0]), ("team-a", p[2]), ("public", p[0])):
            assert torch.equal(c.get(ns(tenant), tokens), synthetic_kv(tokens))


@pytest.mark.parametrize("tier", ["disk", "redis", "s3", "mooncake"])
def test_a_purged_namespace_leaves_nothing_that_names_it(tier: str, tmp_path: Path, request,
                                                         unique_prefix: str, capsys) -> None:
    """``kvtier cache purge --namespace`` (and ``tenant forget``, which removes the same way) removes the
    namespace's objects, then its records beside them: its share records (Redis ``shareof``, S3 and Mooncake
    ``shares/``), its Mooncake marker, its directory on disk. Another namespace of the same share (the tenant's
    other model) keeps its own."""
    import yaml

    from kvtier.cli import main

    tokens = synthetic_tokens(47, 2 * T)
    if tier == "disk":
        cfg = config(tmp_path, {"disk": 40 * SHARD}, ["disk"])
    else:
        make = {"redis": redis_config, "s3": s3_config, "mooncake": mooncake_config}[tier]
        cfg = make(request.getfixturevalue(f"{tier}_server"), unique_prefix, 40)
    other = Namespace(model="m2", dtype="bfloat16", cache_salt="team-a")
    with KVStore.from_config(cfg) as store:
        for namespace in (ns("team-a"), other):
            store.put(namespace, tokens, synthetic_kv(tokens))
        store.flush()
    gone, kept = ns("team-a").id, other.id
    records = {"disk": ["disk/{}"], "redis": ["shareof:{}"], "s3": ["shares/"],
               "mooncake": ["shares/", "{}/heads"]}[tier]
    names = _raw_names(tier, cfg, request, tmp_path)
    for namespace in (gone, kept):  # its objects, and records beside them
        assert all(any(r.format(namespace) in n and namespace in n for n in names) for r in records), names
    if tier == "redis":  # a shard the server dropped by itself: still counted in the share, never listed
        client = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
        client.delete(next(n for n in client.scan_iter(match=f"{unique_prefix}{gone}:*")))
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["cache", "purge", "--namespace", gone, "--config", str(path)]) == 0
    assert f"removed {1 if tier == 'redis' else 2} objects" in capsys.readouterr().out
    names = _raw_names(tier, cfg, request, tmp_path)
    assert not any(gone in n for n in names), names
    if tier == "disk":  # nor does the share's ledger, which every process reads
        ledgers = [p.read_text() for p in (tmp_path / "disk" / ".shares").iterdir() if "." not in p.name]  # no .lock
        assert ledgers and not any(gone in text for text in ledgers) and all(kept in text for text in ledgers)
    assert all(any(r.format(kept) in n and kept in n for n in names) for r in records), names
    with KVStore.from_config(cfg) as store:  # the namespace is written and found again after its records went
        assert torch.equal(store.get(other, tokens), synthetic_kv(tokens))
        put(store, "team-a", tokens)
        store.drop_dram()
        assert torch.equal(store.get(ns("team-a"), tokens), synthetic_kv(tokens))


def _raw_names(tier: str, cfg: dict, request, tmp_path: Path) -> list[str]:
    """Every name the tier's server (or directory) holds under the test's prefix."""
    if tier == "disk":
        return [str(p.relative_to(tmp_path)) for p in (tmp_path / "disk").rglob("*")]
    server = request.getfixturevalue(f"{tier}_server")
    options = cfg["tiers"][0]
    if tier == "redis":  # and what the share's keys hold: the shards they count
        client = redis.Redis.from_url(server.url)
        names = []
        for name in client.scan_iter(match=f"{options['key_prefix']}*"):
            kind = client.type(name)
            inside = client.hkeys(name) if kind == b"hash" and b"{share:" in name else \
                client.zrange(name, 0, -1) if kind == b"zset" else []
            names += [name.decode()] + [f"{name.decode()} {m.decode()}" for m in inside]
        return names
    if tier == "s3":
        import boto3

        tier_options = server.tier_options()
        client = boto3.client("s3", endpoint_url=tier_options["endpoint_url"], region_name="us-east-1",
                              aws_access_key_id=tier_options["access_key_id"],
                              aws_secret_access_key=tier_options["secret_access_key"])
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=tier_options["bucket"],
                                                                 Prefix=options["prefix"])
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]
    import urllib.request

    with urllib.request.urlopen(f"{options['admin_url'].rstrip('/')}/get_all_keys", timeout=10) as resp:
        return [n for n in resp.read().decode().split() if n.startswith(options["key_prefix"])]


# -- Filesystem: a share is the directory's, whichever processes and threads write it ----------------------------
FS_SHARD = 1000  # bytes per shard in the tier-level tests: small, so they are quick


def fs_tier(path: Path, **options: object) -> FilesystemTier:
    return FilesystemTier("fs", FilesystemOptions(path=str(path), **options))


def files_of(path: Path, namespace: str) -> int:
    return sum(1 for _ in (path / namespace).rglob("*.kv"))


def _fill_share(path: Path, first: int, shards: int, threads: int, slow: bool, start: Any = None) -> None:
    """One process: ``threads`` writers, each putting its own ``shards`` shards of NS_A into a share of 12 (once
    every process has opened the tier, when ``start`` is a barrier)."""
    tier = fs_tier(path)
    if slow:  # a fault: the write itself takes a while, so concurrent puts overlap between check and rename
        create = tier._create_temp
        tier._create_temp = lambda: (time.sleep(0.05), create())[1]  # type: ignore[method-assign]
    tier.set_share(NS_A, "rule0", 12 * FS_SHARD)
    if start is not None:
        start.wait(30)

    def write(t: int) -> None:
        for i in range(shards):
            with contextlib.suppress(QuotaFull):
                tier.put(tier_key(first + 100 * t + i), [b"x" * FS_SHARD])

    workers = [threading.Thread(target=write, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    tier.close()


@pytest.mark.parametrize("recent", [tier_shares.RECENT_SECONDS, 0.0], ids=["refused", "evicted"])
def test_three_processes_on_one_directory_hold_one_share_to_its_quota(tmp_path: Path, recent: float,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each process puts 12 shards into a share of 12: together they hold 12, not 36, whether the share refuses
    (all recent) or evicts (nothing recent; then one process evicts the others' files)."""
    monkeypatch.setattr(tier_shares, "RECENT_SECONDS", recent)
    fs_tier(tmp_path / "fs").close()  # the root exists before the processes race to make it
    fork = multiprocessing.get_context("fork")  # inherits the patched window; nothing to import again
    start = fork.Barrier(3)  # all three indexed the empty directory before any writes
    procs = [fork.Process(target=_fill_share, args=(tmp_path / "fs", 10_000 * p, 12, 1, False, start))
             for p in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert files_of(tmp_path / "fs", NS_A) == 12
    again = fs_tier(tmp_path / "fs")
    again.set_share(NS_A, "rule0", 12 * FS_SHARD)
    assert again.share_bytes("rule0") == 12 * FS_SHARD


def test_four_writer_threads_hold_a_share_to_its_quota(tmp_path: Path) -> None:
    """``workers: 4``: puts of one share check and commit one at a time, so slow writes that overlap still stop at
    the quota (every shard recent: the rest are refused)."""
    _fill_share(tmp_path / "fs", 0, 6, 4, True)
    assert files_of(tmp_path / "fs", NS_A) == 12


def test_capacity_evicts_outside_shares_before_a_share_within_its_quota(tmp_path: Path) -> None:
    """A quota is a reservation: a client filling the disk under a namespace no rule (or a rule without a quota)
    covers evicts its own files, never a share within its quota, also from a process that was never told of the
    share (it reads it from the directory)."""
    tenant = fs_tier(tmp_path / "fs")
    tenant.set_share(NS_A, "rule0", 4 * FS_SHARD)
    for i in range(4):
        tenant.put(tier_key(i), [b"a" * FS_SHARD])
    other = fs_tier(tmp_path / "fs", capacity_bytes=20 * FS_SHARD, high_watermark=1.0, low_watermark=0.5)
    for i in range(60):
        other.put(tier_key(100 + i, namespace=NS_B), [b"b" * FS_SHARD])
    assert files_of(tmp_path / "fs", NS_A) == 4
    assert 0 < files_of(tmp_path / "fs", NS_B) <= 20
    assert other.counters()["evictions"] >= 40


def test_a_salt_hopping_client_is_capped_by_its_rules_share(tmp_path: Path) -> None:
    """Every salt a rule matches counts against the rule's one share: a client that sends each prompt under a new
    salt holds no more than the quota, in DRAM and on disk."""
    with KVStore.from_config(config(tmp_path, {"dram": 4 * chunk_bytes(), "disk": 4 * SHARD + 100},
                                    ["disk"])) as store:
        for i in range(5):
            tokens = synthetic_tokens(80 + i, 2 * T)
            put(store, f"team-hop{i}", tokens)
        assert sum(held(store, f"team-hop{i}") for i in range(5)) == 4
        share = store._placement.decide(ns("team-hop0")).share
        assert share == store._placement.decide(ns("team-hop4")).share
        assert store.dram.share_bytes(share) <= 4 * chunk_bytes()


def test_a_process_alone_on_its_share_counts_it_from_its_index(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The share is listed from the directory only when another process changed it: once at the first put (the
    ledger's token is new to this process), then never, however many files the share evicts; once more after
    another process's write."""
    monkeypatch.setattr(tier_shares, "RECENT_SECONDS", 0.0)
    tier, other = fs_tier(tmp_path / "fs"), fs_tier(tmp_path / "fs")
    listings = []
    recount = tier._recount_share
    monkeypatch.setattr(tier, "_recount_share", lambda ledger: (listings.append(1), recount(ledger)))
    tier.set_share(NS_A, "rule0", 4 * FS_SHARD)
    for i in range(20):
        tier.put(tier_key(i), [b"x" * FS_SHARD])
    assert (len(listings), files_of(tmp_path / "fs", NS_A), tier.counters()["share_evictions"]) == (1, 4, 16)
    other.set_share(NS_A, "rule0", 4 * FS_SHARD)
    other.put(tier_key(100), [b"y" * FS_SHARD])  # evicts one of the first process's files
    tier.put(tier_key(101), [b"x" * FS_SHARD])
    assert len(listings) == 2 and files_of(tmp_path / "fs", NS_A) == 4
    assert tier.share_bytes("rule0") == 4 * FS_SHARD


def test_a_share_counted_again_lists_only_the_chunk_directories_changed(tmp_path: Path) -> None:
    """Counting a share again skips a chunk directory whose mtime is the one seen at its last listing (and was
    old then), and lists one another process changed since: its removal and its new file are both seen."""
    def shard_key(sub: int) -> ShardKey:
        return ShardKey(NS_A, f"{sub:02x}" + "0" * 30, HeadRange(0, 4, 4))

    a, b = fs_tier(tmp_path / "fs"), fs_tier(tmp_path / "fs")
    for tier in (a, b):
        tier.set_share(NS_A, "rule0", 20 * FS_SHARD)
    for sub in range(4):
        a.put(shard_key(sub), [b"a" * FS_SHARD])
    old = time.time() - 60
    for sub in range(4):
        os.utime(tmp_path / "fs" / NS_A / f"{sub:02x}", (old, old))  # as if written a minute ago
    b.put(shard_key(4), [b"b" * FS_SHARD])  # a must count the share again at its next put
    a.put(shard_key(5), [b"a" * FS_SHARD])  # lists every directory; notes 00-03 as old
    b.delete(shard_key(1))
    b.put(shard_key(0x20), [b"b" * FS_SHARD])
    seen: list[tuple[str, bool]] = []
    listed = a._listed_sub
    a._listed_sub = lambda ns, sub, fd: seen.append((sub, listed(ns, sub, fd))) or seen[-1][1]  # type: ignore
    a.put(shard_key(6), [b"a" * FS_SHARD])
    skipped = {sub for sub, unchanged in seen if unchanged}
    assert skipped == {"00", "02", "03"}  # 01 lost a file, 04 and 05 are new, 20 is new
    assert a.share_bytes("rule0") == files_of(tmp_path / "fs", NS_A) * FS_SHARD == 7 * FS_SHARD


def _ledger_path(path: Path) -> Path:
    return path / ".shares" / tier_shares.share_id("rule0")


def _grow_ledger(path: Path, namespaces: int) -> None:
    """Lines as other processes' joins append them (one per namespace a salt-hopping client made), none with files."""
    with _ledger_path(path).open("ab") as f:
        f.write(b"".join(b"%032x\n" % (i + 1) for i in range(namespaces)))


def test_a_ledger_past_its_size_limit_is_compacted_never_replaced_under_a_running_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger grown past 4 MiB (a namespace per salt) is not removed by the next process to open it, which would
    leave the running one locking a file no one else locks: the share stays at its quota, and the ledger shrinks
    to the namespaces that hold files."""
    monkeypatch.setattr(tier_shares, "RECENT_SECONDS", 0.0)
    a = fs_tier(tmp_path / "fs")
    a.set_share(NS_A, "rule0", 12 * FS_SHARD)
    a.put(tier_key(0), [b"a" * FS_SHARD])
    _grow_ledger(tmp_path / "fs", 130_000)
    assert _ledger_path(tmp_path / "fs").stat().st_size > 4 * 2**20
    b = fs_tier(tmp_path / "fs")
    b.set_share(NS_A, "rule0", 12 * FS_SHARD)
    for first, tier in ((1, a), (1000, b), (2000, a), (3000, b)):
        for i in range(12):
            tier.put(tier_key(first + i), [b"x" * FS_SHARD])
    assert files_of(tmp_path / "fs", NS_A) == 12
    assert _ledger_path(tmp_path / "fs").stat().st_size < 4096


def test_a_ledger_full_of_namespaces_with_files_refuses_a_new_namespace(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Compacting cannot shrink a ledger whose namespaces all hold files: a put of a new namespace into the share
    is refused (share_full) rather than the ledger growing past its limit; a namespace it names still writes."""
    from kvtier.tiers import _share_ledger

    monkeypatch.setattr(_share_ledger, "_MAX_BYTES", 38 + 3 * 33)  # the header and three namespaces
    tier = fs_tier(tmp_path / "fs")
    spaces = [f"{i:032x}" for i in range(1, 5)]
    for namespace in spaces:
        tier.set_share(namespace, "rule0", 100 * FS_SHARD)
    for namespace in spaces[:3]:
        tier.put(tier_key(1, namespace=namespace), [b"x" * FS_SHARD])
    with pytest.raises(QuotaFull):
        tier.put(tier_key(1, namespace=spaces[3]), [b"x" * FS_SHARD])
    tier.put(tier_key(2, namespace=spaces[0]), [b"x" * FS_SHARD])
    assert tier.counters()["share_refused_writes"] == 1 and files_of(tmp_path / "fs", spaces[3]) == 0
    assert _ledger_path(tmp_path / "fs").stat().st_size <= 38 + 3 * 33


def test_namespaces_learned_from_the_ledger_never_push_out_the_processs_own(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The store tells a tier a namespace's share once: however many namespaces other processes' ledgers name,
    the ones this process was told keep their quota (the learned ones are the bounded kind)."""
    monkeypatch.setattr(tier_shares, "RECENT_SECONDS", 0.0)
    monkeypatch.setattr(tier_shares, "_KEPT", 50)
    tier = fs_tier(tmp_path / "fs")
    tier.set_share(NS_A, "rule0", 12 * FS_SHARD)
    tier.put(tier_key(0), [b"a" * FS_SHARD])
    _grow_ledger(tmp_path / "fs", 200)
    other = fs_tier(tmp_path / "fs")
    other.set_share(NS_B, "rule0", 12 * FS_SHARD)
    other.put(tier_key(0, namespace=NS_B), [b"b" * FS_SHARD])  # a new token: the first one learns the ledger again
    for i in range(40):
        tier.put(tier_key(i), [b"x" * FS_SHARD])
    assert files_of(tmp_path / "fs", NS_A) + files_of(tmp_path / "fs", NS_B) == 12


def test_a_put_into_an_unchanged_share_reads_no_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put reads the ledger's token only, unless another process changed the share: then it reads it once."""
    tier, other = fs_tier(tmp_path / "fs"), fs_tier(tmp_path / "fs")
    tier.set_share(NS_A, "rule0", 100 * FS_SHARD)
    other.set_share(NS_A, "rule0", 100 * FS_SHARD)
    tier.put(tier_key(0), [b"x" * FS_SHARD])
    ledger = tier._ledgers.of(tier_shares.share_id("rule0"))
    reads = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: (reads.append(n) if fd == ledger._fd and n > 16 else None,
                                                        pread(fd, n, at))[1])
    for i in range(1, 10):
        tier.put(tier_key(i), [b"x" * FS_SHARD])
    assert reads == []
    other.put(tier_key(100), [b"y" * FS_SHARD])
    tier.put(tier_key(10), [b"x" * FS_SHARD])
    assert len(reads) == 1 and tier.share_bytes("rule0") == 12 * FS_SHARD


def test_telling_a_tier_of_a_share_takes_no_lock_another_process_holds(tmp_path: Path) -> None:
    """``set_share`` runs on the store's request path: a new namespace must not wait for another process's put
    into the same share (its ledger's lock); the namespace joins the ledger at its first put."""
    import fcntl

    tier = fs_tier(tmp_path / "fs")
    tier.set_share(NS_A, "rule0", 100 * FS_SHARD)
    tier.put(tier_key(0), [b"x" * FS_SHARD])
    held = [os.open(p, os.O_RDONLY) for p in (tmp_path / "fs" / ".shares").iterdir()]
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: as another process's put holds it
    try:
        told = threading.Thread(target=tier.set_share, args=(NS_B, "rule0", 100 * FS_SHARD), daemon=True)
        told.start()
        told.join(2)
        assert not told.is_alive()
    finally:
        for fd in held:
            os.close(fd)
    told.join(10)
    tier.put(tier_key(1, namespace=NS_B), [b"y" * FS_SHARD])
    assert NS_B in _ledger_path(tmp_path / "fs").read_text() and tier.share_bytes("rule0") == 2 * FS_SHARD


def test_a_process_killed_between_its_rename_and_its_token_leaves_the_share_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put draws a token no process saw before it evicts or renames: a process killed after its rename, before
    its last token, still makes the others count the share again (they hold it to its quota, not above)."""
    monkeypatch.setattr(tier_shares, "RECENT_SECONDS", 0.0)
    survivor = fs_tier(tmp_path / "fs")
    survivor.set_share(NS_A, "rule0", 12 * FS_SHARD)
    for i in range(12):
        survivor.put(tier_key(i), [b"b" * FS_SHARD])
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            killed = fs_tier(tmp_path / "fs")
            killed.set_share(NS_A, "rule0", 12 * FS_SHARD)
            rename = killed._rename_into_place
            killed._rename_into_place = lambda tmp, key: (rename(tmp, key), os._exit(9))  # type: ignore
            killed.put(tier_key(5000), [b"a" * FS_SHARD])
        finally:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] >> 8 == 9
    for i in range(3):
        survivor.put(tier_key(100 + i), [b"b" * FS_SHARD])
    assert files_of(tmp_path / "fs", NS_A) == 12 == survivor.share_bytes("rule0") // FS_SHARD


def test_a_ledger_rewrite_that_fails_leaves_the_ledger_as_it_was(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A purge's (or a compaction's) rewrite is written aside and renamed over the ledger: failing at the rename
    (as a crash there would) leaves every line of the old one, and the tier goes on holding the share to its quota."""
    tier = fs_tier(tmp_path / "fs")
    for namespace in (NS_A, NS_B):
        tier.set_share(namespace, "rule0", 3 * FS_SHARD)
        tier.put(tier_key(0, namespace=namespace), [b"x" * FS_SHARD])
    before = _ledger_path(tmp_path / "fs").read_text().split("\n")[1:]
    rename = os.rename
    def failing(src: str, dst: str, **kw: Any) -> None:
        if str(src).endswith(".new"):
            raise OSError(28, "No space left on device")
        rename(src, dst, **kw)
    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(TierError):
        tier.remove_records([NS_B])
    assert _ledger_path(tmp_path / "fs").read_text().split("\n")[1:] == before
    assert [p.name for p in (tmp_path / "fs" / ".shares").iterdir() if p.name.endswith(".new")] == []
    monkeypatch.setattr(os, "rename", rename)
    tier.remove_records([NS_B])
    assert NS_B not in _ledger_path(tmp_path / "fs").read_text()
    for i in range(1, 5):
        with contextlib.suppress(QuotaFull):
            tier.put(tier_key(i), [b"x" * FS_SHARD])
    assert tier.share_bytes("rule0") <= 3 * FS_SHARD
