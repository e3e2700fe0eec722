"""Per-tenant quotas across every keeper (kvtier.quotas): the rules themselves, a rule is one share however many
salts it matches, a prompt larger than a share keeps its leading chunks on every tier, a purge leaves nothing that
names the namespace, and quotas on tiers that cannot keep them are refused naming the field."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import KVStore, Namespace, quotas
from kvtier.errors import ConfigError
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.quotas.conftest import (SHARD, T, chunk_bytes, config, held, listed_age, mooncake_config, ns, put,
                                   redis_config, s3_config)


# -- the rules, decided without I/O -----------------------------------------------------------------------------
def test_a_new_object_is_refused_only_when_the_objects_in_use_leave_it_no_room() -> None:
    assert not quotas.refuses(40, 100, [30, 30])
    assert quotas.refuses(40, 100, [30, 31])
    assert quotas.refuses(101, 100, [])  # larger than the whole share: nothing could make room
    seen: list[int] = []
    assert quotas.refuses(60, 100, (seen.append(n) or n for n in [50, 50, 50]))
    assert seen == [50]  # read only as far as needed


def test_victims_are_the_least_recently_used_evictable_objects_until_the_share_fits() -> None:
    sizes = {"a": 10, "b": 20, "c": 30, "d": 40}
    assert quotas.victims("abcd", 25, sizes.__getitem__, lambda k: k != "b") == (["a", "c"], -15)
    assert quotas.victims("abcd", 0, sizes.__getitem__, lambda k: True) == ([], 0)
    assert quotas.victims("abcd", 500, sizes.__getitem__, lambda k: k == "d") == (["d"], 460)  # not enough


def test_usage_counts_units_and_orders_objects_per_share() -> None:
    usage: quotas.Usage[str] = quotas.Usage()
    for key in "abc":
        usage.add("s", key)
    usage.charge("s", 3)
    usage.touch("s", "a")
    usage.add("s", "b")  # again: the most recent
    assert list(usage.oldest("s")) == ["c", "a", "b"] and usage.units("s") == 3
    usage.discard("s", "c")
    usage.charge("s", -3)
    assert usage.totals() == {} and usage.holds("s", "a") and not usage.holds("t", "a")
    usage.replace("s", ["b"])
    assert list(usage.oldest("s")) == ["b"]
    usage.drop("s")
    assert list(usage.oldest("s")) == [] and usage.units("s") == 0


def test_a_share_is_named_by_a_digest_where_a_tier_keeps_it() -> None:
    """The store's share name holds the tenant's salt: a tier sees a digest of it, the same in every process."""
    sid = quotas.share_id("rule0/team-a")
    assert sid == quotas.share_id("rule0/team-a") != quotas.share_id("rule0/team-b")
    assert len(sid) == 32 and "team" not in sid


# -- through the store ------------------------------------------------------------------------------------------
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
    from kvtier.tiers.filesystem import FilesystemTier

    class NoShares(FilesystemTier):
        shares = False

    monkeypatch.setitem(TIERS._entries, "no-shares-test", NoShares)
    cfg = {"tiers": [{"type": "no-shares-test", "name": "plain", "path": str(tmp_path / "d")}],
           "placement": [{"salt": "t-*", "tiers": ["plain"], "quota": {"plain": "1GiB"}}]}
    with pytest.raises(ConfigError, match=r"placement\[0\]\.quota\.plain: the NoShares keeps no per-tenant quotas "
                                          r".*quotas apply to dram, filesystem, redis, s3 and mooncake tiers"):
        KVStore.from_config(cfg)


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
    default, quotas.RECENT_SECONDS = quotas.RECENT_SECONDS, recent
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
        quotas.RECENT_SECONDS = default


def test_a_salt_hopping_client_is_capped_by_its_rules_share(tmp_path: Path) -> None:
    """Every salt a rule matches counts against the rule's one share: a client that sends each prompt under a new
    salt holds no more than the quota, in DRAM and on disk."""
    with KVStore.from_config(config(tmp_path, {"dram": 4 * chunk_bytes(), "disk": 4 * SHARD + 100},
                                    ["disk"])) as store:
        for i in range(5):
            tokens = synthetic_tokens(80 + i, 2 * T)
            put(store, f"team-hop{i}", tokens)
        assert sum(held(store, f"team-hop{i}") for i in range(5)) == 4
        share = store._tenancy.placement.decide(ns("team-hop0")).share
        assert share == store._tenancy.placement.decide(ns("team-hop4")).share
        assert store.dram.share_bytes(share) <= 4 * chunk_bytes()


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
