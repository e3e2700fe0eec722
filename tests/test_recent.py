"""The bounded map of recent keys that the store, the DRAM pool, placement and the integrations share."""

from __future__ import annotations

import pytest

from kvtier.recent import RecentMap


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
