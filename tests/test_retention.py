"""Retention: every tier type takes ``ttl_seconds``, no tier serves a shard older than it (checked on read, whatever
the tier does itself), and `kvtier cache retain` removes what is past it where a tier's listing has times, with an
audit record."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from kvtier import KVStore, Namespace, frame
from kvtier.cli import main
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.keys import ShardKey, chunk_keys, rank_heads
from kvtier.testing import synthetic_kv, synthetic_tokens

T = 16
NS = Namespace(model="m", dtype="bfloat16")


def tier_config(kind: str, request: pytest.FixtureRequest, tmp_path: Path, prefix: str, **options: object) -> dict:
    if kind == "filesystem":
        return {"type": "filesystem", "name": "t", "path": str(tmp_path / "fs"), **options}
    server = request.getfixturevalue({"redis": "redis_server", "s3": "s3_server", "mooncake": "mooncake_server"}[kind])
    key = "prefix" if kind == "s3" else "key_prefix"
    return {"type": kind, "name": "t", **server.tier_options(), key: prefix, **options}


def store_config(tier: dict, **extra: object) -> dict:
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "8MiB", "page_bytes": "16KiB"}, "tiers": [tier], **extra}


@pytest.mark.parametrize("kind", ["filesystem", "redis", "s3", "mooncake"])
def test_no_tier_serves_a_shard_past_its_ttl(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
                                            unique_prefix: str) -> None:
    old_tokens, new_tokens = synthetic_tokens(1, 2 * T), synthetic_tokens(2, 2 * T)
    old_kv, new_kv = synthetic_kv(old_tokens), synthetic_kv(new_tokens)
    cfg = store_config(tier_config(kind, request, tmp_path, unique_prefix, ttl_seconds=3600))
    with KVStore.from_config(cfg) as store:
        store.put(NS, new_tokens, new_kv)
        store.flush()
        tier = store.tiers[0]
        heads = rank_heads(old_kv.shape[2], 0, 1)
        meta = frame.ShardMeta(old_kv.shape[0], T, old_kv.shape[4], old_kv.dtype, heads)
        for i, chunk in enumerate(chunk_keys(NS, old_tokens, T)):  # written two hours ago, by the header
            key = ShardKey(NS.id, chunk.hex(), heads)
            payload = old_kv[:, :, :, i * T:(i + 1) * T].contiguous().view(torch.uint8).numpy().tobytes()
            tier.put(key, [frame.encode_header(key, meta, [payload], created=time.time() - 7200) + payload])
        store.drop_dram()
        assert store.get(NS, old_tokens) is None
        stats = store.stats()["t"]
        # the store's check, or the filesystem tier's own expiry (it reads the header's time too)
        assert stats["expired_objects_total"] + stats.get("tier_events_total{event=expired}", 0) >= 1
        assert not tier.exists(ShardKey(NS.id, chunk_keys(NS, old_tokens, T)[0].hex(), heads))  # removed
        assert torch.equal(store.get(NS, new_tokens), new_kv)


def test_retain_removes_from_s3_what_is_past_the_ttl_and_records_it(request: pytest.FixtureRequest,
                                                                   tmp_path: Path, unique_prefix: str,
                                                                   capsys) -> None:
    """S3 has no expiry of its own (the filesystem and Redis tiers expire by themselves)."""
    tokens = synthetic_tokens(3, 3 * T)
    # ttl 3 s: the fresh object must stay younger than it until retain has listed (slow under a loaded CI)
    tier = tier_config("s3", request, tmp_path, unique_prefix, ttl_seconds=3)
    cfg = store_config(tier, audit_log=str(tmp_path / "audit.log"))
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with KVStore.from_config(store_config(dict(tier, ttl_seconds=None))) as store:  # no expiry of its own meanwhile
        store.put(NS, tokens, synthetic_kv(tokens))
    time.sleep(3.5)
    with KVStore.from_config(store_config(dict(tier, ttl_seconds=None))) as store:
        fresh = synthetic_tokens(4, T)
        store.put(NS, fresh, synthetic_kv(fresh))
    assert main(["cache", "retain", "--config", str(path)]) == 0
    assert "tier t: removed 3 objects" in capsys.readouterr().out
    with KVStore.from_config(store_config(dict(tier, ttl_seconds=None))) as store:
        assert len(list(store.tiers[0].list())) == 1  # the fresh one
    records = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
    assert [(r["action"], r["objects"], r["ttl_seconds"]) for r in records] == [("retain-start", 3, 3),
                                                                                ("retain", 3, 3)]


def test_retain_says_what_it_cannot_do(mooncake_server, tmp_path: Path, unique_prefix: str, capsys) -> None:
    tiers = [{"type": "mooncake", "name": "mc", **mooncake_server.tier_options(), "key_prefix": unique_prefix,
              "ttl_seconds": 60},
             {"type": "filesystem", "name": "plain", "path": str(tmp_path / "fs")}]
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"chunk_tokens": T, "tiers": tiers}))
    assert main(["cache", "retain", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tier mc: its listing has no write times" in out and "tier plain: no ttl_seconds" in out


@pytest.mark.parametrize("kind", ["s3", "mooncake"])
@pytest.mark.parametrize("ttl", [0, -1, float("inf")])
def test_a_bad_ttl_is_refused_naming_the_field(kind: str, ttl: float) -> None:
    options = {"s3": {"bucket": "b"}, "mooncake": {"master": "h:1", "metadata_server": "http://h:2/metadata"}}[kind]
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.ttl_seconds: (must be a positive number|expected float)"):
        from kvtier.store import open_tiers

        open_tiers(load_config({"tiers": [{"type": kind, **options, "ttl_seconds": ttl}]}))


@pytest.mark.parametrize("created", [time.time() + 10 * 365 * 86400, float("inf"), float("nan")],
                         ids=["in-ten-years", "inf", "nan"])  # (ids fixed: every xdist worker collects the same)
def test_a_shard_from_the_future_or_of_no_time_is_expired(created: float, tmp_path: Path) -> None:
    """A forged or broken clock cannot keep a shard alive forever (the filesystem tier's own expiry takes such a
    time as now, so only the store's check catches it)."""
    tokens = synthetic_tokens(5, T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(store_config({"type": "filesystem", "name": "t", "path": str(tmp_path / "fs"),
                                           "ttl_seconds": 3600})) as store:
        heads = rank_heads(kv.shape[2], 0, 1)
        key = ShardKey(NS.id, chunk_keys(NS, tokens, T)[0].hex(), heads)
        meta = frame.ShardMeta(kv.shape[0], T, kv.shape[4], kv.dtype, heads)
        payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
        store.tiers[0].put(key, [frame.encode_header(key, meta, [payload], created=created) + payload])
        assert store.get(NS, tokens) is None
        assert store.stats()["t"]["expired_objects_total"] == 1


def test_a_redis_listing_gives_the_time_since_last_use(redis_server, unique_prefix: str, tmp_path: Path) -> None:
    """Reading a hash's fields to list it is an access: the idle time is asked first (else every object would
    look just used, and `purge --older-than` would never select one). The listing itself still counts as a use
    for the next one (Redis 7.0 has no CLIENT NO-TOUCH)."""
    tokens = synthetic_tokens(6, T)
    tier = {"type": "redis", "name": "t", **redis_server.tier_options(), "key_prefix": unique_prefix}
    with KVStore.from_config(store_config(tier)) as store:
        store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
        time.sleep(2.2)
        (listed,) = list(store.tiers[0].list())
        assert time.time() - listed.last_used >= 2


@pytest.mark.parametrize("how", ["promoted", "put"])
def test_dram_serves_no_shard_past_its_tiers_ttl(how: str, tmp_path: Path) -> None:
    """A DRAM entry expires with the object it came from (its write time plus the ttl_seconds of its tier): a
    shard promoted a second before its tier's TTL, or put into a store whose tier keeps it a second, is a miss
    from then on, in DRAM as on the tier."""
    tokens = synthetic_tokens(7, T)
    kv = synthetic_kv(tokens)
    ttl = 3600.0 if how == "promoted" else 1.0
    with KVStore.from_config(store_config({"type": "filesystem", "name": "t", "path": str(tmp_path / "fs"),
                                           "ttl_seconds": ttl})) as store:
        if how == "promoted":
            heads = rank_heads(kv.shape[2], 0, 1)
            key = ShardKey(NS.id, chunk_keys(NS, tokens, T)[0].hex(), heads)
            meta = frame.ShardMeta(kv.shape[0], T, kv.shape[4], kv.dtype, heads)
            payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
            created = time.time() - ttl + 1.0
            store.tiers[0].put(key, [frame.encode_header(key, meta, [payload], created=created) + payload])
        else:
            created = time.time()
            store.put(NS, tokens, kv)
        assert torch.equal(store.get(NS, tokens), kv)  # in DRAM now
        assert len(store.dram) == 1
        time.sleep(max(0.0, created + ttl - time.time()) + 0.05)
        assert store.get(NS, tokens) is None
        assert len(store.dram) == 0


def two_tiers(tmp_path: Path, front_ttl: float | None, back_ttl: float | None) -> dict:
    tiers = [{"type": "filesystem", "name": name, "path": str(tmp_path / name), "ttl_seconds": ttl}
             for name, ttl in (("front", front_ttl), ("back", back_ttl))]
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "8MiB", "page_bytes": "16KiB"}, "tiers": tiers}


def test_a_shard_promoted_from_a_tier_without_ttl_stays_in_dram_and_skips_a_front_tier_past_its_ttl(
        tmp_path: Path) -> None:
    """A promoted entry expires with its source tier (the back one keeps it for good here), not with the shortest
    TTL of all tiers: it was once expired on arrival, so every get read the back tier again, promoted it again and
    rewrote it to the front tier, which its age already put past that tier's TTL."""
    tokens = synthetic_tokens(8, T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(two_tiers(tmp_path, 5, None)) as store:
        heads = rank_heads(kv.shape[2], 0, 1)
        key = ShardKey(store.named(NS).id, chunk_keys(store.named(NS), tokens, T)[0].hex(), heads)
        meta = frame.ShardMeta(kv.shape[0], T, kv.shape[4], kv.dtype, heads)
        payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
        store.tiers[1].put(key, [frame.encode_header(key, meta, [payload], created=time.time() - 10) + payload])
        for _ in range(4):
            assert torch.equal(store.get(NS, tokens), kv)
            store.flush()
        stats = store.stats()
        assert stats["back"]["promotions_total"] == 1  # then DRAM hits
        assert stats["front"].get("written_bytes_total", 0) == 0 and not store.tiers[0].exists(key)


@pytest.mark.parametrize("front_ttl, back_ttl, lasts", [(1, None, None), (5, 3600, 3600)])
def test_a_put_stays_in_dram_as_long_as_the_longest_ttl_of_its_tiers(tmp_path: Path, front_ttl: float,
                                                                    back_ttl: float | None,
                                                                    lasts: float | None) -> None:
    """Its KV is lawfully kept on some tier until the longest TTL of those it reaches (for good if one has none)."""
    tokens = synthetic_tokens(9, T)
    with KVStore.from_config(two_tiers(tmp_path, front_ttl, back_ttl)) as store:
        before = time.time()
        store.put(NS, tokens, synthetic_kv(tokens))
        (entry,) = store.dram._by_key.values()
        assert entry.expires == lasts if lasts is None else before + lasts <= entry.expires <= time.time() + lasts
