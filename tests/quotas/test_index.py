"""A disk tier's tenant shares, counted from its own index (kvtier.quotas.index): a tenant past its share evicts its
own files only, the count survives a rescan, and a quota is a reservation against the capacity."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvtier import KVStore, frame
from kvtier.errors import QuotaFull
from kvtier.keys import ShardKey
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.testing.quotas import QuotaConformance, QuotaSubject
from kvtier.testing.tiers import NS_A, NS_B, key as tier_key
from tests.quotas.conftest import FS_SHARD, T, config, files_of, fs_tier, ns, payload_bytes


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


def test_a_disk_share_is_counted_again_after_a_rescan(tmp_path: Path, age) -> None:
    """The tier walks its directory again now and then (other engines write there): the share is counted from
    what the walk finds, and still evicts inside itself."""
    prompts = [synthetic_tokens(30 + i, 2 * T) for i in range(3)]
    file_bytes = payload_bytes() + frame.HEADER_LEN
    with KVStore.from_config(config(tmp_path, {"disk": 4 * file_bytes + 100}, ["disk"])) as store:
        store.put(ns("team-a"), prompts[0], synthetic_kv(prompts[0]))
        store.flush()
        disk = store.tiers[0]
        share = store._tenancy.placement.decide(ns("team-a")).share
        disk._reindex()
        assert disk.share_bytes(share) == 2 * file_bytes
        for p in prompts[1:]:
            age()
            store.put(ns("team-a"), p, synthetic_kv(p))
            store.flush()
        assert disk.share_bytes(share) == 4 * file_bytes
        assert sum(1 for _ in disk.list(ns("team-a").id)) == 4


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


class DiskSubject:
    """The conformance suite's subject: a filesystem tier alone on its directory, driven as the store drives it."""

    size = FS_SHARD

    def __init__(self, path: Path) -> None:
        self.tier = fs_tier(path)

    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        self.tier.set_share(namespace, share, quota_bytes)

    def share_bytes(self, share: str) -> int:
        return self.tier.share_bytes(share)

    def put(self, key: ShardKey) -> bool:
        try:
            self.tier.put(key, [b"x" * self.size])
        except QuotaFull:
            return False
        return True

    def read(self, key: ShardKey) -> bool:
        return self.tier.get(key) is not None

    def delete(self, key: ShardKey) -> None:
        self.tier.delete(key)

    def held(self, namespace: str) -> set[ShardKey]:
        return {o.key for o in self.tier.list(namespace)}


class TestIndexSharesConformance(QuotaConformance):
    @pytest.fixture
    def subject(self, tmp_path: Path, in_use: Callable[[bool], None]) -> Iterator[Callable[[bool], QuotaSubject]]:
        made: list[DiskSubject] = []

        def make(busy: bool) -> QuotaSubject:
            in_use(busy)
            made.append(DiskSubject(tmp_path / f"fs{len(made)}"))
            return made[-1]

        yield make
        for subject in made:
            subject.tier.close()
