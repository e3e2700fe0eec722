"""Admission: which chunks a put stores. With ``admission.store_after: N`` a chunk is stored at its Nth put (each
put of it is a sighting), so a prompt that never comes back costs no copy into DRAM and no cascade writes, and one
that does is stored on its Nth time and a hit from then on. Sightings are remembered for the most recent
``remember_chunks`` chunks only (a bounded map of 64-bit hashes of the shard keys); a collision of two hashes only
stores a chunk sooner than asked."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

from kvtier.config import AdmissionConfig
from kvtier.recent import RecentMap


class Admission:
    """Counts the sightings of each chunk; :meth:`admit` says how many of a put's leading chunks are stored."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.store_after = config.store_after
        self._seen: RecentMap[int, int] = RecentMap(config.remember_chunks)
        self._lock = threading.Lock()

    def admit(self, keys: Sequence[Hashable]) -> int:
        """Count one sighting of each of ``keys`` (a put's chunks in prompt order: the store's shard keys, the
        simulator's block ids); the leading number of them seen at least ``store_after`` times, this one included
        (a chunk after one not admitted could never be reached by a prefix lookup, so it is not stored either, but
        its sighting is counted)."""
        if self.store_after <= 1:
            return len(keys)
        admitted = None
        with self._lock:
            for i, key in enumerate(keys):
                h = hash(key)
                seen = min(self._seen.get(h, 0) + 1, self.store_after)
                self._seen[h] = seen
                if admitted is None and seen < self.store_after:
                    admitted = i
        return len(keys) if admitted is None else admitted

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
