"""Placement rules: a tenant's KV reaches only the tiers its rule allows, on put and on promotion, and lookups and
reads ask only those tiers; other tenants' KV reaches every tier; bad rules are refused naming the field; `kvtier
cache stats` shows them."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
import torch

from kvtier import KVStore, Namespace
from kvtier.cli import main
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.testing import synthetic_kv, synthetic_tokens

T = 16


def config(tmp_path: Path, *tiers: str, placement: list | None = None) -> dict:
    cfg: dict = {"chunk_tokens": T, "dram": {"capacity_bytes": "8MiB", "page_bytes": "16KiB"},
                 "tiers": [{"type": "filesystem", "name": name, "path": str(tmp_path / name), "queue_depth": 4096}
                           for name in tiers]}
    if placement is not None:
        cfg["placement"] = placement
    return cfg


def files(path: Path) -> int:
    return sum(1 for _ in path.rglob("*.kv")) if path.exists() else 0


def ns(salt: str | None) -> Namespace:
    return Namespace(model="m", dtype="bfloat16", cache_salt=salt)


def test_a_tenant_kept_in_dram_reaches_no_tier_and_others_reach_every_tier(tmp_path: Path) -> None:
    rules = [{"salt": "bank-*", "tiers": []}, {"salt": "internal-*", "tiers": ["disk"]}]
    tokens = synthetic_tokens(1, 3 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path, "disk", "shared", placement=rules)) as store:
        for salt in ("bank-1", "internal-7", "public", None):
            store.put(ns(salt), tokens, kv)
        store.flush()
        # bank-1: DRAM only; internal-7: disk only; public and no salt: both tiers
        assert files(tmp_path / "disk") == 3 * 3 and files(tmp_path / "shared") == 3 * 2
        withheld = store.stats()
        assert withheld["disk"]["placement_withheld_total"] == 3
        assert withheld["shared"]["placement_withheld_total"] == 6
        assert torch.equal(store.get(ns("bank-1"), tokens), kv)  # served from DRAM as before
    with KVStore.from_config(config(tmp_path, "disk", "shared", placement=rules)) as store:  # a restart
        assert store.get(ns("bank-1"), tokens) is None  # nothing of it persisted anywhere
        assert torch.equal(store.get(ns("internal-7"), tokens), kv)
        assert torch.equal(store.get(ns("public"), tokens), kv)


def test_a_promoted_chunk_is_not_copied_into_a_tier_its_rule_forbids(tmp_path: Path) -> None:
    """KV read from a back tier is copied into the tiers in front of it, unless the rule keeps it out."""
    tokens = synthetic_tokens(2, 2 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path, "archive")) as store:  # written before the rule existed
        store.put(ns("bank-1"), tokens, kv)
        store.put(ns("public"), tokens, kv)
        store.flush()
    rules = [{"salt": "bank-*", "tiers": ["archive"]}]
    with KVStore.from_config(config(tmp_path, "disk", "archive", placement=rules)) as store:
        assert torch.equal(store.get(ns("bank-1"), tokens), kv)
        assert torch.equal(store.get(ns("public"), tokens), kv)
        store.flush()
        assert files(tmp_path / "disk") == 2  # public's two chunks were promoted into disk; bank-1's were not


@pytest.mark.parametrize("rules, message", [
    ({"salt": "x"}, r"placement: expected a list"),
    ([{"tiers": []}, {"salt": "a*", "tiers": []}], r"placement\[0\]: give 'salt'"),
    ([{1: 2, "x": 3}], r"placement\[0\]\.1: unknown key"),
    ([{"salt": "a*", "tiers": ["nope"]}], r"placement\[0\]\.tiers: no tier is named 'nope'; the tiers are dram, disk"),
    ([{"salt": "a*"}], r"placement\[0\]\.tiers: required"),
    ([{"salt": "", "tiers": []}], r"placement\[0\]\.salt"),
    ([{"namespace": "XYZ", "tiers": []}], r"placement\[0\]\.namespace: a namespace id"),
    ([{"salt": "a*", "tiers": [], "tenant": 1}], r"placement\[0\]\.tenant: unknown key"),
])
def test_bad_rules_are_refused_naming_the_field(tmp_path: Path, rules: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(config(tmp_path, "disk", placement=rules))  # type: ignore[arg-type]


def test_a_namespace_rule_and_the_stats_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = ns("public")
    rules = [{"namespace": target.id, "tiers": []}, {"salt": "internal-*", "tiers": ["disk"]}]
    cfg = config(tmp_path, "disk", placement=rules)
    tokens = synthetic_tokens(3, T)
    with KVStore.from_config(cfg) as store:
        store.put(target, tokens, synthetic_kv(tokens))
        store.put(ns("other"), tokens, synthetic_kv(tokens))
        store.flush()
    assert files(tmp_path / "disk") == 1
    path = tmp_path / "kvtier.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    assert main(["cache", "stats", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"namespace {target.id}: dram" in out and "salt 'internal-*': dram, disk" in out


def test_a_default_rule_places_unsalted_requests_and_every_other_tenant(tmp_path: Path) -> None:
    """The last rule may name neither salt nor namespace: all other KV, requests without a salt included (a
    salt comes from the client; without the default, a request that leaves it out would reach every tier)."""
    rules = [{"salt": "public-*", "tiers": ["disk", "shared"]}, {"tiers": ["disk"]}]
    tokens = synthetic_tokens(4, T)
    with KVStore.from_config(config(tmp_path, "disk", "shared", placement=rules)) as store:
        for salt in ("public-1", None, "anyone"):
            store.put(ns(salt), tokens, synthetic_kv(tokens))
        store.flush()
    assert files(tmp_path / "disk") == 3 and files(tmp_path / "shared") == 1


def test_a_share_is_named_by_what_its_rule_matches_not_by_its_place(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule inserted above another (or a quota raised) keeps each tenant in its own share: the disk's share
    ledgers outlive the config, and naming a share by its rule's position once made tenant B's puts evict tenant
    A's files, A being within its own quota."""
    from kvtier import quotas as tier_shares

    monkeypatch.setattr(tier_shares, "RECENT_SECONDS", 0.0)  # any file of a share past its quota may go

    def store(rules: list, quota: int) -> KVStore:
        rules = [dict(rule, tiers=["disk"], quota={"disk": quota}) for rule in rules] + [{"tiers": ["disk"]}]
        return KVStore.from_config(config(tmp_path, "disk", placement=rules))

    with store([{"salt": "team-a"}], 2**30) as v1:
        for i in range(4):
            tokens = synthetic_tokens(60 + i, T)
            v1.put(ns("team-a"), tokens, synthetic_kv(tokens))
        v1.flush()
        a_share = v1._tenancy.placement.decide(ns("team-a")).share
    size = next((tmp_path / "disk").rglob("*.kv")).stat().st_size
    with store([{"salt": "team-b"}, {"salt": "team-a"}], 4 * size + size // 2) as v2:  # inserted above; quota cut
        assert v2._tenancy.placement.decide(ns("team-a")).share == a_share
        assert v2._tenancy.placement.decide(ns("team-b")).share != a_share
        for i in range(4):
            tokens = synthetic_tokens(70 + i, T)
            v2.put(ns("team-b"), tokens, synthetic_kv(tokens))
        v2.flush()
        a_id, b_id = (v2.named(ns(s)).id for s in ("team-a", "team-b"))
    assert files(tmp_path / "disk" / a_id) == 4 and files(tmp_path / "disk" / b_id) == 4


class _Monitor:
    """Every command a Redis server receives while the block runs (MONITOR), read up to a marker sent at its end:
    nothing is missed and nothing is waited for by time."""

    def __init__(self, url: str) -> None:
        self._client = redis.Redis.from_url(url, socket_timeout=30)
        self.commands: list[str] = []

    def __enter__(self) -> _Monitor:
        self._monitor = self._client.monitor().__enter__()  # returns once the server answered OK: watching
        return self

    def __exit__(self, *exc: object) -> None:
        marker = f"end-{uuid.uuid4().hex}"
        self._client.echo(marker)
        try:
            while marker not in (command := self._monitor.next_command()["command"]):
                self.commands.append(command)
        finally:
            self._monitor.__exit__()
            self._client.close()

    def naming(self, namespace: str) -> list[str]:
        return [c for c in self.commands if namespace in c]


def _asked(tier: object, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The namespaces a tier is asked about from now on, by lookups (heads) and reads (get, get_into)."""
    asked: list[str] = []
    for name in ("heads", "get", "get_into"):
        real = getattr(tier, name)

        def record(first, *args, real=real, **kw):
            asked.append(first if isinstance(first, str) else first.namespace)
            return real(first, *args, **kw)

        monkeypatch.setattr(tier, name, record)
    return asked


def test_lookups_and_reads_ask_only_the_tiers_a_tenant_may_be_in(tmp_path: Path, redis_server, unique_prefix: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A DRAM-only tenant's lookups and gets send nothing to any tier, in DRAM or not; a tenant placed on the disk
    alone is never asked about in Redis (MONITOR shows every command the server got); others are asked in both."""
    cfg = config(tmp_path, "disk", placement=[{"salt": "bank-*", "tiers": []}, {"salt": "internal-*",
                                                                                "tiers": ["disk"]}])
    cfg["tiers"].append({"type": "redis", "name": "redis", **redis_server.tier_options(), "key_prefix": unique_prefix})
    tokens = synthetic_tokens(5, 2 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(cfg) as store:
        bank, internal, public = (store.named(ns(s)).id for s in ("bank-1", "internal-7", "public"))
        for salt in ("bank-1", "internal-7", "public"):
            store.put(ns(salt), tokens, kv)
        store.flush()
        disk = _asked(store.tiers[0], monkeypatch)
        with _Monitor(redis_server.url) as seen:
            for dropped in (False, True):  # served from DRAM; then DRAM dropped: found on the tiers, or not at all
                if dropped:
                    store.drop_dram()
                assert store.lookup(ns("bank-1"), tokens + [1]) == (0 if dropped else 2 * T)
                got = store.get(ns("bank-1"), tokens)
                assert got is None if dropped else torch.equal(got, kv)
                for salt in ("internal-7", "public"):
                    store.drop_dram()
                    assert store.lookup(ns(salt), tokens + [1]) == 2 * T
                    assert torch.equal(store.get(ns(salt), tokens), kv)
        assert seen.naming(bank) == [] and bank not in disk  # DRAM only: no tier heard of it
        assert seen.naming(internal) == [] and internal in disk  # the disk only
        assert seen.naming(public) and public in disk  # every tier (the store's disk hits; Redis still asked)
