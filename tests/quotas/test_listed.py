"""The S3 and Mooncake tiers' share views (kvtier.quotas.listed) against a bucket kept in a dict: the faults and
timings a real server does not produce on demand (a write still under way, or landing, while another put lists the
share; a listing that fails; a share object a lifecycle rule removed; a server clock behind this engine's; a write
that fails after its victims were chosen; two puts of one key; a victim listed again before its delete). The puts
are interleaved by hand, as writer threads would. The same views against SeaweedFS and Mooncake, through the
store, are at the end."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier import KVStore, Namespace, quotas
from kvtier.errors import ConfigError, QuotaFull, TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas import listed as listed_shares, share_id
from kvtier.quotas.listed import ListedShares
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.testing.quotas import QuotaConformance, QuotaSubject
from kvtier.tiers.base import StoredObject
from tests.quotas.conftest import SHARD, T, held, listed_age, mooncake_config, ns, put as put_flushed, s3_config


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
        self.during_listing: list = []  # run once, each, while the next listing reads the objects

    def now(self) -> float:
        return time.time() + self.offset

    def write(self, k: ShardKey, size: int) -> None:
        self.objects[k] = (size, self.now())

    def shares(self, refresh: float = 0.0, times: bool = True) -> ListedShares:
        def members(sid: str) -> tuple[list[str], float | None]:
            if self.listing_fails:
                raise TierError("listing failed: the server timed out")
            return sorted(self.members.get(sid, ())), float(int(self.now())) - time.time()  # Date: to the second

        def objects(ns: str) -> list[StoredObject]:
            if self.listing_fails:
                raise TierError("listing failed: the server timed out")
            found = [StoredObject(k, size, float(int(t)), float(int(t)))  # LastModified: to the second
                     for k, (size, t) in self.objects.items() if k.namespace == ns]
            while self.during_listing:
                self.during_listing.pop(0)()
            return found

        def record(sid: str, ns: str) -> None:
            self.records += 1
            self.members.setdefault(sid, set()).add(ns)

        return ListedShares(members, objects, record, refresh, times=times)

    def put(self, shares: ListedShares, k: ShardKey, size: int, fail_deletes: bool = False) -> None:
        """A put as a tier makes it (:meth:`ListedShares.write`), deleting victims from the dict."""
        def delete(victim: ShardKey) -> bool:
            if fail_deletes:
                raise OSError("the server went away mid-delete")
            return self.objects.pop(victim, None) is not None

        shares.write("dict", k, size, lambda: self.write(k, size), delete)


def put(shares: ListedShares, bucket: Bucket, k: ShardKey, size: int, land: bool = True) -> list[ShardKey] | None:
    """A put as the tier does it: None when refused, else the victims it deleted."""
    counted = shares.account(k, size)
    assert counted is not None
    if counted.refused:
        return None
    if land:
        bucket.write(k, size)
    return finish(shares, bucket, k, counted, land)


def finish(shares: ListedShares, bucket: Bucket, k: ShardKey, counted, written: bool) -> list[ShardKey]:
    """The end of a put :meth:`ListedShares.account` counted: its victims deleted."""
    victims = shares.done(k, counted, written)
    for v in victims:
        bucket.objects.pop(v, None)
    shares.evicted(counted, victims)
    return victims


@pytest.fixture
def recent(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 10.0)
    return 10.0


def test_a_write_under_way_stays_counted_through_another_puts_listing(recent: float) -> None:
    """Thread A counts k1 (its PUT still in flight); thread B's put lists the share, which does not hold k1 yet:
    k1 stays counted, so B's object is refused rather than the share passing its quota."""
    bucket = Bucket()
    shares = bucket.shares()
    shares.set(NS, SHARE, 100)
    first = shares.account(key(1), 60)
    assert first is not None and not first.refused  # under way: not in the bucket yet
    time.sleep(0.01)  # the second listing starts after the first write was counted
    second = shares.account(key(2), 60)
    assert second is not None and second.refused
    bucket.write(key(1), 60)
    assert finish(shares, bucket, key(1), first, True) == []
    assert shares.bytes(SHARE) == 60


def test_a_write_landing_while_another_put_lists_stays_counted(recent: float) -> None:
    """k1's write lands (and ends) while k2's put lists the share, after the listing read k1's namespace: k1 is
    neither listed nor under way any more, and stays counted, so k2 is refused."""
    bucket = Bucket()
    shares = bucket.shares()
    shares.set(NS, SHARE, 100)
    first = shares.account(key(1), 60)
    time.sleep(0.01)

    def land() -> None:
        bucket.write(key(1), 60)
        finish(shares, bucket, key(1), first, True)

    bucket.during_listing.append(land)
    assert put(shares, bucket, key(2), 60) is None
    assert shares.bytes(SHARE) == 60


def test_a_namespace_told_its_share_again_keeps_the_view(recent: float) -> None:
    """The store may tell a tier a namespace's share again (two first requests at once): a write under way stays
    counted."""
    bucket = Bucket()
    shares = bucket.shares(refresh=3600.0)
    shares.set(NS, SHARE, 100)
    first = shares.account(key(1), 60)
    shares.set(NS, SHARE, 100)
    assert put(shares, bucket, key(2), 60) is None
    bucket.write(key(1), 60)
    finish(shares, bucket, key(1), first, True)


@pytest.mark.parametrize("failing, first_to_end", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_two_puts_of_one_key_leave_it_counted_when_one_fails(recent: float, failing: int, first_to_end: int) \
        -> None:
    bucket = Bucket()
    shares = bucket.shares(refresh=3600.0)
    shares.set(NS, SHARE, 100)
    puts = [shares.account(key(1), 60), shares.account(key(1), 60)]
    for i in (first_to_end, 1 - first_to_end):
        if i != failing:
            bucket.write(key(1), 60)
        finish(shares, bucket, key(1), puts[i], i != failing)
    assert shares.bytes(SHARE) == 60


def test_puts_waiting_on_a_listing_share_the_next_one(recent: float) -> None:
    """With ``share_refresh_seconds: 0``, puts that arrive while a listing runs wait for it; the next listing
    then serves every one of them that arrived before it began, not one listing each."""
    import threading

    bucket = Bucket()
    shares = bucket.shares()
    shares.set(NS, SHARE, 10_000)
    listings = []
    members = shares._members

    def counted(sid: str):
        listings.append(sid)
        return members(sid)

    shares._members = counted
    release = threading.Event()
    bucket.during_listing.append(lambda: release.wait(10))
    bucket.objects[key(0)] = (1, bucket.now())  # so the listing reads objects (and waits there)
    threads = [threading.Thread(target=put, args=(shares, bucket, key(i), 10)) for i in (1, 2, 3)]
    threads[0].start()
    time.sleep(0.2)
    for t in threads[1:]:
        t.start()
    time.sleep(0.2)
    release.set()
    for t in threads:
        t.join(10)
    assert len(listings) == 2


def test_a_victim_listed_again_before_its_delete_is_not_counted_or_chosen_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.0)
    bucket = Bucket()
    bucket.members[share_id(SHARE)] = {NS}
    bucket.objects[key(1)] = (60, bucket.now() - 100)  # written long ago (by any engine)
    bucket.objects[key(2)] = (60, bucket.now() - 90)
    shares = bucket.shares()
    shares.set(NS, SHARE, 120)
    first = shares.account(key(3), 60)  # key(1) chosen; its delete waits for this write
    assert list(first.victims) == [key(1)]
    second = shares.account(key(4), 60)  # lists the bucket, which still holds key(1)
    assert list(second.victims) == [key(2)]
    bucket.write(key(3), 60)
    bucket.write(key(4), 60)
    assert finish(shares, bucket, key(3), first, True) == [key(1)]
    assert finish(shares, bucket, key(4), second, True) == [key(2)]
    assert shares.evictions == 2 and shares.bytes(SHARE) == 120


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
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.0)
    bucket = Bucket()
    shares = bucket.shares(refresh=3600.0)  # listed once: the view alone decides
    shares.set(NS, SHARE, 100)
    assert put(shares, bucket, key(1), 60) == []
    assert put(shares, bucket, key(2), 60, land=False) == []  # failed: key(1) would have gone
    assert key(1) in bucket.objects and shares.bytes(SHARE) == 60
    assert put(shares, bucket, key(3), 60) == [key(1)]
    assert shares.bytes(SHARE) == 60


def test_a_shares_view_goes_when_no_namespace_counts_against_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listed_shares, "_KEPT", 2)
    shares = Bucket().shares()
    for i in range(3):
        shares.set(f"{i:032x}", f"rule0/t{i}", 100)
        shares.used(key(0, f"{i:032x}"))  # a read: the share's view is made
    assert len(shares._views) == 2  # the first namespace was forgotten, and its share's view with it
    shares.set(f"{1:032x}", None, 0)
    assert len(shares._views) == 1


def test_a_view_no_put_or_read_used_for_ten_minutes_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = Bucket()
    shares = bucket.shares()
    shares.set(NS, SHARE, 100)
    put(shares, bucket, key(1), 10)
    assert len(shares._views) == 1
    monkeypatch.setattr(listed_shares, "_IDLE_SECONDS", 0.05)
    monkeypatch.setattr(listed_shares, "_SWEEP_EVERY", 0.0)
    time.sleep(0.1)
    other = "c" * 32
    shares.set(other, "rule0/other", 100)
    put(shares, bucket, key(1, other), 10)  # sweeps: the first view goes
    assert list(shares._views) == [share_id("rule0/other")]
    assert put(shares, bucket, key(2), 10) == [] and shares.bytes(SHARE) == 20  # listed anew when needed


def test_without_listed_times_another_engines_objects_age_from_their_first_listing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake lists no times: an object another engine wrote long ago counts as used when this engine first
    listed it, so it is not evicted for RECENT_SECONDS after that (a new object is refused), then it is, oldest
    first listed first."""
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.2)
    bucket = Bucket(clock_offset=-3600.0)  # times the tier would not report anyway
    other = "b" * 32
    bucket.members[share_id(SHARE)] = {other}
    bucket.write(key(1, other), 60)
    shares = bucket.shares(times=False)
    shares.set(NS, SHARE, 100)
    assert put(shares, bucket, key(2), 60) is None  # key(1) first listed just now: recent
    time.sleep(0.3)
    assert put(shares, bucket, key(3), 60) == [key(1, other)]


def test_a_victim_whose_delete_failed_stays_counted_and_is_chosen_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.0)
    bucket = Bucket()
    shares = bucket.shares(refresh=3600.0)  # the view alone decides
    shares.set(NS, SHARE, 100)
    put(shares, bucket, key(1), 60)
    counted = shares.account(key(2), 60)
    bucket.write(key(2), 60)
    assert shares.done(key(2), counted, True) == [key(1)]
    shares.evicted(counted, [])  # its delete failed: key(1) is still in the bucket
    assert shares.bytes(SHARE) == 120 and shares.evictions == 0
    assert put(shares, bucket, key(3), 10) == [key(1)]


def test_a_share_object_is_written_again_every_record_every_seconds() -> None:
    """Mooncake evicts objects by itself: a namespace's share object is written again every so often, even while
    every listing still finds it."""
    bucket = Bucket()
    shares = ListedShares(lambda sid: (sorted(bucket.members.get(sid, ())), None), lambda ns: [],
                          lambda sid, ns: (bucket.members.setdefault(sid, set()).add(ns), _count()), 3600.0,
                          times=False, record_every=1.0)
    written = []

    def _count() -> None:
        written.append(1)

    shares.set(NS, SHARE, 1000)
    put(shares, bucket, key(1), 1)
    put(shares, bucket, key(2), 1)
    assert len(written) == 1  # (the two puts within a second, however loaded the machine)
    time.sleep(1.05)
    put(shares, bucket, key(3), 1)
    assert len(written) == 2


def test_a_delete_that_raises_leaves_the_put_written_and_the_victim_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ListedShares.write, the flow the tiers use: an exception from a victim's delete never escapes the
    put (the tier's writes would be counted failing for every tenant), and the victim stays counted."""
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.0)
    bucket = Bucket()
    shares = bucket.shares(refresh=3600.0)
    shares.set(NS, SHARE, 100)
    bucket.put(shares, key(1), 60)
    bucket.put(shares, key(2), 60, fail_deletes=True)
    assert set(bucket.objects) == {key(1), key(2)} and shares.bytes(SHARE) == 120 and shares.evictions == 0
    bucket.put(shares, key(3), 10)  # chosen again, deleted now
    assert key(1) not in bucket.objects and shares.evictions == 1


def test_a_victim_put_again_before_its_delete_is_not_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put A chooses key(1); put B of key(1) counts it again before A's write ends: A must not delete B's new
    object."""
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.0)
    bucket = Bucket()
    shares = bucket.shares(refresh=3600.0)
    shares.set(NS, SHARE, 100)
    bucket.put(shares, key(1), 60)
    deleted = []

    def write_a() -> None:  # while A writes, B puts key(1) again
        bucket.write(key(2), 60)
        again = shares.account(key(1), 60)
        assert again is not None and not again.refused
        bucket.write(key(1), 60)
        shares.done(key(1), again, True)

    shares.write("dict", key(2), 60, write_a, lambda v: deleted.append(v) or True)
    assert deleted == [] and key(1) in bucket.objects


class BucketSubject:
    """The conformance suite's subject: a share view over the dict bucket, as the tiers drive it."""

    size = 60

    def __init__(self) -> None:
        self.bucket = Bucket()
        self.shares = self.bucket.shares(refresh=3600.0)  # listed at the first put: the view alone decides then

    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        self.shares.set(namespace, share, quota_bytes)

    def share_bytes(self, share: str) -> int:
        return self.shares.bytes(share)

    def put(self, k: ShardKey) -> bool:
        try:
            self.bucket.put(self.shares, k, self.size)
        except QuotaFull:
            return False
        return True

    def read(self, k: ShardKey) -> bool:
        if k not in self.bucket.objects:
            return False
        self.shares.used(k)
        return True

    def delete(self, k: ShardKey) -> None:
        self.shares.removed(k)
        self.bucket.objects.pop(k, None)

    def held(self, namespace: str) -> set[ShardKey]:
        return {k for k in self.bucket.objects if k.namespace == namespace}


class TestListedSharesConformance(QuotaConformance):
    @pytest.fixture
    def subject(self, in_use: Callable[[bool], None]) -> Iterator[Callable[[bool], QuotaSubject]]:
        def make(busy: bool) -> QuotaSubject:
            in_use(busy)
            return BucketSubject()

        yield make


# -- S3 and Mooncake, through the store: each engine counts a share from listings -------------------------------

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
        put_flushed(a, "public", p[0])
        put_flushed(a, "team-a", p[0])
        listed_age()
        b.put(other, p[1], synthetic_kv(p[1]))  # the share is full: 4 objects, two engines' writes
        b.flush()
        listed_age()
        share = a._tenancy.placement.decide(ns("team-a")).share
        assert b._tenancy.placement.decide(other).share == share
        assert a.tiers[0].share_bytes(share) == b.tiers[0].share_bytes(share) == 4 * SHARD
        a.drop_dram()
        assert torch.equal(a.get(ns("team-a"), p[0]), synthetic_kv(p[0]))  # read back from S3: now recent
        age()
        put_flushed(a, "team-a", p[2])  # past the share: the least recently used, p[1] (engine b's), goes
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
        put_flushed(a, "team-a", p[0])  # a lists the share: empty
        listed = time.monotonic()
        listed_age()
        put_flushed(b, "team-a", p[1])  # b lists: a's two objects and its own two
        listed_age()  # (b's objects are listed to the second)
        put_flushed(a, "team-a", p[2])  # a's view is not due: its own four objects, no eviction
        assert time.monotonic() - listed < 10.0, "the machine is too slow for this test's timing"
        assert held(a, "team-a") == 6
        time.sleep(max(0.0, listed + 10.0 - time.monotonic()))
        listed_age()
        put_flushed(a, "team-a", p[3])  # listed again: p[0] (a's), then p[1] (b's) go
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
        names, offset = store.tiers[0]._share_members(quotas.share_id("rule0/nobody"))
        assert names == [] and offset is not None and -1.5 < offset < 0.5


def test_bad_s3_share_refresh_is_refused_naming_the_field(s3_server) -> None:
    cfg = {"tiers": [{"type": "s3", "name": "shared", **s3_server.tier_options(), "share_refresh_seconds": -1}]}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.share_refresh_seconds: must be a number of seconds >= 0, "
                                          r"got -1"):
        KVStore.from_config(cfg)


def test_a_tenant_past_its_mooncake_share_evicts_its_own_least_recent_objects_whichever_engine_wrote_them(
        mooncake_server, unique_prefix: str, age) -> None:
    """As on S3, with no times from Mooncake: another engine's objects age from when this engine first listed
    them; one engine evicts the other's objects; another tenant loses nothing."""
    p = [synthetic_tokens(80 + i, 2 * T) for i in range(3)]
    other = Namespace(model="m2", dtype="bfloat16", cache_salt="team-a")
    cfg = mooncake_config(mooncake_server, unique_prefix, 4)
    with KVStore.from_config(cfg) as a, KVStore.from_config(cfg) as b:
        put_flushed(a, "public", p[0])
        put_flushed(a, "team-a", p[0])
        age()
        b.put(other, p[1], synthetic_kv(p[1]))  # the share is full: 4 objects, two engines' writes
        b.flush()
        share = a._tenancy.placement.decide(ns("team-a")).share
        assert a.tiers[0].share_bytes(share) == b.tiers[0].share_bytes(share) == 4 * SHARD  # a first sees b's
        age()
        a.drop_dram()
        assert torch.equal(a.get(ns("team-a"), p[0]), synthetic_kv(p[0]))  # read back: now recent
        age()
        put_flushed(a, "team-a", p[2])  # past the share: the least recently used, p[1] (engine b's), goes
        assert (held(a, "team-a"), held(a, "public"), sum(1 for _ in a.tiers[0].list(other.id))) == (4, 2, 0)
        assert a.tiers[0].counters()["share_evictions"] == 2
    with KVStore.from_config(cfg) as c:
        assert c.get(other, p[1]) is None
        for tenant, tokens in (("team-a", p[0]), ("team-a", p[2]), ("public", p[0])):
            assert torch.equal(c.get(ns(tenant), tokens), synthetic_kv(tokens))
