"""The change feed the DRAM pool and the store's tier writes publish to."""

from __future__ import annotations

from kvtier.feed import ChangeFeed


def test_change_feed_gives_each_reader_what_came_after_its_last_take() -> None:
    feed: ChangeFeed[int] = ChangeFeed()
    feed.publish(0)  # no reader yet: not recorded
    first = feed.watch()
    feed.publish(1)
    second = feed.watch()
    feed.publish(2)
    assert feed.take(first) == [1, 2] and feed.take(first) == []
    assert feed.take(second) == [2]
