"""The bounded map of recent keys and the change feed that the store, the DRAM pool and the integrations share."""

from __future__ import annotations

import pytest

from kvtier.feed import ChangeFeed
from kvtier.recent import RecentMap
from kvtier.units import size_fixed, size_label


def test_recent_map_keeps_the_newest_and_hands_the_oldest_to_on_drop() -> None:
    dropped: list[tuple[str, int]] = []
    recent: RecentMap[str, int] = RecentMap(3, on_drop=lambda k, v: dropped.append((k, v)))
    for i, key in enumerate("abc"):
        recent[key] = i
    assert recent.touch("a") and not recent.touch("z")  # "a" is now the newest
    recent["d"] = 3
    assert list(recent) == ["c", "a", "d"] and dropped == [("b", 1)]
    recent["c"] = 9  # set again: the newest, not a new entry
    assert recent.items() == [("a", 0), ("d", 3), ("c", 9)] and len(recent) == 3
    assert recent.get("b") is None and recent.get("b", -1) == -1 and recent["a"] == 0
    assert recent.pop("a") == 0 and recent.pop("a", None) is None and "a" not in recent
    recent.clear()
    assert not recent
    with pytest.raises(ValueError, match="limit must be at least 1"):
        RecentMap(0)


def test_change_feed_gives_each_reader_what_came_after_its_last_take() -> None:
    feed: ChangeFeed[int] = ChangeFeed()
    feed.publish(0)  # no reader yet: not recorded
    first = feed.watch()
    feed.publish(1)
    second = feed.watch()
    feed.publish(2)
    assert feed.take(first) == [1, 2] and feed.take(first) == []
    assert feed.take(second) == [2]


@pytest.mark.parametrize(("n", "label", "exact", "fixed"), [
    (0, "0 B", "0 B", "0 B"),
    (812, "812 B", "812 B", "812 B"),
    (1536, "1.5 KiB", "1.5 KiB", "1.5 KiB"),
    (512 * 2**20, "512 MiB", "512 MiB", "512.0 MiB"),
    (int(1.25 * 2**30), "1.25 GiB", "1.25 GiB", "1.2 GiB"),
    (3 * 2**40, "3 TiB", "3 TiB", "3.0 TiB"),
])
def test_sizes_print_in_the_largest_binary_unit(n: int, label: str, exact: str, fixed: str) -> None:
    assert (size_label(n), size_label(n, digits=None), size_fixed(n)) == (label, exact, fixed)
