"""The S3 tier's share views (kvtier.tiers._s3_shares) against a bucket kept in a dict: the faults and timings a
real server does not produce on demand (a write still under way while another engine's put lists the share, a
listing that fails, a share object a lifecycle rule removed, a server clock behind this engine's, a write that
fails after its victims were chosen). tests/test_quotas.py runs the same views against SeaweedFS."""

from __future__ import annotations

import time

import pytest

from kvtier.errors import TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.tiers import _s3_shares
from kvtier.tiers._redis_shares import share_id
from kvtier.tiers._s3_shares import S3Shares
from kvtier.tiers.base import StoredObject

NS = "a" * 32
SHARE = "rule0/tenant"


def key(i: int, ns: str = NS) -> ShardKey:
    return ShardKey(ns, f"{i:032x}", HeadRange(0, 1, 1))


class Bucket:
    """Objects by key with their (server) write times, the share objects, and switches for faults."""

    def __init__(self, clock_offset: float = 0.0) -> None:
        self.objects: dict[ShardKey, tuple[int, float]] = {}
        self.members: dict[str, set[str]] = {}
        self.offset = clock_offset  # the server's clock minus ours
        self.listing_fails = False
        self.records = 0

    def now(self) -> float:
        return time.time() + self.offset

    def write(self, k: ShardKey, size: int) -> None:
        self.objects[k] = (size, self.now())

    def shares(self, refresh: float = 0.0) -> S3Shares:
        def members(sid: str) -> tuple[list[str], float | None]:
            if self.listing_fails:
                raise TierError("listing failed: the server timed out")
            return sorted(self.members.get(sid, ())), float(int(self.now()))  # Date: to the second

        def objects(ns: str) -> list[StoredObject]:
            if self.listing_fails:
                raise TierError("listing failed: the server timed out")
            return [StoredObject(k, size, float(int(t)), float(int(t)))  # LastModified: to the second
                    for k, (size, t) in self.objects.items() if k.namespace == ns]

        def record(sid: str, ns: str) -> None:
            self.records += 1
            self.members.setdefault(sid, set()).add(ns)

        return S3Shares(members, objects, record, refresh)


def put(shares: S3Shares, bucket: Bucket, k: ShardKey, size: int, land: bool = True) -> list[ShardKey] | None:
    """A put as the tier does it: None when refused, else the victims it deleted."""
    counted = shares.account(k, size)
    assert counted is not None
    if counted.refused:
        return None
    if land:
        bucket.write(k, size)
    victims = shares.done(k, counted, land)
    for v in victims:
        bucket.objects.pop(v, None)
    return victims


@pytest.fixture
def recent(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(_s3_shares.tenant_shares, "RECENT_SECONDS", 10.0)
    return 10.0


def test_a_write_under_way_stays_counted_through_another_puts_listing(recent: float) -> None:
    """Thread A counts k1 (its PUT still in flight); thread B's put lists the share, which does not hold k1 yet:
    k1 stays counted, so B's object is refused rather than the share passing its quota."""
    bucket = Bucket()
    shares = bucket.shares()
    shares.set(NS, SHARE, 100)
    first = shares.account(key(1), 60)
    assert first is not None and not first.refused  # under way: not in the bucket yet
    second = shares.account(key(2), 60)
    assert second is not None and second.refused
    bucket.write(key(1), 60)
    assert shares.done(key(1), first, True) == []
    assert shares.bytes(SHARE) == 60


def test_a_failed_listing_keeps_the_view_and_the_write_goes_on(recent: float) -> None:
    bucket = Bucket()
    shares = bucket.shares()
    shares.set(NS, SHARE, 100)
    assert put(shares, bucket, key(1), 60) == []
    bucket.listing_fails = True
    assert put(shares, bucket, key(2), 60) is None  # refused from the view as it was: k1 is recent
    assert shares.view_failures == 1


def test_a_share_object_a_lifecycle_rule_removed_is_written_again(recent: float) -> None:
    bucket = Bucket()
    shares = bucket.shares()
    shares.set(NS, SHARE, 1000)
    put(shares, bucket, key(1), 10)
    assert bucket.members[share_id(SHARE)] == {NS}
    bucket.members.clear()  # expired by the bucket's lifecycle rule
    put(shares, bucket, key(2), 10)
    assert bucket.members[share_id(SHARE)] == {NS}


def test_a_server_clock_behind_ours_does_not_make_fresh_objects_look_old(recent: float) -> None:
    """Another engine's objects written just now, listed with a server clock 30 s behind: still recent (so a new
    object is refused, never evicting them); without the listing's Date they would look 29 s old."""
    bucket = Bucket(clock_offset=-30.0)
    other = "b" * 32
    bucket.members[share_id(SHARE)] = {other}
    bucket.write(key(1, other), 60)
    shares = bucket.shares()
    shares.set(NS, SHARE, 100)
    assert put(shares, bucket, key(2), 60) is None
    assert key(1, other) in bucket.objects


def test_victims_are_deleted_only_after_the_write_succeeds(recent: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails deletes nothing, and the view counts its victims again (and not the failed object)."""
    monkeypatch.setattr(_s3_shares.tenant_shares, "RECENT_SECONDS", 0.0)
    bucket = Bucket()
    shares = bucket.shares(refresh=3600.0)  # listed once: the view alone decides
    shares.set(NS, SHARE, 100)
    assert put(shares, bucket, key(1), 60) == []
    assert put(shares, bucket, key(2), 60, land=False) == []  # failed: key(1) would have gone
    assert key(1) in bucket.objects and shares.bytes(SHARE) == 60
    assert put(shares, bucket, key(3), 60) == [key(1)]
    assert shares.bytes(SHARE) == 60


def test_a_shares_view_goes_when_no_namespace_counts_against_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_s3_shares, "_KEPT", 2)
    shares = Bucket().shares()
    for i in range(3):
        shares.set(f"{i:032x}", f"rule0/t{i}", 100)
    assert len(shares._views) == 2  # the first namespace was forgotten, and its share's view with it
    shares.set(f"{1:032x}", None, 0)
    assert len(shares._views) == 1
