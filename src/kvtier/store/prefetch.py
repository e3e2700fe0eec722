"""Read-ahead of a get's shards from the secondary tiers: which shard reads to line up (:meth:`Prefetch.plan`),
starting them a few ahead of their use on each tier's reading threads (:meth:`Prefetch.read_ahead`), batched
reads straight into DRAM entries, and sealed shards decrypted on threads of their own. Runs in the store's
process; the pools are the store's, shared by its concurrent gets."""

from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import CancelledError, Future

from kvtier.dram import DramEntry, DramPool
from kvtier.keys import HeadRange, ShardKey, rank_heads
from kvtier.store.guard import GuardedTier
from kvtier.store.plan import Fetched, Filling, Read, plan_heads
from kvtier.store.shards import ShardReads, raised
from kvtier.threads import DaemonPool

log = logging.getLogger("kvtier.store")
# Shard reads a get keeps in flight ahead of the one it copies, from tiers that read ahead (Tier.read_ahead):
# the next reads overlap verifying this one, and what is held stays bounded (a 128K-token prompt does not reserve
# all its chunks at once; a 16K-token load's peak extra RSS: 0.2 MB from a disk, 0.8 MB from Redis, 7.6 MB from
# S3, load-memory-2026-12-06.json). Measured, 2 ahead -> 4: a 32-chunk get from a disk's page cache 62 -> 54 ms,
# a 16-chunk load from S3 99 -> 95 ms, from Redis no faster (0.049 s; 0.057 s read inline).
READ_AHEAD = 4
# From a tier that batches its reads (Tier.batch_reads), each reading thread reads up to _BATCH shards in one call,
# straight into their reserved DRAM entries, with up to _BATCH_AHEAD shards in flight: the transfers of later
# batches overlap the verification of the first (into DRAM pages; a shard whose entry cannot be reserved is read
# as bytes, so up to _BATCH_AHEAD shards' bytes may be held when DRAM is full).
_BATCH = 4
_BATCH_AHEAD = 16
_READ_THREADS = 4  # per tier, shared by the store's concurrent gets
# Threads that decrypt sealed shards read ahead (Prefetch._fill_sealed), shared by all tiers and gets: one beside
# the reading threads on two cores, more where there are more cores for concurrent loads.
_DECRYPT_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))
# Seconds close waits for batched reads under way (native code writing into DRAM pages: Mooncake's batch get);
# one stuck on a stalled server ends with the process.
CLOSE_WAIT = 5.0


def _never_ran(batch: list[tuple[ShardKey, DramEntry, Future[float | None]]], job: Future[None]) -> None:
    """A batch's job cancelled before it ran (the store closing): each of its reads ends failed, so that no load
    waits on it and the entries of those no load needs are aborted (their futures' callbacks)."""
    if job.cancelled():
        for key, _, future in batch:
            if not future.done():
                future.set_exception(CancelledError(f"{key.name}: not read, the store closed"))


class Prefetch:
    """The reading threads (a pool per tier: reads stuck in a stalled server hold up no other tier's) and, with
    encryption, the decrypting threads."""

    def __init__(self, dram: DramPool, guards: list[GuardedTier], shards: ShardReads, chunk_tokens: int,
                 sealed: bool) -> None:
        self._dram = dram
        self._shards = shards
        self._chunk_tokens = chunk_tokens
        self._readers = {g.name: DaemonPool(f"kvtier-read-{g.name}", _READ_THREADS) for g in guards}
        # Sealed shards read ahead are decrypted here, while the reading threads read the next ones.
        self._decrypting = DaemonPool("kvtier-decrypt", _DECRYPT_THREADS) if sealed else None

    def reads_ahead(self, guard: GuardedTier) -> bool:
        """Whether a get reads ``guard``'s shards ahead: where the tier asks for it (on reading threads), and for
        every tier when objects are sealed (a local disk's shard is then read on the caller's thread and decrypted
        on another while the next one is read: :meth:`_fill_sealed`)."""
        return guard.read_ahead or self._decrypting is not None

    def plan(self, read: Read, chunks: list[str], first: int) -> None:
        """Ask each tier once which of ``chunks[first:]`` it holds, for the chunks DRAM and the tiers before it
        lack, and line up the shard reads that would fill them, to be started :data:`READ_AHEAD` ahead of their
        use."""
        if not read.tiers:
            return
        read.parents = {c: chunks[i - 1] if i else None for i, c in enumerate(chunks)}
        in_dram = {c: plan_heads(read, self._dram.ranges(read.namespace, c)) for c in chunks[first:]}
        missing = [c for c, plan in in_dram.items() if plan is None]
        if missing:  # what this read fetches reserves DRAM, evicting idle entries: first pin the read's own
            for chunk, plan in in_dram.items():
                for rng, _, _ in [] if plan is None else plan[1]:
                    read.pinned.extend(self._dram.acquire(read.namespace, chunk, [rng], read.owner) or [])
        own = None if read.kv_heads is None else rank_heads(read.kv_heads, read.tp_rank, read.tp_size)
        for guard in read.tiers:
            if not missing:
                break
            if own is not None and not guard.heads_in_one_call:
                # A question per chunk (S3's listings, one after another's round trip): take the read's own heads
                # as the shard each holds (written at this TP degree) and read it; from the first chunk whose shard
                # is not there, the rest are asked about at once (unguess).
                answer = dict(zip(missing, guard.openable(read.namespace, missing, [[own] for _ in missing])))
                unopened = [c for c in missing if not answer[c]]  # this process lacks its key: ask what else is there
                answer.update(zip(unopened, guard.heads(read.namespace, unopened) if unopened else []))
                read.guessed[guard.name] = [c for c in missing if c not in unopened]
            else:
                answer = dict(zip(missing, guard.heads(read.namespace, missing)))
            read.heads[guard.name] = answer
            lined, missing = self._line_up(read, guard, missing, answer)
            read.ahead += lined
        if missing:  # no source holds this chunk: the read stops there, so nothing beyond it is read ahead
            order = {c: i for i, c in enumerate(chunks)}
            stop = min(order[c] for c in missing)
            read.ahead = [item for item in read.ahead if order[item[1].chunk] < stop]
        read.ahead.reverse()  # popped from the end, in chunk order
        self.read_ahead(read)

    def _line_up(self, read: Read, guard: GuardedTier, chunks: list[str], answer: dict[str, list[HeadRange]]) \
            -> tuple[list[tuple[GuardedTier, ShardKey, str | None]], list[str]]:
        """The shard reads from ``guard`` that fill what DRAM lacks of ``chunks`` (in order), given what the tier
        holds of each; and the chunks that neither holds whole."""
        lined, still = [], []
        ahead = (self.reads_ahead(guard) or guard.batch_reads) and not (read.by_layers and guard.ranged_reads)
        for chunk in chunks:
            dram = self._dram.ranges(read.namespace, chunk)
            found = plan_heads(read, dram + answer[chunk])
            if found is None:
                still.append(chunk)
            elif ahead:
                lined += [(guard, ShardKey(read.namespace, chunk, rng), read.parents.get(chunk))
                          for rng, _, _ in found[1] if rng not in dram]
        return lined, still

    def unguess(self, read: Read, guard: GuardedTier, chunk: str) -> None:
        """``chunk``'s shard of the reader's own heads was not in ``guard``'s tier (written at another TP degree):
        ask about it and every chunk planned the same way after it, in one question, and read those ahead from the
        answer instead. Reads of guessed shards the answer does not name are abandoned (their slots freed); those it
        names and already started stand."""
        guessed = read.guessed.pop(guard.name, [])
        rest = guessed[guessed.index(chunk):] if chunk in guessed else [chunk]
        answer = dict(zip(rest, guard.heads(read.namespace, rest)))
        read.heads.setdefault(guard.name, {}).update(answer)
        for name, key in [k for k in read.started if k[0] == guard.name and k[1].chunk in answer]:
            if key.heads not in answer[key.chunk]:
                self.abandon(read.started.pop((name, key)))
        lined, _ = self._line_up(read, guard, rest, answer)
        lined = [item for item in lined if (guard.name, item[1]) not in read.started]
        # this tier's lined-up guesses would only miss; every read stays in chunk order (popped from the end)
        order = {c: i for i, c in enumerate(read.parents)}
        kept = [item for item in read.ahead if item[0] is not guard]
        read.ahead = sorted(kept + lined[::-1], key=lambda item: -order.get(item[1].chunk, 0))
        self.read_ahead(read)

    def abandon(self, started: Future[Fetched] | Filling) -> None:
        """A started read no longer needed: cancelled if it has not begun; a read into a DRAM entry has its entry
        aborted once it has ended (at once if it never began or has ended). Never waits."""
        if isinstance(started, Filling):
            started.future.cancel()
            started.future.add_done_callback(lambda _: self._dram.abort(started.entry))
        else:
            started.cancel()

    def read_ahead(self, read: Read) -> None:
        """Start the next lined-up shard reads, keeping at most :data:`READ_AHEAD` of them started and not yet
        taken (running or done: a done one holds its bytes). Once the read knows its shape, each reads straight
        into a DRAM entry reserved for it (:class:`Filling`), verified there by the reading thread (a sealed shard
        from a local disk: read here, decrypted on a decrypting thread, :meth:`_fill_sealed`): no read buffer, and
        the check overlaps the next read. A tier that batches its reads gets them :data:`_BATCH` at a time,
        up to :data:`_BATCH_AHEAD` started (:meth:`_read_batch`)."""
        while read.ahead:
            guard, key, parent = read.ahead[-1]
            batch = guard.batch_reads and read.shape is not None
            if (_BATCH_AHEAD - len(read.started) < min(_BATCH, len(read.ahead))) if batch else \
                    len(read.started) >= READ_AHEAD:
                break  # (a batch waits for room for a whole one)
            read.ahead.pop()
            if guard.reads.resting() or (guard.name, key) in read.failed:
                continue  # (a shard whose read failed in this read is never read again by it)
            if batch:
                keys = [(key, parent)]
                while read.ahead and read.ahead[-1][0] is guard and len(keys) < _BATCH:
                    _, more, more_parent = read.ahead.pop()
                    if (guard.name, more) not in read.failed:
                        keys.append((more, more_parent))
                self._read_batch(read, guard, keys)
                continue
            self._start(read, guard, key, parent)

    def _start(self, read: Read, guard: GuardedTier, key: ShardKey, parent: str | None) -> None:
        readers = self._readers[guard.name]
        entry = None if read.shape is None else self._dram.reserve(
            key, read.shape.meta(self._chunk_tokens, key.heads), parent, read.owner)
        if not isinstance(entry, DramEntry):
            # the shape not known yet, the shard being written by another read, or no room: its bytes
            read.started[(guard.name, key)] = readers.submit(functools.partial(self._shards.get, guard, key))
            return
        try:
            if self._decrypting is not None and guard.local and not guard.coded:
                future = self._fill_sealed(guard, key, entry)
            else:
                future = readers.submit(functools.partial(self._shards.read_into, guard, key, entry))
        except BaseException:
            self._dram.abort(entry)  # e.g. the store closed meanwhile
            raise
        read.started[(guard.name, key)] = Filling(entry, future)

    def _read_batch(self, read: Read, guard: GuardedTier, keys: list[tuple[ShardKey, str | None]]) -> None:
        """Start one batched read of ``keys`` from a tier into DRAM entries reserved for them (a shard whose entry
        cannot be reserved is read as bytes, alone). Each shard's future is marked running from the start: a
        read that no longer needs it cannot cancel it, and aborts its entry only once the batch has ended."""
        assert read.shape is not None
        readers = self._readers[guard.name]
        batch: list[tuple[ShardKey, DramEntry, Future[float | None]]] = []
        try:
            for key, parent in keys:
                entry = self._dram.reserve(key, read.shape.meta(self._chunk_tokens, key.heads), parent, read.owner)
                if not isinstance(entry, DramEntry):
                    read.started[(guard.name, key)] = readers.submit(functools.partial(self._shards.get, guard, key))
                    continue
                future: Future[float | None] = Future()
                future.set_running_or_notify_cancel()
                batch.append((key, entry, future))
            if batch:
                job = readers.submit(lambda: self._fill_batch(guard, batch))
                job.add_done_callback(functools.partial(_never_ran, batch))
        except BaseException:
            for _, entry, _ in batch:
                self._dram.abort(entry)  # e.g. the store closed meanwhile
            raise
        for key, entry, future in batch:
            read.started[(guard.name, key)] = Filling(entry, future)

    def _fill_batch(self, guard: GuardedTier, batch: list[tuple[ShardKey, DramEntry, Future[float | None]]]) -> None:
        """On a reading thread: one :meth:`Tier.get_into_many` of the batch, then each shard verified in its
        entry, its future given the outcome (what :meth:`ShardReads.read_into` returns). Every future ends,
        whatever happens (a load waits on them)."""
        start = time.perf_counter()
        header_len = self._shards.header_len
        try:
            got: list[bytes | Exception | None] = guard.tier.get_into_many(
                [(key, header_len, self._dram.views(entry)) for key, entry, _ in batch])
            if not isinstance(got, list) or len(got) != len(batch):
                raise ValueError(f"get_into_many returned {len(got) if isinstance(got, list) else got!r:.100} "
                                 f"answers for {len(batch)} reads")
        except Exception as exc:  # noqa: BLE001 each read's outcome, counted as its fault (read_into)
            got = [exc] * len(batch)
        except BaseException as exc:  # e.g. an interrupt: the reads fail, the loads waiting on them go on
            for _, _, future in batch:
                future.set_exception(exc)
            raise
        for (key, entry, future), head in zip(batch, got):
            try:
                future.set_result(self._shards.read_into(guard, key, entry, functools.partial(raised, head), start))
            except BaseException as exc:  # noqa: BLE001 handed to the load waiting on it
                future.set_exception(exc)

    def _fill_sealed(self, guard: GuardedTier, key: ShardKey, entry: DramEntry) -> Future[float | None]:
        """Read ahead a sealed shard from a local tier read inline (a disk): read here and now into its DRAM entry
        as stored (the payload still encrypted), its decryption there and the checks (:meth:`ShardReads.read_into`)
        handed to the decrypting threads; the future gives their outcome. The caller reads the next shard while
        this one is decrypted: reading and decrypting run on two cores, a whole shard per call, so neither thread
        waits on the other for the GIL between pieces (``benchmarks/bench_sealing.py``). A shard missing or
        unreadable is counted here (as any read's fault) and its future ends at once."""
        start = time.perf_counter()
        future: Future[float | None] = Future()
        future.set_running_or_notify_cancel()  # read already: cancelling it would not spare the work
        head: bytes | Exception | None
        try:
            head = guard.tier.get_into(key, self._shards.header_len, self._dram.views(entry))
        except Exception as exc:  # noqa: BLE001 the read's outcome, counted as its fault (read_into)
            head = exc
        if not isinstance(head, bytes):  # nothing to decrypt; an interrupt here reaches the caller
            future.set_result(self._shards.read_into(guard, key, entry, lambda: raised(head), start))
            return future

        def verify() -> None:
            try:
                future.set_result(self._shards.read_into(guard, key, entry, lambda: head, start))
            except BaseException as exc:  # noqa: BLE001 handed to the load waiting on it
                future.set_exception(exc)

        assert self._decrypting is not None
        self._decrypting.submit(verify)  # raises once the store is closed: the caller aborts the entry
        return future

    def close(self, guards: list[GuardedTier]) -> None:
        """Stop the threads, then close each tier once no read is under way in it: reads still queued are cancelled
        (their DRAM entries aborted), those running are waited for (a read into DRAM pages, or one that would
        reopen what the tier's close released: Redis's connections, a directory's descriptor)."""
        deadline = time.monotonic() + CLOSE_WAIT
        for pool in self._readers.values():  # all stopped first: none runs its queue while another is waited for
            pool.stop(cancel=True)
        if self._decrypting is not None:  # they write into DRAM pages and remove what fails from its tier
            self._decrypting.close(wait=CLOSE_WAIT)
        for guard in guards:
            if not self._readers[guard.name].wait_idle(max(0.0, deadline - time.monotonic())):
                log.warning("tier %s: left open at close: a read is still under way (it ends with the process)",
                            guard.name)
                continue
            guard.tier.close()
