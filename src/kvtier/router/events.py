"""vLLM's KV events: the wire format, and one engine's stream put in order (runs in the router's event loop).

An engine publishes batches on a ZMQ PUB socket as three frames: topic, an 8-byte big-endian sequence number
(restarting at 0 with the engine process) and a msgpack ``[timestamp, events, data_parallel_rank]``. Events are
maps tagged ``"type"`` (vLLM >= 0.26, fields at their default omitted) or, from older engines, arrays whose first
item is the type. :func:`decode_batch` reads both into :class:`Stored`, :class:`Removed` and :class:`Cleared`.

:class:`Feed` applies one engine's batches to the index exactly once and in order: a gap asks the engine's
replay socket (a ROUTER; the router talks to it with a DEALER, since a REQ socket takes one reply only) for what
was missed, a sequence number that goes back means the engine restarted, and its entries are cleared.
:class:`Subscriber` moves the frames between the sockets and the feed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

BlockHash = int | bytes
END_SEQ = -1  # the replay socket's "no more batches" marker, as a signed 8-byte sequence number


class EventError(ValueError):
    """A batch or event that does not have vLLM's KV-event shape."""


@dataclasses.dataclass(frozen=True)
class Stored:
    """``BlockStored``: full blocks cached by the engine (or by an offloading tier: ``medium``, ``locality``)."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block, untagged (LoRA name, salt, mm pairs)
    group: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclasses.dataclass(frozen=True)
class Removed:
    """``BlockRemoved``: blocks evicted from ``medium``."""

    hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclasses.dataclass(frozen=True)
class Cleared:
    """``AllBlocksCleared``: the engine dropped its whole prefix cache."""


Event = Stored | Removed | Cleared


@dataclasses.dataclass(frozen=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None


# Field order of the array form (the struct's declaration order in vLLM); older engines send fewer trailing fields.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                  "ownership", "session_id")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


def _hash(value: object) -> BlockHash:
    if isinstance(value, (int, bytes)) and not isinstance(value, bool):
        return value
    raise EventError(f"a block hash must be an int or bytes, got {type(value).__name__}")


def _opt_str(fields: dict, name: str) -> str | None:
    value = fields.get(name)
    if value is None or isinstance(value, str):
        return value
    raise EventError(f"{name}: expected a string, got {type(value).__name__}")


def _opt_int(fields: dict, name: str) -> int | None:
    value = fields.get(name)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise EventError(f"{name}: expected an integer, got {type(value).__name__}")


def _list(fields: dict, name: str) -> list:
    value = fields.get(name)
    if not isinstance(value, (list, tuple)):
        raise EventError(f"{name}: expected a list, got {type(value).__name__}")
    return list(value)


def _event(raw: object) -> Event | None:
    """One event, map or array form; None for a type this router does not use (counted by the caller)."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        if len(raw) - 1 > len(names):
            raise EventError(f"{kind}: {len(raw) - 1} fields in the array form, at most {len(names)} known")
        fields = dict(zip(names, raw[1:]))
    else:
        raise EventError(f"an event must be a map with 'type' or an array starting with its type, got {raw!r:.80}")
    if kind == "BlockStored":
        hashes = tuple(_hash(h) for h in _list(fields, "block_hashes"))
        parent = fields.get("parent_block_hash")
        tokens = _list(fields, "token_ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and -2**63 <= t < 2**63 for t in tokens):
            raise EventError("token_ids: expected 64-bit integers")
        block_size = _opt_int(fields, "block_size")
        extra = fields.get("extra_keys")
        if extra is not None and (not isinstance(extra, (list, tuple)) or len(extra) != len(hashes)
                                  or not all(e is None or isinstance(e, (list, tuple)) for e in extra)):
            raise EventError("extra_keys: expected one list (or null) per block hash")
        return Stored(hashes=hashes, parent=None if parent is None else _hash(parent), token_ids=tuple(tokens),
                      block_size=block_size or 0, lora_name=_opt_str(fields, "lora_name"),
                      medium=_opt_str(fields, "medium"), extra_keys=None if extra is None else tuple(extra),
                      group=_opt_int(fields, "group_idx"), locality=_opt_str(fields, "locality"),
                      ownership=_opt_str(fields, "ownership"))
    if kind == "BlockRemoved":
        return Removed(hashes=tuple(_hash(h) for h in _list(fields, "block_hashes")),
                       medium=_opt_str(fields, "medium"), group=_opt_int(fields, "group_idx"),
                       locality=_opt_str(fields, "locality"), ownership=_opt_str(fields, "ownership"))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> tuple[Batch, int]:
    """A batch from its msgpack payload, and how many of its events were of a type the router ignores.

    Raises :class:`EventError` when the payload is not a batch; an event that is malformed fails the batch too,
    since applying the rest out of context could credit blocks the engine does not hold."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several kinds (TypeError for an unhashable map key, ...)
        raise EventError(f"not msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(raw, (list, tuple)) or len(raw) not in (2, 3) or not isinstance(raw[1], (list, tuple)):
        raise EventError(f"a batch must be [ts, events, dp_rank], got {raw!r:.80}")
    ts = raw[0]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventError(f"batch ts: expected a number, got {ts!r:.40}")
    try:
        events = [_event(e) for e in raw[1]]
    except EventError:
        raise
    except Exception as exc:  # e.g. an unhashable value where a hash belongs
        raise EventError(f"malformed event: {type(exc).__name__}: {exc}") from exc
    kept = tuple(e for e in events if e is not None)
    dp_rank = raw[2] if len(raw) == 3 else None
    return Batch(ts=float(ts), events=kept, dp_rank=dp_rank if isinstance(dp_rank, int) else None), \
        len(events) - len(kept)


class Feed:
    """One engine's batches, applied once each and in sequence order.

    ``apply`` receives the batches in order; ``clear`` forgets what the engine was credited with. ``live`` returns
    the sequence number to ask the replay socket for when batches are missing (None: go on), and the replay's
    answer goes to ``replayed``. A hole that no replay can fill any more (the engine's buffer moved past it)
    leaves the index unsure of what the engine holds: its entries are cleared and rebuilt from what follows.
    """

    def __init__(self, apply: Callable[[Batch], None], clear: Callable[[], None],
                 on_gap: Callable[[int], None] = lambda missed: None,
                 on_reset: Callable[[], None] = lambda: None) -> None:
        self._apply = apply
        self._clear = clear
        self._on_gap = on_gap
        self._on_reset = on_reset
        self.next_seq: int | None = None  # the sequence number expected next; None: nothing applied yet
        self._held: dict[int, Batch] = {}  # batches past a gap, waiting for the replay to fill it
        # What the last replay applied: the live socket may bring the same batches again. Kept by content, so a
        # restarted engine's new batch under an old number is not taken for a duplicate.
        self._recent: dict[int, Batch] = {}
        self.replaying = False
        self.generation = 0  # bumped by reset: a replay asked before a reset answers a question no longer asked

    def live(self, seq: int, batch: Batch) -> int | None:
        if self.next_seq is None:
            # Joined a running engine (or it restarted): what came before is in its replay buffer.
            self._held[seq] = batch
            return self.ask(0)
        if seq >= self.next_seq:
            self._recent.clear()  # the live stream is past what the last replay brought
        if seq == self.next_seq and not self._held:
            self._apply(batch)
            self.next_seq += 1
            return None
        if seq >= self.next_seq:
            self._held[seq] = batch
            return self.ask(self.next_seq)
        if self._held.get(seq) == batch or self._recent.get(seq) == batch:
            return None  # a duplicate of what a replay brought, queued on the live socket meanwhile
        # The sequence went back with other content: a new engine process (numbers restart at 0).
        log.warning("engine's event sequence went back from %d to %d: it restarted; its entries are cleared",
                    self.next_seq, seq)
        self.reset()
        self._held[seq] = batch
        return self.ask(0)

    def ask(self, start: int) -> int | None:
        """``start`` if no replay is out (the caller is to ask for one from there), else None."""
        if self.replaying:
            return None
        self.replaying = True
        return start

    def replay_start(self) -> int:
        """Where a replay should start: the first batch not yet applied."""
        return self.next_seq or 0

    def replayed(self, batches: Sequence[tuple[int, Batch]]) -> None:
        """The replay's answer, as complete as the engine could make it: applies it and the held batches that
        follow on. A hole still left is lost for good: counted as a gap, and the engine's entries are rebuilt
        from the batches after it."""
        self.replaying = False
        for seq, batch in batches:
            self._held.setdefault(seq, batch)
        self._recent = dict(batches)
        if self.next_seq is None and self._held and min(self._held) > 0:
            # Joined late: the engine no longer holds its first batches, so it may hold blocks never announced.
            log.info("joined an engine's events at %d: what it announced before is unknown", min(self._held))
        while self._held:
            first = min(self._held)
            if self.next_seq is not None and first < self.next_seq:
                del self._held[first]  # already applied
                continue
            if self.next_seq is not None and first > self.next_seq:
                log.warning("engine's events %d-%d are lost (no longer in its replay buffer): its entries are "
                            "rebuilt from the events after them", self.next_seq, first - 1)
                self._on_gap(first - self.next_seq)
                self._clear()
                self._on_reset()
            self._apply(self._held.pop(first))
            self.next_seq = first + 1

    def reset(self, counted: bool = True) -> None:
        """Forget the engine's entries and where its stream was (engine restarted, died, or is unknown);
        ``counted`` False when the caller counts the reset under a cause of its own."""
        self._clear()
        if counted:
            self._on_reset()
        self.generation += 1
        self.next_seq = None
        self._held.clear()
        self._recent.clear()
        self.replaying = False


_REPLAY_ROUNDS = 64  # an engine's replay socket drops what exceeds its send queue: ask again from the first hole


class Subscriber:
    """Reads one engine's event and replay sockets in the router's event loop and drives its :class:`Feed`.

    Nothing an engine sends can stop it: a message that cannot be decoded or applied is counted and skipped
    (the sequence hole it leaves is replayed), and should the task fail anyway it starts again, rebuilding the
    engine's entries from its replay buffer."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str, endpoint: str, replay_endpoint: str | None,
                 feed: Feed, *, bind: bool = False, replay_timeout_s: float = 2.0,
                 on_batch: Callable[[Batch, int], None] = lambda batch, ignored: None,
                 on_error: Callable[[str], None] = lambda reason: None,
                 on_replay: Callable[[], None] = lambda: None) -> None:
        self._ctx = ctx
        self.name = name
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self.feed = feed
        self._bind = bind
        self._replay_timeout_s = replay_timeout_s
        self._on_batch = on_batch
        self._on_error = on_error
        self._on_replay = on_replay
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._restart_s = 1.0  # doubles at each failure in a row, up to 60 s

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self.name}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if self._stopping or task.cancelled():
            return
        log.error("engine %s: KV-event task failed (%r); restarting it in %.0f s, its entries rebuilt by replay",
                  self.name, task.exception(), self._restart_s)
        self._on_error("task")
        self.feed.reset()
        asyncio.get_running_loop().call_later(self._restart_s, self._restart)
        self._restart_s = min(60.0, self._restart_s * 2)

    def _restart(self) -> None:
        if not self._stopping:
            self.start()

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def _decode(self, payload: bytes) -> Batch | None:
        try:
            batch, ignored = decode_batch(payload)
        except EventError as exc:
            log.warning("engine %s: undecodable KV-event batch skipped: %s", self.name, exc)
            self._on_error("decode")
            return None
        self._on_batch(batch, ignored)
        return batch

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # queue what the loop has not read yet rather than drop it
        try:
            (sub.bind if self._bind else sub.connect)(self._endpoint)
            # A router that starts beside running engines learns their caches from the replay buffers at once,
            # instead of waiting for their next batch.
            if self._replay_endpoint is not None:
                await self._replay(self.feed.ask(0))
            while True:
                frames = await sub.recv_multipart()
                self._restart_s = 1.0  # reading again
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._on_error("frames")
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                batch = self._decode(frames[2])
                if batch is None:
                    continue  # its sequence number stays unapplied: the next batch shows a gap, and replay retries
                try:
                    start = self.feed.live(seq, batch)
                except Exception:  # an index bug must not blind the router to this engine for good
                    log.exception("engine %s: applying KV events failed; its entries are rebuilt", self.name)
                    self._on_error("apply")
                    self.feed.reset()
                    start = self.feed.ask(0)
                await self._replay(start)
        finally:
            sub.close(linger=0)

    async def _replay(self, start: int | None) -> None:
        """Fetch from ``start`` until the engine's answer is contiguous and ended (its socket drops what
        exceeds its send queue), or stops bringing anything new; then hand it to the feed."""
        if start is None:
            return
        got: dict[int, Batch] = {}
        ask = start
        generation = self.feed.generation
        for _ in range(_REPLAY_ROUNDS if self._replay_endpoint is not None else 0):
            self._on_replay()
            batches, ended = await self._fetch(ask)
            new = [seq for seq, _ in batches if seq not in got]
            got.update((seq, b) for seq, b in batches if seq not in got)
            if not new or (ask > start and ask not in got):
                break  # nothing new, or the hole asked for is not coming (gone from the buffer, undecodable)
            low = max(start, min(got))
            hole = next((seq for seq in range(low, max(got) + 1) if seq not in got), None)
            if hole is None and ended:
                break
            ask = hole if hole is not None else max(got) + 1
        if self.feed.generation != generation:
            self.feed.replaying = False
            return  # the feed was reset meanwhile: the next batch asks for everything again
        try:
            self.feed.replayed(sorted(got.items()))
        except Exception:
            log.exception("engine %s: applying replayed KV events failed; its entries are cleared", self.name)
            self._on_error("apply")
            self.feed.reset()

    async def _fetch(self, start: int) -> tuple[list[tuple[int, Batch]], bool]:
        """The engine's buffered batches from ``start`` on, and whether its end marker came (else: what came
        before the timeout)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        got: list[tuple[int, Batch]] = []
        try:
            try:
                dealer.connect(self._replay_endpoint)
            except zmq.ZMQError as exc:
                log.warning("engine %s: cannot reach its replay socket %s: %s", self.name, self._replay_endpoint, exc)
                self._on_error("replay_endpoint")
                return got, False
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            deadline = time.monotonic() + self._replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(left * 1000):
                    log.warning("engine %s: replay from %s: no end marker within %.1f s", self.name,
                                self._replay_endpoint, self._replay_timeout_s)
                    return got, False
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._on_error("frames")
                    return got, False
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return got, True
                batch = self._decode(frames[3])
                if batch is not None:
                    got.append((seq, batch))
        finally:
            dealer.close(linger=0)
