"""The primary tier: a preallocated host-memory pool of fixed-size pages.

Runs in the caller's process; every method is thread-safe. The pool allocates once at start (pinned when CUDA
is present) and hands out page extents, so storing a shard allocates no tensor. A shard is two-phase:
:meth:`DramPool.reserve` returns a private entry holding one reference, the caller copies bytes in outside the
lock, then :meth:`DramPool.commit` makes it visible (or :meth:`DramPool.abort` frees it). Entries with references
(being written, read or cascaded) are never evicted.

An entry may carry an owner (the key id of the tenant key it was stored under, :mod:`kvtier.sealing`) and an
expiry (from its tiers' ``ttl_seconds``: see :mod:`kvtier.store`): a read names the owner it may be served under, and
an entry of another owner, or past its expiry, is never served: it is discarded when found.

Tenant shares (quotas) are counted by :mod:`kvtier.quotas.pool`, under the pool's lock; what becomes visible or
goes is published to readers through a :class:`~kvtier.feed.ChangeFeed` (:meth:`DramPool.watch`).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Collection, Hashable

import torch

from kvtier.errors import ConfigError
from kvtier.eviction import EvictionPolicy
from kvtier import codecs, frame
from kvtier.feed import ChangeFeed
from kvtier.frame import ShardMeta
from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas import Share
from kvtier.quotas.pool import PoolShares

log = logging.getLogger("kvtier.dram")

Extent = tuple[int, int]  # (first page, page count)


class _FreePages:
    """Free page runs, coalesced; first fit, falling back to gathering several runs."""

    def __init__(self, pages: int) -> None:
        self._starts: list[int] = [0] if pages else []
        self._lens: dict[int, int] = {0: pages} if pages else {}
        self.count = pages

    def take_run(self, n: int) -> Extent | None:
        """``n`` consecutive pages (first fit), or None when no free run is that long."""
        for start in self._starts:
            if self._lens[start] >= n:
                self._remove_prefix(start, n)
                return (start, n)
        return None

    def take(self, n: int) -> list[Extent] | None:
        if n > self.count:
            return None
        for start in self._starts:
            if self._lens[start] >= n:
                self._remove_prefix(start, n)
                return [(start, n)]
        extents: list[Extent] = []
        while n:
            start = self._starts[0]
            take = min(n, self._lens[start])
            self._remove_prefix(start, take)
            extents.append((start, take))
            n -= take
        return extents

    def _remove_prefix(self, start: int, n: int) -> None:
        length = self._lens.pop(start)
        i = bisect.bisect_left(self._starts, start)
        del self._starts[i]
        if length > n:
            self._lens[start + n] = length - n
            self._starts.insert(i, start + n)
        self.count -= n

    def give(self, extents: list[Extent]) -> None:
        for start, n in extents:
            self.count += n
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start + n:  # merge with the run after
                n += self._lens.pop(self._starts.pop(i))
            if i > 0 and self._starts[i - 1] + self._lens[self._starts[i - 1]] == start:  # and before
                self._lens[self._starts[i - 1]] += n
            else:
                self._starts.insert(i, start)
                self._lens[start] = n


@dataclasses.dataclass(eq=False)
class DramEntry:
    """One shard in the pool. ``refs`` > 0 pins it; it is visible once committed."""

    key: ShardKey
    meta: ShardMeta
    parent: str | None
    extents: list[Extent]
    refs: int = 1
    discarded: bool = False  # out of the index, pages freed when the last reference goes
    created: float | None = None  # when first stored, for a shard promoted from a tier (its TTL runs from then)
    share: str | None = None  # the tenant share (quota) it counts against, if any
    owner: bytes | None = None  # the tenant key id it was stored under (encrypted stores): served only under it
    expires: float | None = None  # the time (time.time()) from which it is never served: its tiers' TTL
    # The lossy codec its KV was decoded from (promoted from a tier storing fp8, say); NONE: exact, as it was put.
    codec: codecs.Codec = codecs.NONE

    def servable(self, owner: bytes | None, now: float) -> bool:
        return self.owner == owner and (self.expires is None or now < self.expires)

    @property
    def pages(self) -> int:
        return sum(n for _, n in self.extents)


class Refused(str, enum.Enum):
    """Why a shard was not reserved (equal to its name as a string). A ``str`` mixin, not ``enum.StrEnum``: that
    is Python 3.11's, and kvtier runs on 3.10."""

    PRESENT = "present"  # DRAM holds it, or another reservation is writing it
    FULL = "full"  # no room, even evicting every idle entry

    def __str__(self) -> str:  # as StrEnum's: the value, in str() and f-strings alike, on every Python
        return str.__str__(self)


Reservation = DramEntry | Refused


def available_memory() -> int | None:
    """Bytes this process could still allocate: the host's available memory, or less under a cgroup limit."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            found.extend(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            found.append(int(limit) - current)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _check_memory(capacity: int) -> None:
    """Refuse a budget the machine cannot hold now: touching it all would end in the OOM killer."""
    available = available_memory()
    if available is not None and capacity > available:
        raise ConfigError(f"dram.capacity_bytes: {capacity} bytes ({capacity / 2**30:.1f} GiB) is more than the "
                          f"memory available now ({available / 2**30:.1f} GiB); lower it")


HEADROOM_SPARE = 256 * 2**20  # memory the start's headroom never takes


def warm_headroom(nbytes: int) -> int:
    """Touch ``nbytes`` of fresh memory and give it back (fewer when the machine has less available, less
    :data:`HEADROOM_SPARE`); the bytes touched. After the pool took memory the OS had ready, this leaves as much
    ready again for the engine's next allocations: on a host that backs memory lazily (a VM) the first touch of a
    page the host has not backed yet costs several times a warm one, and the engine's first request would pay it
    (``benchmarks/bench_noreuse.py``: the first prompt took 1.12x vLLM alone's without this, 0.97x with it)."""
    available = available_memory()
    if available is not None:
        nbytes = min(nbytes, max(0, available - HEADROOM_SPARE))
    if nbytes <= 0:
        return 0
    try:
        torch.empty(nbytes, dtype=torch.uint8).fill_(0)  # freed at once: its pages go back to the OS
    except RuntimeError as exc:  # refused (strict overcommit, a limit): the start goes on without it
        log.warning("dram: the start's headroom of %d bytes could not be touched (%s); the first requests may "
                    "wait on fresh memory", nbytes, exc)
        return 0
    return nbytes


class DramPool:
    """Fixed-budget shard cache over one preallocated buffer."""

    def __init__(self, capacity_bytes: int, page_bytes: int, policy: EvictionPolicy,
                 pin_memory: bool | None = None, on_evict: Callable[[DramEntry], None] | None = None,
                 allocate: bool = True, headroom_bytes: int = 0) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.page_bytes = page_bytes
        self.pages = capacity_bytes // page_bytes
        self.capacity_bytes = self.pages * page_bytes
        self.pinned = pin_memory
        # warm_headroom's, after the allocation; none for a pinned pool (a GPU host: the engine computes in GPU memory)
        self._headroom = 0 if pin_memory else min(headroom_bytes, self.capacity_bytes)
        self._arena: torch.Tensor | None = None
        self._alloc_lock = threading.Lock()
        if allocate:
            self.allocate()
        self._free = _FreePages(self.pages)
        self._policy = policy
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._index: dict[tuple[str, str], dict[HeadRange, DramEntry]] = {}
        self._pending: set[ShardKey] = set()
        self._by_key: dict[ShardKey, DramEntry] = {}
        self._idle_pages = 0  # pages of committed entries with no reference: what eviction could free
        self._shares = PoolShares(page_bytes)  # tenant shares (quotas), set by the store from its placement rules
        self._changes: ChangeFeed[tuple[ShardKey, bool]] = ChangeFeed(self._lock)  # (key, now visible?)

    def allocate(self) -> None:
        """Allocate and touch the pool (done at start unless deferred: a process that only looks up, such as
        vLLM's scheduler in its API server, never needs it). Idempotent."""
        with self._alloc_lock:
            if self._arena is not None:
                return
            _check_memory(self.capacity_bytes)
            try:
                arena = torch.empty(self.capacity_bytes, dtype=torch.uint8, pin_memory=self.pinned)
            except RuntimeError as exc:  # torch reports a failed allocation as a RuntimeError
                raise ConfigError(f"dram.capacity_bytes: cannot allocate {self.capacity_bytes} bytes"
                                  f"{' of pinned memory' if self.pinned else ''}: {exc}") from exc
            arena.fill_(0)  # touch every page now, not on the hot path
            self._arena = arena
            warm_headroom(self._headroom)

    @property
    def allocated(self) -> bool:
        return self._arena is not None

    def _allocated_arena(self) -> torch.Tensor:
        """The pool's memory, for an entry's pages: an entry implies it (reserving one allocates it first)."""
        assert self._arena is not None, "an entry while the pool is not allocated"
        return self._arena

    # -- sizes -------------------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return (self.pages - self._free.count) * self.page_bytes

    def __len__(self) -> int:
        return len(self._by_key)

    # -- two-phase insert --------------------------------------------------------------------------------------
    def reserve(self, key: ShardKey, meta: ShardMeta, parent: str | None, owner: bytes | None = None) -> Reservation:
        """Claim pages for ``key`` (to be served under ``owner``), evicting unpinned entries as needed. The entry
        holds one reference."""
        if self._arena is None:
            self.allocate()  # deferred until the first shard needs it
        with self._lock:
            return self._reserve_locked(key, meta, parent, owner)

    def _held_locked(self, key: ShardKey, meta: ShardMeta, owner: bytes | None) -> DramEntry | bool:
        """Whether ``key`` is held in this shape, servable under ``owner`` (its entry), or being written (True);
        False if not, discarding an entry under it that is not (another shape, e.g. from a hostile promotion; a
        tenant key forgotten since; expired): the put replaces it."""
        if key in self._pending:
            return True
        held = self._by_key.get(key)
        if held is None:
            return False
        if held.meta == meta and held.servable(owner, time.time()):
            self._touch_locked(held)  # stored again: as recent as a read (the simulator's model too)
            return held
        self._discard_locked(held)
        return False

    def _reserve_locked(self, key: ShardKey, meta: ShardMeta, parent: str | None, owner: bytes | None) -> Reservation:
        if self._held_locked(key, meta, owner) is not False:
            return Refused.PRESENT
        need = -(-meta.nbytes // self.page_bytes)
        share = self._shares.of(key.namespace)
        if self._free.count + self._idle_pages < need or (share is not None and not self._fit_share(share, need)):
            return Refused.FULL  # even evicting every idle entry would not make room: evict nothing
        self._evict_until(need)
        extents = self._free.take(need)
        assert extents is not None, "free pages were counted"
        self._pending.add(key)
        entry = DramEntry(key, meta, parent, extents, share=None if share is None else share.name, owner=owner)
        self._shares.charge(entry.share, entry.pages)  # from now (given back by abort)
        return entry

    # -- tenant shares -----------------------------------------------------------------------------------------
    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        """Count ``namespace``'s entries against the tenant share ``share`` of ``quota_bytes`` (None: no share).
        Entries already held keep what they counted against (:mod:`kvtier.quotas.pool`)."""
        with self._lock:
            self._shares.set(namespace, share, quota_bytes)

    def share_bytes(self, share: str) -> int:
        with self._lock:
            return self._shares.bytes(share)

    def _fit_share(self, share: Share, need: int, keep: set[ShardKey] | frozenset[ShardKey] = frozenset()) -> bool:
        """Make room for ``need`` more pages inside a tenant's share by evicting its own least recently used idle
        entries, never those in ``keep`` (the chunks the same put found held). False, evicting nothing, if that
        cannot."""
        found = self._shares.fit(share, need, lambda k: self._by_key[k].pages,
                                 lambda k: self._by_key[k].refs == 0 and k not in keep)
        for key in found or ():
            self._evict(self._by_key[key])
        return found is not None

    def _evict_until(self, free: int, keep: Collection[ShardKey] = ()) -> None:
        """Evict until ``free`` pages are free, never one of ``keep`` (the caller counted what that leaves)."""
        evictable = (lambda k: k not in keep and self._evictable(k)) if keep else self._evictable
        while self._free.count < free:
            victim = self._policy.victim(evictable)
            assert victim is not None, "idle pages were counted but no entry is evictable"
            self._evict(self._by_key[victim])  # type: ignore[index]  # the policy hands back the ShardKeys it was given

    def _idle_pages_of(self, keys: Collection[ShardKey]) -> int:
        return sum(e.pages for k in keys if (e := self._by_key.get(k)) is not None and e.refs == 0)

    def reserve_chunks(self, chunks: list[tuple[ShardKey, str | None]], meta: ShardMeta,
                       owner: bytes | None = None, prefix: Collection[ShardKey] = ()) -> list[Reservation]:
        """:meth:`reserve` for consecutive chunks of one shape (key, parent) and owner, in order, under one lock;
        the list ends at the first :attr:`Refused.FULL`. Each chunk is touched or makes room exactly as :meth:`reserve`
        would in turn (the same victims: the simulator's model, kvtier.sim.cache, is this order), but the pages
        are taken only after the last chunk, as one run where the free pages allow, so their copy is one
        (:meth:`fill_chunks`): evicting an old prefix leaf frees its pages back to front, and taking pages chunk
        by chunk would give each chunk a run of its own.

        Room for a chunk never comes from the chunks before it (held ones, or ``prefix``, the prompt's chunks
        before these): the chunks after a gap are never found, so the put stops there (docs/benchmarks.md)."""
        if not chunks:
            return []
        if self._arena is None:
            self.allocate()
        need = -(-meta.nbytes // self.page_bytes)
        out: list[Reservation] = []
        fresh: dict[ShardKey, int] = {}  # new key -> its place in `out`
        held: set[ShardKey] = set()  # found held: the prefix this put reports stored, never evicted for a share
        own = set(prefix)  # the chunks before the one being reserved: never evicted for it (see above)
        with self._lock:
            for key, _ in chunks:
                if key in fresh or self._held_locked(key, meta, owner) is not False:
                    out.append(Refused.PRESENT)
                    held.add(key)
                    own.add(key)
                    continue
                # Free plus idle pages is what evicting can reach; the pages of the new chunks before this one are
                # still counted free (taken below), so this makes room for all of them, as reserve in turn would.
                wanted = (len(fresh) + 1) * need
                share = self._shares.of(key.namespace)
                # (the share counts this call's fresh chunks already: they are reserved below as each is admitted)
                if self._free.count + self._idle_pages - self._idle_pages_of(own) < wanted or (
                        share is not None and not self._fit_share(share, need, held)):
                    out.append(Refused.FULL)
                    break
                self._shares.charge(None if share is None else share.name, need)
                self._evict_until(wanted, own)
                fresh[key] = len(out)
                out.append(Refused.PRESENT)  # replaced by its entry below
            run = self._free.take_run(len(fresh) * need) if len(fresh) > 1 else None
            for n, (key, i) in enumerate(fresh.items()):
                extents = [(run[0] + n * need, need)] if run is not None else self._free.take(need)
                assert extents is not None, "free pages were counted"
                self._pending.add(key)
                share = self._shares.of(key.namespace)  # counted against it in the loop above
                out[i] = DramEntry(key, meta, chunks[i][1], extents, share=None if share is None else share.name,
                                   owner=owner)
        return out

    def fill_chunks(self, fill: Callable[[int, torch.Tensor], None], chunks: list[tuple[int, DramEntry]],
                    device: torch.device) -> None:
        """Have ``fill(i, view)`` write chunk ``i`` (and those after it) into the reserved entries of ``chunks``.

        ``view`` is ``[count, *shape]`` over consecutive entries that lie at one fixed stride in the arena (a run,
        filled by one strided copy: one large copy runs at memcpy speed, where many small ones pay a per-copy
        cost each), or a one-chunk buffer for an entry whose pages are scattered, copied in after. ``device`` is
        where ``fill`` copies from (see :meth:`runs`). From a CUDA tensor into pinned memory the copies may be
        asynchronous: synchronize the stream before commit.
        """
        for run in self.runs(chunks, device):
            i0, first = run[0]
            if len(first.extents) == 1:
                fill(i0, self.run_view(first, len(run)))
                continue
            buf = torch.empty((1, *first.meta.shape), dtype=first.meta.dtype)
            fill(i0, buf)
            flat = buf.view(-1).view(torch.uint8)
            for start, region in self._regions(first):
                region.copy_(flat[start:start + region.numel()])

    def runs(self, chunks: list[tuple[int, DramEntry]], device: torch.device) -> list[list[tuple[int, DramEntry]]]:
        """Group consecutive chunks whose single-extent entries follow each other at a fixed page stride.

        To or from another device, only entries that fill their pages exactly are grouped: a run with gaps is
        not contiguous, and torch would stage such a cross-device copy through a slow temporary.
        """
        gapless = device.type == "cpu"
        runs: list[list[tuple[int, DramEntry]]] = []
        for i, entry in chunks:
            if runs and len(entry.extents) == 1 and (gapless or entry.meta.nbytes % self.page_bytes == 0):
                j, prev = runs[-1][-1]
                if (len(prev.extents) == 1 and i == j + 1 and prev.meta == entry.meta
                        and entry.extents[0][0] == prev.extents[0][0] + prev.extents[0][1]):
                    runs[-1].append((i, entry))
                    continue
            runs.append([(i, entry)])
        return runs

    def run_view(self, first: DramEntry, count: int) -> torch.Tensor:
        """``count`` entries of ``first``'s shape laid out one after another from ``first``'s page on."""
        meta = first.meta
        step = first.extents[0][1] * self.page_bytes
        start = first.extents[0][0] * self.page_bytes
        region = self._allocated_arena()[start:start + (count - 1) * step + meta.nbytes].view(meta.dtype)
        inner = torch.empty(meta.shape, device="meta").stride()
        return region.as_strided((count, *meta.shape), (step // meta.dtype.itemsize, *inner))

    def write_bytes(self, entry: DramEntry, payload: memoryview) -> None:
        """Copy a verified payload into a reserved entry."""
        src = frame.byte_tensor(payload)
        for start, region in self._regions(entry):
            region.copy_(src[start:start + region.numel()])

    def commit(self, entry: DramEntry, keep_refs: int = 0) -> None:
        """Make a reserved entry visible; it keeps ``keep_refs`` references (e.g. for queued cascade writes)."""
        with self._lock:
            self._pending.discard(entry.key)
            entry.refs = keep_refs
            if keep_refs == 0:
                self._idle_pages += entry.pages
            self._by_key[entry.key] = entry
            self._index.setdefault((entry.key.namespace, entry.key.chunk), {})[entry.key.heads] = entry
            self._policy.insert(entry.key, entry.key.chunk, entry.parent)
            self._shares.committed(entry.share, entry.key)  # (its pages count since it was reserved)
            self._changes.publish_locked((entry.key, True))

    def abort(self, entry: DramEntry) -> None:
        with self._lock:
            self._pending.discard(entry.key)
            self._free.give(entry.extents)
            self._shares.charge(entry.share, -entry.pages)

    # -- reads -------------------------------------------------------------------------------------------------
    def ranges(self, namespace: str, chunk: str) -> list[HeadRange]:
        """The head ranges held of one chunk, servable or not (a lookup's answer: :meth:`acquire` decides)."""
        with self._lock:
            return list(self._index.get((namespace, chunk), ()))

    def acquire(self, namespace: str, chunk: str, heads: list[HeadRange],
                owner: bytes | None = None) -> list[DramEntry] | None:
        """Pin the entries for ``heads`` of a chunk and mark them used; None if one is gone, or not servable under
        ``owner`` (then discarded: stored under a tenant key forgotten since, or expired)."""
        now = time.time()
        with self._lock:
            found = self._index.get((namespace, chunk), {})
            if any(h not in found for h in heads):
                return None
            entries = [found[h] for h in heads]
            stale = [e for e in entries if not e.servable(owner, now)]
            for entry in stale:
                self._discard_locked(entry)
            if stale:
                return None
            for entry in entries:
                self._pin_locked(entry)
                self._touch_locked(entry)
            return entries

    def _touch_locked(self, entry: DramEntry) -> None:
        self._policy.touch(entry.key)
        self._shares.touched(entry.share, entry.key)

    def _pin_locked(self, entry: DramEntry) -> None:
        if entry.refs == 0:
            self._idle_pages -= entry.pages
        entry.refs += 1

    def release(self, entry: DramEntry) -> None:
        with self._lock:
            self._release_locked(entry)

    def _release_locked(self, entry: DramEntry) -> None:
        assert entry.refs > 0, f"release of unpinned entry {entry.key.name}"
        entry.refs -= 1
        if entry.refs == 0:
            if self._by_key.get(entry.key) is entry:
                self._idle_pages += entry.pages
            elif entry.discarded:
                self._free.give(entry.extents)  # the last reader of a discarded entry is done

    def discard(self, entry: DramEntry) -> None:
        """Remove a committed entry from the index now (e.g. it holds another shape than its readers expect);
        its pages are freed once the last reference to it is released."""
        with self._lock:
            if self._by_key.get(entry.key) is entry:
                self._discard_locked(entry)

    def _discard_locked(self, entry: DramEntry) -> None:
        self._unindex(entry)
        if entry.refs == 0:
            self._idle_pages -= entry.pages
            self._free.give(entry.extents)
        else:
            entry.discarded = True

    def tensor(self, entry: DramEntry) -> torch.Tensor:
        """The entry's shard as a tensor: a view when its pages are contiguous, else a copy."""
        if len(entry.extents) == 1:
            start = entry.extents[0][0] * self.page_bytes
            arena = self._allocated_arena()
            return arena[start:start + entry.meta.nbytes].view(entry.meta.dtype).view(entry.meta.shape)
        out = torch.empty(entry.meta.nbytes, dtype=torch.uint8)
        for start, region in self._regions(entry):
            out[start:start + region.numel()].copy_(region)
        return out.view(entry.meta.dtype).view(entry.meta.shape)

    def views(self, entry: DramEntry) -> list[memoryview]:
        """Zero-copy byte views of a pinned entry's payload, in order (for cascade writes)."""
        return [memoryview(region.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer (stubs say so on 3.12+)
                for _, region in self._regions(entry)]

    def _regions(self, entry: DramEntry) -> list[tuple[int, torch.Tensor]]:
        """The entry's payload in the arena: (its offset in the payload, the bytes there), one per extent."""
        return _regions(self._allocated_arena(), entry, self.page_bytes)

    def audit(self) -> dict[str, int]:
        """Accounting as tests check it: references held, pending reservations, and page counts that must agree
        (``lost_pages``, ``idle_mismatch`` and ``share_mismatch`` are 0 when nothing leaked)."""
        with self._lock:
            entries = list(self._by_key.values())
            held = sum(e.pages for e in entries)
            idle = sum(e.pages for e in entries if e.refs == 0)
            pending = len(self._pending)
            shares_leaked = not pending and self._shares.mismatch((e.share, e.pages) for e in entries)
            return {"refs": sum(e.refs for e in entries), "pending": pending,
                    "lost_pages": self.pages - self._free.count - held if not pending else 0,
                    "idle_mismatch": self._idle_pages - idle, "share_mismatch": int(shares_leaked)}

    # -- eviction ----------------------------------------------------------------------------------------------
    def _evictable(self, key: Hashable) -> bool:
        return self._by_key[key].refs == 0  # type: ignore[index]  # the policy asks of the ShardKeys it was given

    def _unindex(self, entry: DramEntry) -> None:
        del self._by_key[entry.key]
        self._shares.removed(entry.share, entry.key, entry.pages)
        slot = self._index[(entry.key.namespace, entry.key.chunk)]
        del slot[entry.key.heads]
        if not slot:
            del self._index[(entry.key.namespace, entry.key.chunk)]
        self._policy.remove(entry.key)
        self._changes.publish_locked((entry.key, False))

    def watch(self) -> int:
        """Start recording, for one reader, every entry that becomes visible or goes; returns the reader's
        handle for :meth:`take_changes`. (Nothing is recorded without a reader: a list nobody drains would grow.)"""
        return self._changes.watch()

    def take_changes(self, watcher: int) -> list[tuple[ShardKey, bool]]:
        """The entries that became visible (True) or went (False) since this reader's last call, in order."""
        return self._changes.take(watcher)

    def _evict(self, entry: DramEntry) -> None:
        assert entry.refs == 0, f"eviction of pinned entry {entry.key.name}"
        self._idle_pages -= entry.pages
        self._unindex(entry)
        self._free.give(entry.extents)
        if self._on_evict is not None:
            self._on_evict(entry)

    def evict_all(self) -> int:
        """Evict every unpinned entry (e.g. to measure cold reads); returns how many went."""
        with self._lock:
            victims = [e for e in self._by_key.values() if e.refs == 0]
            for entry in victims:
                self._evict(entry)
            return len(victims)

    def discard_owned(self, owners: set[bytes]) -> int:
        """Remove every committed entry of ``owners`` (tenant key ids: forgotten tenants) from the index now (a
        pinned one's pages are freed when its last reader is done); how many went."""
        with self._lock:
            victims = [e for e in self._by_key.values() if e.owner in owners]
            for entry in victims:
                self._discard_locked(entry)
            return len(victims)


def _regions(arena: torch.Tensor, entry: DramEntry, page_bytes: int) -> list[tuple[int, torch.Tensor]]:
    regions, offset = [], 0
    for start, n in entry.extents:
        size = min(n * page_bytes, entry.meta.nbytes - offset)
        regions.append((offset, arena[start * page_bytes:start * page_bytes + size]))
        offset += size
    return regions
