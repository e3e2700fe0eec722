"""What the scheduler knows of its workers' DRAM: in vLLM's API server the workers run in other processes, each
with a store of its own, so the scheduler's store never sees the chunks their DRAM holds.

Worker side, :class:`DramReport`: after each step, which chunks this rank's DRAM came to hold whole for the rank's
heads, and which it no longer holds (evicted, discarded), and which shards of this rank's heads the cascade wrote
into a secondary tier (for the KV events kvtier publishes), as :class:`KVTierWorkerMetadata` (:mod:`._wire`).
vLLM aggregates the reports of every rank and hands them to the scheduler side with the step's output, where
:class:`WorkerDram` counts a chunk as held only while every tensor-parallel rank holds it. A chunk the index
wrongly believes held (evicted after the report) costs a failed load, which vLLM recomputes; never wrong KV.
"""

from __future__ import annotations

from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvtier.integrations.vllm._wire import DRAM, Event, KVTierWorkerMetadata
from kvtier.keys import rank_heads
from kvtier.store import KVStore


class DramChange(NamedTuple):
    """A chunk that every rank's DRAM now holds (``held``), or no longer all do."""

    namespace: str
    chunk: str
    held: bool


class DramReport:
    """Turns one worker store's DRAM changes into held / gone events for its rank."""

    def __init__(self, store: KVStore, kv_heads: int, *, tier_writes: bool = False) -> None:
        self._store = store
        self._kv_heads = kv_heads
        self._held: set[tuple[str, str]] = set()  # what the scheduler was told this rank holds
        self._changed: dict[tuple[str, str], None] = {}  # chunks to look at again, in order
        self._watcher = store.dram.watch()  # a reader of its own: other workers sharing the store read theirs
        # the cascade's writes, reported only for kvtier's KV events (otherwise they would ride every step for
        # nothing)
        self._tier_watcher = store.watch_tier_writes() if tier_writes and store.tiers else None

    def take(self, rank: int, size: int, step: int) -> KVTierWorkerMetadata:
        for key, _ in self._store.dram.take_changes(self._watcher):
            self._changed[(key.namespace, key.chunk)] = None
        heads = rank_heads(self._kv_heads, rank, size)
        events: list[Event] = []
        if self._tier_watcher is not None:
            events += [Event(key.namespace, key.chunk, rank, tier, True)
                       for key, tier in self._store.take_tier_writes(self._tier_watcher) if key.heads == heads]
        if not self._changed:
            return KVTierWorkerMetadata(events, {rank: step})
        dram: list[Event] = []
        for namespace, chunk in self._changed:
            now = self._store.in_dram(namespace, chunk, heads)
            if now != ((namespace, chunk) in self._held):
                dram.append(Event(namespace, chunk, rank, DRAM, now))
        # Only now, nothing having failed: what this rank says it holds changes with what it reports.
        for event in dram:
            (self._held.add if event.held else self._held.discard)((event.namespace, event.chunk))
        self._changed.clear()
        return KVTierWorkerMetadata(dram + events, {rank: step})


class WorkerDram:
    """The scheduler's index of the chunks its workers' DRAM holds, per rank."""

    def __init__(self, tp_size: int) -> None:
        self._tp = tp_size
        self._ranks: dict[tuple[str, str], set[int]] = {}

    def apply(self, meta: KVConnectorWorkerMetadata | None) -> list[DramChange]:
        """Take a step's reports; returns the chunks every rank now holds, or no longer all hold."""
        if not isinstance(meta, KVTierWorkerMetadata):
            return []
        changed: list[DramChange] = []
        for namespace, chunk, rank, place, held in meta.events:
            if place != DRAM:
                continue
            ranks = self._ranks.setdefault((namespace, chunk), set())
            was = len(ranks) == self._tp
            (ranks.add if held else ranks.discard)(rank)
            if (len(ranks) == self._tp) != was:
                changed.append(DramChange(namespace, chunk, not was))
            if not ranks:
                del self._ranks[(namespace, chunk)]
        return changed

    def holds(self, namespace: str, chunk: str) -> bool:
        """Whether every rank holds its heads of this chunk in DRAM (as last reported)."""
        return len(self._ranks.get((namespace, chunk), ())) == self._tp

    def __len__(self) -> int:
        return len(self._ranks)
