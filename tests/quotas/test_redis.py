"""Redis tenant shares, counted in the server over every engine's writes (kvtier.quotas.redis)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import torch

from kvtier import KVStore, quotas
from kvtier.config import load_config
from kvtier.errors import ConfigError, QuotaFull, TierError
from kvtier.keys import HeadRange, ShardKey, chunk_keys
from kvtier.quotas import redis as redis_quotas
from kvtier.store import open_tiers
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.testing.quotas import QuotaConformance, QuotaSubject
from kvtier.tiers.base import Tier
from tests.quotas.conftest import SHARD, T, held, ns, put, redis_config


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
        share = a._tenancy.placement.decide(ns("team-a")).share
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
        share = store._tenancy.placement.decide(ns("team-a")).share
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
        share = store._tenancy.placement.decide(ns("team-a")).share
        assert held(store, "team-a") == 6 and tier.share_bytes(share) == 6 * SHARD  # over, but counted
        monkeypatch.setattr(tier, "_delete", real)
        monkeypatch.setattr(redis_quotas, "_STALE_MS", 100)
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
        share = store._tenancy.placement.decide(ns("team-a")).share
        sid = quotas.share_id(share)
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


class RedisSubject:
    """The conformance suite's subject: a Redis tier under a prefix of its own, driven as the store drives it. Each
    put or read waits a little, so that the server's clock (in ms) orders them."""

    size = 1000

    def __init__(self, tier: Tier) -> None:
        self.tier = tier

    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        self.tier.set_share(namespace, share, quota_bytes)

    def share_bytes(self, share: str) -> int:
        return self.tier.share_bytes(share)

    def put(self, key: ShardKey) -> bool:
        try:
            self.tier.put(key, [b"x" * self.size])
        except QuotaFull:
            return False
        finally:
            time.sleep(0.003)
        return True

    def read(self, key: ShardKey) -> bool:
        found = self.tier.get(key) is not None
        time.sleep(0.003)
        return found

    def delete(self, key: ShardKey) -> None:
        self.tier.delete(key)

    def held(self, namespace: str) -> set[ShardKey]:
        return {o.key for o in self.tier.list(namespace)}


class TestRedisSharesConformance(QuotaConformance):
    @pytest.fixture
    def subject(self, redis_server: Any, in_use: Callable[[bool], None]) -> Iterator[Callable[[bool], QuotaSubject]]:
        made: list[Tier] = []

        def make(busy: bool) -> QuotaSubject:
            in_use(busy)
            cfg = {"tiers": [{"type": "redis", "name": "shared", **redis_server.tier_options(),
                              "key_prefix": f"q{uuid.uuid4().hex[:12]}:"}]}
            made.extend(open_tiers(load_config(cfg)))
            return RedisSubject(made[-1])

        yield make
        for tier in made:
            tier.close()
