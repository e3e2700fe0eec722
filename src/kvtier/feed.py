"""A change feed: what happened since each reader last asked, for readers that poll (the vLLM integration's KV
events). Nothing is recorded without a reader: a list nobody drains would grow."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class ChangeFeed(Generic[T]):
    """Items published, kept per reader until it takes them. ``lock``: the owner's lock, when items are published
    under it already (:meth:`publish_locked`); else the feed's own."""

    def __init__(self, lock: threading.Lock | threading.RLock | None = None) -> None:
        self._lock = threading.Lock() if lock is None else lock
        self._readers: list[list[T]] = []

    def watch(self) -> int:
        """Start recording for one more reader; its handle for :meth:`take`."""
        with self._lock:
            self._readers.append([])
            return len(self._readers) - 1

    def take(self, reader: int) -> list[T]:
        """What was published since this reader's last call, in order."""
        with self._lock:
            taken, self._readers[reader] = self._readers[reader], []
        return taken

    def publish(self, item: T) -> None:
        if self._readers:  # (read without the lock: a reader added meanwhile starts from its next item)
            with self._lock:
                self.publish_locked(item)

    def publish_locked(self, item: T) -> None:
        """:meth:`publish`, with the feed's lock held by the caller."""
        for taken in self._readers:
            taken.append(item)
