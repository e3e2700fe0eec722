"""Lookups: how many leading tokens of a prompt the store holds, in DRAM or any tier it may read, with tails
(partial last chunks) counted where asked. Asks the tiers what they hold (through their guards: a failing tier
holds nothing); moves no KV. Runs on the caller's thread."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.dram import DramPool
from kvtier.keys import HeadRange, NamedChunks, Namespace, chunk_keys, cover, rank_heads, tail_keys
from kvtier.metrics import StoreMetrics
from kvtier.placement import Decision
from kvtier.store.guard import GuardedTier
from kvtier.store.plan import full_cover
from kvtier.store.tenancy import Tenancy
from kvtier.store.writes import Tokens

Elsewhere = Callable[[str, str], bool]  # (namespace id, chunk key): held whole outside this store
Answers = dict[str, list[list[HeadRange]]]  # tier name -> what it said it holds of each object asked


def readable(guards: list[GuardedTier], decision: Decision, local_only: bool) -> list[GuardedTier]:
    """The secondary tiers a lookup or read of a namespace asks: those its placement lets its KV reach (a tenant
    kept in DRAM sends its keys to none), only the local ones with ``local_only``."""
    return [g for g in guards if decision.admits(g.name) and (g.local or not local_only)]


class Lookups:
    def __init__(self, chunk_tokens: int, dram: DramPool, metrics: StoreMetrics, tenancy: Tenancy,
                 guards: list[GuardedTier]) -> None:
        self._chunk_tokens = chunk_tokens
        self._dram = dram
        self._metrics = metrics
        self._tenancy = tenancy
        self._guards = guards

    def held(self, ns: Namespace, tokens: Tokens, tp_rank: int, tp_size: int, kv_heads: int, tail: bool) -> int:
        """:meth:`KVStore.held`: DRAM only."""
        heads = rank_heads(kv_heads, tp_rank, tp_size)
        ns = self._tenancy.named(ns)
        n = 0
        for key in chunk_keys(ns, tokens, self._chunk_tokens, tail=tail):
            if not self.in_dram(ns.id, key.hex(), heads):
                break
            n += 1
        return min(n * self._chunk_tokens, len(tokens))

    def in_dram(self, namespace: str, chunk: str, heads: HeadRange) -> bool:
        ranges = [r for r in self._dram.ranges(namespace, chunk) if r.total == heads.total]
        return cover(ranges, heads.start, heads.stop) is not None

    def lookup(self, ns: Namespace, tokens: Tokens, kv_heads: int | None, elsewhere: Elsewhere | None,
               local_only: bool, count: bool, tail_block: int | None) -> int:
        """:meth:`KVStore.lookup`."""
        t = self._chunk_tokens
        if tail_block is not None and not (0 < tail_block <= t and t % tail_block == 0):
            raise ValueError(f"tail_block must divide the chunk size {t}, got {tail_block}")
        if tail_block is not None and isinstance(tokens, NamedChunks):
            raise ValueError("named chunks have no tails: tail_block must be None")
        ns = self._tenancy.named(ns)
        keys = chunk_keys(ns, tokens, t)
        tiers = readable(self._guards, self._tenancy.placement.decide(ns), local_only)

        def tails_after(n: int) -> tuple[list[str], list[int]]:
            """The tails to try after ``n`` whole chunks, longest first (none without ``tail_block``)."""
            if not tail_block or tail_block == t or n * t + tail_block > len(tokens) or \
                    isinstance(tokens, NamedChunks):  # (refused above: no tails)
                return [], []
            lengths = list(range(min(t - 1, len(tokens) - n * t) // tail_block * tail_block, 0, -tail_block))
            found = tail_keys(ns, keys[n - 1] if n else ns.digest, tokens[n * t:n * t + lengths[0]], n * t, lengths)
            return [k.hex() for k in found], lengths

        last, last_lengths = tails_after(len(keys))
        n, asked = self._available(ns.id, [k.hex() for k in keys], kv_heads, elsewhere, tiers, last)
        found = n * t
        tails, lengths = (last, last_lengths) if n == len(keys) else tails_after(n)
        if tails:
            found += self._longest(ns.id, tails, lengths, kv_heads, elsewhere,
                                   tiers if n else [g for g in tiers if g.local], asked if n == len(keys) else {})
        if count and not local_only:
            self.count(len(tokens), found)
        return found

    def each(self, ns: Namespace, chunks: NamedChunks, kv_heads: int | None, count: bool) -> list[bool]:
        """:meth:`KVStore.lookup_each`."""
        ns = self._tenancy.named(ns)
        keys = [k.hex() for k in chunk_keys(ns, chunks, self._chunk_tokens)]
        ranges = [self._dram.ranges(ns.id, key) for key in keys]
        found = [full_cover(r, kv_heads) for r in ranges]
        for guard in readable(self._guards, self._tenancy.placement.decide(ns), local_only=False):
            lacking = [i for i, f in enumerate(found) if not f]
            if not lacking:
                break
            # A local tier is asked key by key: its heads() looks on disk (for what other processes wrote) only up
            # to the first key its index lacks, and these keys are no prefix.
            asked = [lacking] if not guard.local else [[i] for i in lacking]
            for group in asked:
                for i, heads in zip(group, guard.heads(ns.id, [keys[i] for i in group])):
                    ranges[i].extend(heads)
                    found[i] = full_cover(ranges[i], kv_heads)
        if count:
            self.count(len(chunks), sum(found) * self._chunk_tokens)
        return found

    def count(self, tokens: int, found: int) -> None:
        self._metrics.lookup_tokens.inc(tokens)
        self._metrics.lookup_hit_tokens.inc(found)

    def _available(self, namespace: str, chunks: list[str], kv_heads: int | None, elsewhere: Elsewhere | None,
                   tiers: list[GuardedTier], extra: list[str]) -> tuple[int, Answers]:
        """The leading chunks available, and what each tier asked said of the objects ``extra``: asked with the
        chunks DRAM lacks, of the tiers across a network that answer in one round trip."""
        def in_memory(chunk: str) -> bool:
            return full_cover(self._dram.ranges(namespace, chunk), kv_heads) or \
                (elsewhere is not None and elsewhere(namespace, chunk))

        n = 0
        while n < len(chunks) and in_memory(chunks[n]):
            n += 1
        if n == len(chunks) or not tiers:
            return n, {}
        rest = chunks[n:]
        asked: Answers = {}
        per_tier = []
        for guard in tiers:
            ride = extra if extra and not guard.local and guard.heads_in_one_call else []
            heads = guard.heads(namespace, rest + ride)
            if ride:
                asked[guard.name] = heads[len(rest):]
            per_tier.append(heads)
        for i, chunk in enumerate(rest):
            ranges = self._dram.ranges(namespace, chunk)
            for heads in per_tier:
                ranges.extend(heads[i])
            if not (full_cover(ranges, kv_heads) or in_memory(chunk)):
                break
            n += 1
        return n, asked

    def _longest(self, namespace: str, tails: list[str], lengths: list[int], kv_heads: int | None,
                 elsewhere: Elsewhere | None, tiers: list[GuardedTier], asked: Answers) -> int:
        """The longest of ``lengths`` whose tail (of ``tails``, longest first) is available, or 0. ``asked``:
        answers some tiers gave already. Each other tier is asked about the tails longer than the longest DRAM,
        ``elsewhere`` or the answers hold: a tier across a network once, a local one tail by tail until one is
        whole."""
        ranges = [self._dram.ranges(namespace, tail) for tail in tails]
        for answers in asked.values():
            for found, more in zip(ranges, answers):
                found.extend(more)

        def whole(i: int) -> bool:
            return full_cover(ranges[i], kv_heads) or (elsewhere is not None and elsewhere(namespace, tails[i]))

        held = next((i for i in range(len(tails)) if whole(i)), len(tails))
        for guard in tiers:
            if not held or guard.name in asked:
                continue
            if not guard.local:
                for found, heads in zip(ranges, guard.heads(namespace, tails[:held])):
                    found.extend(heads)
                continue
            for i in range(held):
                ranges[i].extend(guard.heads(namespace, [tails[i]])[0])
                if whole(i):
                    break
        return next((lengths[i] for i in range(len(tails)) if whole(i)), 0)
