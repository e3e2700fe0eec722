"""Placement rules: a tenant's KV reaches only the tiers its rule allows, on put and on promotion; other tenants'
KV reaches every tier; bad rules are refused naming the field; `kvtier cache stats` shows them."""

from __future__ import annotations

from pathlib import Path

import pytest
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
