from __future__ import annotations

from kvtier import POLICIES, ConfigError, EvictionPolicy
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.eviction import LRUPolicy, PrefixLRUPolicy


def test_policies_by_name_and_plugin_path() -> None:
    assert POLICIES.resolve("lru", "dram.eviction") is LRUPolicy
    assert POLICIES.resolve("prefix_lru", "dram.eviction") is PrefixLRUPolicy
    assert POLICIES.resolve("kvtier.eviction:LRUPolicy", "dram.eviction") is LRUPolicy
    try:
        POLICIES.resolve("fifo", "dram.eviction")
    except ConfigError as exc:
        assert "known: lru, prefix_lru" in str(exc)
    else:
        raise AssertionError("unknown policy accepted")


def test_prefix_lru_falls_back_when_every_leaf_is_busy() -> None:
    policy: EvictionPolicy = PrefixLRUPolicy()
    policy.insert("a", "A", None)
    policy.insert("b", "B", "A")
    assert policy.victim(lambda k: True) == "b"
    assert policy.victim(lambda k: k != "b") == "a"  # the child is pinned: the parent may go
    policy.remove("b")
    assert policy.victim(lambda k: True) == "a"
    policy.remove("a")
    assert policy.victim(lambda k: True) is None


def test_shards_of_one_chunk_all_count_as_children() -> None:
    policy = PrefixLRUPolicy()
    policy.insert("p", "P", None)
    policy.insert(("c", 0), "C", "P")
    policy.insert(("c", 1), "C", "P")
    policy.remove(("c", 0))
    assert policy.victim(lambda k: True) == ("c", 1)
    policy.remove(("c", 1))
    assert policy.victim(lambda k: True) == "p"


class NaivePrefixLRU:
    """The specification: scan entries from least recently used; the first evictable leaf goes, else the first
    evictable entry."""

    def __init__(self) -> None:
        self.order: list[object] = []
        self.chunk_of: dict[object, tuple[str, str | None]] = {}

    def insert(self, key, chunk, parent) -> None:
        self.order.append(key)
        self.chunk_of[key] = (chunk, parent)

    def touch(self, key) -> None:
        if key in self.order:
            self.order.remove(key)
            self.order.append(key)

    def remove(self, key) -> None:
        if key in self.order:
            self.order.remove(key)
            del self.chunk_of[key]

    def victim(self, evictable):
        parents = {p for _, p in self.chunk_of.values()}
        leaf = next((k for k in self.order if self.chunk_of[k][0] not in parents and evictable(k)), None)
        return leaf if leaf is not None else next((k for k in self.order if evictable(k)), None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "touch", "remove", "victim"]), st.integers(0, 9),
                          st.integers(0, 9), st.frozensets(st.integers(0, 9))), max_size=80))
def test_prefix_lru_chooses_what_a_scan_from_the_least_recent_would(ops) -> None:
    policy, spec = PrefixLRUPolicy(), NaivePrefixLRU()
    for op, a, b, busy in ops:
        # Keys are (chunk, head range) pairs: two keys may share a chunk. A chunk's parent is a lower chunk.
        key, chunk, parent = (a, b % 2), f"c{a}", (f"c{b}" if b < a else None)
        if op == "insert":
            if key in spec.chunk_of:
                continue
            if any(c == chunk and p != parent for c, p in spec.chunk_of.values()):
                parent = next(p for c, p in spec.chunk_of.values() if c == chunk)  # one chunk, one parent
            policy.insert(key, chunk, parent)
            spec.insert(key, chunk, parent)
        elif op == "touch":
            policy.touch(key)
            spec.touch(key)
        elif op == "remove":
            policy.remove(key)
            spec.remove(key)
        else:
            evictable = lambda k, busy=busy: k[0] not in busy  # noqa: E731
            assert policy.victim(evictable) == spec.victim(evictable)


def test_prefix_lru_heap_stays_bounded_under_many_touches() -> None:
    policy = PrefixLRUPolicy()
    for i in range(100):
        policy.insert(i, f"c{i}", None)
    for _ in range(200):
        for i in range(100):
            policy.touch(i)
    assert len(policy._leaves) <= 2 * 100 + 64 + 1
    assert policy.victim(lambda k: True) == 0


def test_a_parent_whose_children_all_left_is_a_leaf_again() -> None:
    policy = PrefixLRUPolicy()
    policy.insert("p", "P", None)
    policy.insert("c", "C", "P")
    assert policy.victim(lambda k: True) == "c"  # the parent was passed over as no leaf
    policy.remove("c")
    policy.insert("x", "X", None)
    assert policy.victim(lambda k: True) == "p"  # the least recent leaf again
