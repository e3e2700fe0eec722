"""Which engine can serve which prefix, from where: the router's exact index of the fleet's KV blocks.

Blocks are keyed by the router itself, from token ids, never by the engines' hashes: key ``i`` is a BLAKE2b
digest of key ``i-1``, block ``i``'s token ids and its extra keys (LoRA name, cache salt, multimodal
identifiers, as vLLM's events carry them). A request's keys come from its tokens the same way, so the index
needs no agreement on hash algorithm or seed between the router and the engines, only the block size. Each
engine's hashes map to keys (``BlockRemoved`` names hashes only); entries are reference counts per engine and
place, since vLLM can store one hash twice and remove it once.

Places, best first: the engine's own memory, then kvtier's host DRAM and local disk on that engine's host, then
a shared tier (``locality`` REMOTE) that every engine can load from. Blocks the router has just sent a request
to compute are *reserved* on that engine for a few seconds, so a burst that shares a new prefix sees it before
the engine's events arrive.

Every event costs the router in proportion to its own size, never to what is held: an engine's entries are kept
per place, so a reused or removed hash touches only its own (at most four) entries. Each engine is credited with
at most ``max_engine_blocks`` distinct hashes; past that its least recently stored ones go (counted), so a
forged or runaway stream costs bounded memory. Clearing an engine runs in slices (:meth:`PrefixIndex.clearing`)
for the event feed to interleave with the router's other work.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterable, Iterator, Sequence

import msgpack
import numpy as np

from kvtier.router.events import BlockHash, Removed, Stored

_ROOT = hashlib.blake2b(b"kvtier-router-blocks/1", digest_size=16).digest()


class Place(enum.IntEnum):
    """Where an engine would take a block from, in order of preference."""

    ENGINE = 0  # the engine's own KV memory (vLLM's prefix cache)
    HOST = 1  # kvtier's DRAM on the engine's host (medium CPU, LOCAL)
    DISK = 2  # an engine-local kvtier tier on storage (medium STORAGE, LOCAL)
    SHARED = 3  # a shared tier (locality REMOTE): every engine can load it


def place_of(medium: str | None, locality: str | None) -> Place:
    if (locality or "").upper() == "REMOTE":
        return Place.SHARED
    kind = (medium or "GPU").upper()
    if kind == "CPU":
        return Place.HOST
    if kind == "STORAGE":
        return Place.DISK
    return Place.ENGINE


def block_key(parent: bytes | None, tokens: Sequence[int], extra: Sequence[object] | None) -> bytes:
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(msgpack.packb(list(extra) if extra else [], use_bin_type=True))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def request_keys(tokens: Sequence[int], block_size: int, *, lora_name: str | None = None,
                 cache_salt: str | None = None) -> list[bytes]:
    """The keys of a prompt's whole blocks, as the events of an engine that computed them give them.

    Extra keys follow vLLM: the LoRA name on every block, the cache salt on the first block only."""
    keys: list[bytes] = []
    parent: bytes | None = None
    lora = [lora_name] if lora_name else []
    for i in range(len(tokens) // block_size):
        extra = lora + [cache_salt] if i == 0 and cache_salt else lora
        parent = block_key(parent, tokens[i * block_size:(i + 1) * block_size], extra)
        keys.append(parent)
    return keys


@dataclasses.dataclass(frozen=True)
class Match:
    """How an engine could serve a prompt's leading blocks. ``engine``: its own prefix hit (blocks in its memory
    or reserved there). ``kvtier``: the leading blocks kvtier holds for it (its host DRAM, its disk, any shared
    tier), whatever the engine holds; ``host``, ``disk`` and ``shared`` count, by place, those of them past the
    engine's hit (what kvtier would load). ``announced``: of the engine's hit, the leading blocks its own events
    announced (reservations aside: blocks a request routed there is still computing)."""

    engine: int = 0
    host: int = 0
    disk: int = 0
    shared: int = 0
    kvtier: int = 0
    announced: int = 0

    @property
    def blocks(self) -> int:
        return max(self.engine, self.kvtier)


class _Engine:
    def __init__(self) -> None:
        # engine hash -> key, least recently stored first: the per-engine cap evicts from the front (an OrderedDict:
        # a plain dict's iteration from the front slows down as deleted slots pile up there)
        self.keys: OrderedDict[BlockHash, bytes] = OrderedDict()
        self.refs: Counter[BlockHash] = Counter()  # references to a hash over every place
        self.held: dict[Place, Counter[BlockHash]] = {place: Counter() for place in Place}


@dataclasses.dataclass
class IndexCounts:
    """What the index could not use, for the router's metrics."""

    orphans: int = 0  # stored blocks whose parent no engine announced
    unknown_removals: int = 0  # removals of blocks never announced (or already removed)
    # stored events not indexed, by reason; "engine_cap": blocks an engine was no longer credited with, its
    # least recently stored, to keep it within max_engine_blocks
    skipped: Counter[str] = dataclasses.field(default_factory=Counter)


class PrefixIndex:
    """The fleet's blocks by key, per engine and place, with reservations made at routing time."""

    def __init__(self, block_size: int, max_engine_blocks: int = 1_000_000) -> None:
        self.block_size = block_size
        self.max_engine_blocks = max_engine_blocks
        self._engines: dict[str, _Engine] = defaultdict(_Engine)
        self._holders: dict[bytes, Counter[tuple[str, Place]]] = {}
        # key -> engine -> request token -> deadline (monotonic)
        self._reserved: dict[bytes, dict[str, dict[int, float]]] = {}
        self.counts = IndexCounts()

    # --- events ---------------------------------------------------------------------------------------------
    def stored(self, engine: str, event: Stored) -> None:
        if event.group not in (None, 0):
            self.counts.skipped["kv_cache_group"] += 1  # hybrid models' other groups: not routed on
            return
        state = self._engines[engine]
        place = place_of(event.medium, event.locality)
        if not event.token_ids:
            # Offloading tiers may announce hashes only: the engine announced their tokens before.
            for h in event.hashes:
                if h in state.keys:
                    self._hold(engine, state, h, state.keys[h], place)
                else:
                    self.counts.orphans += 1
            return
        if event.block_size != self.block_size or len(event.token_ids) != len(event.hashes) * self.block_size:
            self.counts.skipped["block_size"] += 1  # a partial block, or an engine with another block size
            return
        parent_key: bytes | None = None
        if event.parent is not None:
            parent_key = self._key_of(engine, event.parent)
            if parent_key is None:
                self.counts.orphans += len(event.hashes)
                return
        bs = self.block_size
        for i, h in enumerate(event.hashes):
            extra = event.extra_keys[i] if event.extra_keys else None
            parent_key = block_key(parent_key, event.token_ids[i * bs:(i + 1) * bs], extra)
            self._hold(engine, state, h, parent_key, place)

    def _key_of(self, engine: str, h: BlockHash) -> bytes | None:
        key = self._engines[engine].keys.get(h)
        if key is None:
            # Engines with the same hash settings name the same prefix with the same hash: a parent announced
            # by another engine (e.g. loaded from a shared tier this engine never computed) still resolves.
            for other in self._engines.values():
                if h in other.keys:
                    return other.keys[h]
        return key

    def _hold(self, engine: str, state: _Engine, h: BlockHash, key: bytes, place: Place) -> None:
        old = state.keys.get(h)
        if old is not None and old != key:
            # The engine names other tokens with a hash it used before (a collision of its 64-bit event hashes):
            # the old block's entries go, or a later removal would take them from the wrong key.
            self.counts.skipped["hash_reused"] += 1
            self._forget(engine, state, h)
        elif old is not None:
            state.keys.move_to_end(h)  # stored again: the most recently stored, last to go at the cap
        state.keys[h] = key
        state.refs[h] += 1
        state.held[place][h] += 1
        self._holders.setdefault(key, Counter())[engine, place] += 1
        while len(state.keys) > self.max_engine_blocks:
            self.counts.skipped["engine_cap"] += 1
            self._forget(engine, state, next(iter(state.keys)))
        if place is Place.ENGINE:
            # The engine announced it: from now on its events say how long it keeps it (a reservation that
            # outlived an eviction would credit a block the engine no longer has).
            reserved = self._reserved.get(key)
            if reserved is not None and reserved.pop(engine, None) is not None and not reserved:
                del self._reserved[key]

    def removed(self, engine: str, event: Removed) -> None:
        if event.group not in (None, 0):
            return
        state = self._engines[engine]
        place = place_of(event.medium, event.locality)
        for h in event.hashes:
            if not self._drop(engine, state, h, place, 1):
                self.counts.unknown_removals += 1

    def _drop(self, engine: str, state: _Engine, h: BlockHash, place: Place, n: int) -> int:
        """Take up to ``n`` references of ``h`` in ``place`` from ``engine``; how many it held."""
        held = state.held[place]
        n = min(n, held.get(h, 0))
        if not n:
            return 0
        key = state.keys[h]
        held[h] -= n
        if not held[h]:
            del held[h]
        state.refs[h] -= n
        if not state.refs[h]:
            del state.refs[h], state.keys[h]
        holders = self._holders[key]
        holders[engine, place] -= n
        if not holders[engine, place]:
            del holders[engine, place]
            if not holders:
                del self._holders[key]
        return n

    def _forget(self, engine: str, state: _Engine, h: BlockHash) -> None:
        """Drop every reference ``engine`` holds to ``h``, in every place."""
        for place in Place:
            self._drop(engine, state, h, place, state.held[place].get(h, 0))

    def clear(self, engine: str, places: Iterable[Place] = tuple(Place)) -> None:
        """Forget what ``engine`` holds in ``places`` (all of them: it restarted, died or cleared its cache)."""
        for _ in self.clearing(engine, places):
            pass

    def clearing(self, engine: str, places: Iterable[Place] = tuple(Place),
                 slice_blocks: int = 4096) -> Iterator[None]:
        """:meth:`clear` in slices: yields after each ``slice_blocks`` entries dropped, for the caller to let other
        work run. What the engine stores in ``places`` meanwhile is not dropped (it came after the clear)."""
        wanted = tuple(places)
        state = self._engines.get(engine)
        if state is None:
            return
        if Place.ENGINE in wanted:
            for holders in self._reserved.values():
                holders.pop(engine, None)
        for place in wanted:
            # Over a snapshot (dropping changes the counter), each entry by the references it had then: one
            # stored again between two slices keeps its new reference
            for i, (h, n) in enumerate(list(state.held[place].items()), 1):
                self._drop(engine, state, h, place, n)
                if i % slice_blocks == 0:
                    yield

    def leaving(self, engine: str, slice_blocks: int = 4096) -> Iterator[None]:
        """``engine`` left the fleet: everything it holds goes, in every place (its events will never remove what
        it announced in a shared tier), and the index forgets it; in slices, as :meth:`clearing`."""
        yield from self.clearing(engine, tuple(Place), slice_blocks)
        self._engines.pop(engine, None)

    def blocks(self, engine: str) -> int:
        """Distinct blocks ``engine`` holds anywhere."""
        state = self._engines.get(engine)
        return len(state.refs) if state else 0

    def places(self, engine: str) -> dict[str, int]:
        """Blocks ``engine`` announced, per place."""
        state = self._engines.get(engine)
        return {place.name.lower(): len(state.held[place]) if state else 0 for place in Place}

    # --- routing --------------------------------------------------------------------------------------------
    def reserve(self, engine: str, keys: Sequence[bytes], seconds: float, token: int) -> None:
        """Credit ``engine`` with ``keys`` for ``seconds``: request ``token`` routed there is about to compute
        them. Each request's reservation is its own: one that fails takes back only its own."""
        deadline = time.monotonic() + seconds
        for key in keys:
            self._reserved.setdefault(key, {}).setdefault(engine, {})[token] = deadline

    def unreserve(self, engine: str, keys: Sequence[bytes], token: int) -> None:
        for key in keys:
            holders = self._reserved.get(key)
            if holders is None:
                continue
            tokens = holders.get(engine)
            if tokens is None or tokens.pop(token, None) is None:
                continue
            if not tokens:
                del holders[engine]
                if not holders:
                    del self._reserved[key]

    def _reserved_for(self, key: bytes, engine: str, now: float) -> bool:
        tokens = self._reserved.get(key, {}).get(engine)
        return tokens is not None and any(deadline > now for deadline in tokens.values())

    def announced_run(self, engine: str, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the engine announced holding in its own memory (reservations aside)."""
        run = 0
        for key in keys:
            holders = self._holders.get(key)
            if not (holders and holders.get((engine, Place.ENGINE))):
                break
            run += 1
        return run

    def expire(self) -> None:
        now = time.monotonic()
        for key in list(self._reserved):
            holders = self._reserved[key]
            for engine in list(holders):
                tokens = holders[engine]
                for token in [t for t, deadline in tokens.items() if deadline <= now]:
                    del tokens[token]
                if not tokens:
                    del holders[engine]
            if not holders:
                del self._reserved[key]

    def match(self, keys: Sequence[bytes], engines: Sequence[str]) -> dict[str, Match]:
        """For each engine, how it could serve the leading blocks of ``keys`` (see :class:`Match`)."""
        now = time.monotonic()
        result: dict[str, Match] = {}
        for engine in engines:
            own = announced = 0
            for key in keys:
                holders = self._holders.get(key)
                if holders and holders.get((engine, Place.ENGINE)):
                    announced += announced == own  # still a run of announced blocks from the first
                elif not self._reserved_for(key, engine, now):
                    break
                own += 1
            counts = [0, 0, 0, 0]
            kvtier = 0
            for i, key in enumerate(keys):
                place = self._best_outside(self._holders.get(key), engine)
                if place is None:
                    break
                kvtier += 1
                if i >= own:
                    counts[place] += 1
            result[engine] = Match(engine=own, host=counts[Place.HOST], disk=counts[Place.DISK],
                                   shared=counts[Place.SHARED], kvtier=kvtier, announced=announced)
        return result

    @staticmethod
    def _best_outside(holders: Counter[tuple[str, Place]] | None, engine: str) -> Place | None:
        if not holders:
            return None
        if holders.get((engine, Place.HOST)):
            return Place.HOST
        if holders.get((engine, Place.DISK)):
            return Place.DISK
        if any(place is Place.SHARED for _, place in holders):
            return Place.SHARED
        return None


LOCAL_PLACES = (Place.ENGINE, Place.HOST, Place.DISK)  # lost when an engine's process restarts (kvtier's
# disk survives, but is not announced again); what it wrote to a shared tier stays there for every engine
