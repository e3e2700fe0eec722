"""The conformance suite every per-tenant share implementation passes (:mod:`kvtier.quotas`): the DRAM pool's and
every tier's that keeps quotas, in-tree or out of it.

Subclass :class:`QuotaConformance` in a pytest module and provide a ``subject`` fixture: a factory that takes
``busy`` and returns a :class:`QuotaSubject` over a fresh, empty implementation. With ``busy`` False nothing is
in use (a tier: ``RECENT_SECONDS`` at 0, the suite's ``in_use`` fixture sets it; DRAM: every entry released), so
a share past its quota evicts; with it True everything put or read stays in use (a tier: a long
``RECENT_SECONDS``; DRAM: each entry keeps a reference), so a share past its quota refuses. Every test here then
runs against it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import pytest

from kvtier import quotas
from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas import ShareKeeper

NS_A = "a" * 32
NS_B = "b" * 32
SHARE = "rule0/tenant"


def key(i: int, namespace: str = NS_A) -> ShardKey:
    return ShardKey(namespace, f"{i:032x}", HeadRange(0, 4, 4))


class QuotaSubject(ShareKeeper, Protocol):
    """One implementation, driven as its owner drives it. ``size``: the bytes one object of the suite counts (the
    subject writes objects that count that much: in DRAM, whole pages)."""

    size: int

    def put(self, key: ShardKey) -> bool:
        """Store one object under ``key`` as the owner would (counted, then written); False when the share
        refused it."""

    def read(self, key: ShardKey) -> bool:
        """A read of ``key`` (a hit moves it to its share's recent end); whether it was there."""

    def delete(self, key: ShardKey) -> None:
        """Remove ``key`` as the owner would (out of its share)."""

    def held(self, namespace: str) -> set[ShardKey]:
        """The objects stored under ``namespace``."""


Subject = Callable[[bool], QuotaSubject]


class QuotaConformance:
    """Behaviour the store relies on from every share implementation. Fixture ``subject`` comes from the
    subclass."""

    @pytest.fixture
    def in_use(self, monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
        """For a tier's ``subject``: ``in_use(busy)`` sets :data:`kvtier.quotas.RECENT_SECONDS` for the mode
        (everything put or read is in use, or nothing is)."""
        return lambda busy: monkeypatch.setattr(quotas, "RECENT_SECONDS", 3600.0 if busy else 0.0)

    def test_a_share_past_its_quota_evicts_its_own_least_recently_used(self, subject: Subject) -> None:
        s = subject(False)
        s.set_share(NS_A, SHARE, 3 * s.size)
        for i in range(3):
            assert s.put(key(i))
        assert s.read(key(0))  # now the most recent: key(1) is the least recently used
        assert s.put(key(3))
        assert s.held(NS_A) == {key(0), key(2), key(3)}
        assert s.share_bytes(SHARE) == 3 * s.size

    def test_another_namespace_loses_nothing(self, subject: Subject) -> None:
        s = subject(False)
        s.set_share(NS_A, SHARE, 2 * s.size)
        for i in range(3):
            assert s.put(key(i, NS_B))  # in no share
        for i in range(5):
            assert s.put(key(i))
        assert s.held(NS_B) == {key(i, NS_B) for i in range(3)}
        assert s.held(NS_A) == {key(3), key(4)}

    def test_the_namespaces_of_one_share_count_together(self, subject: Subject) -> None:
        """A rule's share counts every salt it matches: a client hopping namespaces holds no more."""
        s = subject(False)
        for namespace in (NS_A, NS_B):
            s.set_share(namespace, SHARE, 2 * s.size)
        for k in (key(0), key(1, NS_B), key(2)):
            assert s.put(k)
        assert s.held(NS_A) | s.held(NS_B) == {key(1, NS_B), key(2)}
        assert s.share_bytes(SHARE) == 2 * s.size

    def test_a_new_object_that_objects_in_use_leave_no_room_for_is_refused(self, subject: Subject) -> None:
        """Nothing in use is evicted to make room (a prompt's own chunks): the new object is refused instead, and
        nothing is evicted for it."""
        s = subject(True)
        s.set_share(NS_A, SHARE, 2 * s.size)
        assert s.put(key(0)) and s.put(key(1))
        assert not s.put(key(2))
        assert s.held(NS_A) == {key(0), key(1)}
        assert s.share_bytes(SHARE) == 2 * s.size

    def test_an_object_put_again_counts_once(self, subject: Subject) -> None:
        s = subject(True)
        s.set_share(NS_A, SHARE, 2 * s.size)
        assert s.put(key(0)) and s.put(key(1))
        assert s.put(key(0))  # held already: never refused, never counted twice
        assert s.held(NS_A) == {key(0), key(1)}
        assert s.share_bytes(SHARE) == 2 * s.size

    def test_a_deleted_object_leaves_its_share(self, subject: Subject) -> None:
        s = subject(False)
        s.set_share(NS_A, SHARE, 2 * s.size)
        assert s.put(key(0)) and s.put(key(1))
        s.delete(key(0))
        assert s.share_bytes(SHARE) == s.size
        assert s.put(key(2))  # room again: nothing evicted
        assert s.held(NS_A) == {key(1), key(2)}

    def test_a_share_told_again_keeps_its_count(self, subject: Subject) -> None:
        """The store may tell the same share again (two first requests at once; after forgetting it)."""
        s = subject(False)
        s.set_share(NS_A, SHARE, 2 * s.size)
        assert s.put(key(0)) and s.put(key(1))
        s.set_share(NS_A, SHARE, 2 * s.size)
        assert s.share_bytes(SHARE) == 2 * s.size
        assert s.put(key(2))
        assert s.held(NS_A) == {key(1), key(2)}

    def test_a_namespace_in_no_share_is_not_limited(self, subject: Subject) -> None:
        s = subject(True)
        s.set_share(NS_A, SHARE, s.size)
        s.set_share(NS_A, None)
        for i in range(3):
            assert s.put(key(i))
        assert s.held(NS_A) == {key(0), key(1), key(2)}
        assert s.share_bytes(SHARE) == 0

    def test_a_share_nothing_counts_against_holds_nothing(self, subject: Subject) -> None:
        s = subject(False)
        assert s.share_bytes("rule9/nobody") == 0
        s.set_share(NS_A, SHARE, 2 * s.size)
        assert s.share_bytes(SHARE) == 0

