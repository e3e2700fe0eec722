from __future__ import annotations

from kvtier import POLICIES, ConfigError, EvictionPolicy
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
