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
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise EventError("token_ids: expected integers")
        block_size = _opt_int(fields, "block_size")
        extra = fields.get("extra_keys")
        if extra is not None and (not isinstance(extra, (list, tuple)) or len(extra) != len(hashes)):
            raise EventError("extra_keys: expected one entry per block hash")
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
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, (list, tuple)) or len(raw) not in (2, 3) or not isinstance(raw[1], (list, tuple)):
        raise EventError(f"a batch must be [ts, events, dp_rank], got {raw!r:.80}")
    ts = raw[0]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventError(f"batch ts: expected a number, got {ts!r:.40}")
    events = [_event(e) for e in raw[1]]
    kept = tuple(e for e in events if e is not None)
    dp_rank = raw[2] if len(raw) == 3 else None
    return Batch(ts=float(ts), events=kept, dp_rank=dp_rank if isinstance(dp_rank, int) else None), \
        len(events) - len(kept)


class Feed:
    """One engine's batches, applied once each and in sequence order.

    ``apply`` receives the batches in order; ``clear`` forgets what the engine was credited with. ``live`` returns
    the sequence number to ask the replay socket for when batches are missing (None: go on), and the replay's
    answer goes to ``replayed``.
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
        self._dups: range | None = None  # what the last replay applied: the live socket may bring it again
        self.replaying = False

    def live(self, seq: int, batch: Batch) -> int | None:
        if self.next_seq is None:
            # Joined a running engine (or it restarted): what came before is in its replay buffer.
            self._held[seq] = batch
            return self._ask(0)
        if seq >= self.next_seq:
            self._dups = None  # the live stream is past what the last replay brought
        if seq == self.next_seq and not self._held:
            self._apply(batch)
            self.next_seq += 1
            return None
        if seq >= self.next_seq:
            self._held[seq] = batch
            return self._ask(self.next_seq)
        if self.replaying or seq in self._held or (self._dups is not None and seq in self._dups):
            return None  # a duplicate of what a replay brought, queued on the live socket meanwhile
        # The sequence went back outside a replay: a new engine process (numbers restart at 0).
        log.warning("engine's event sequence went back from %d to %d: it restarted; its entries are cleared",
                    self.next_seq, seq)
        self.reset()
        self._held[seq] = batch
        return self._ask(0)

    def _ask(self, start: int) -> int | None:
        if self.replaying:
            return None
        self.replaying = True
        return start

    def replayed(self, batches: Sequence[tuple[int, Batch]]) -> None:
        """The replay's answer (empty when the socket gave none in time): applies what it brought and the held
        batches that follow on. A hole no replay filled is lost for good: it is skipped and counted as a gap."""
        self.replaying = False
        start = self.next_seq
        for seq, batch in batches:
            self._held.setdefault(seq, batch)
        if self.next_seq is None and self._held and min(self._held) > 0:
            # Joined late: the engine no longer holds its first batches, so it may hold blocks never announced.
            self._on_gap(min(self._held))
        while self._held:
            first = min(self._held)
            if self.next_seq is not None and first < self.next_seq:
                del self._held[first]  # already applied
                continue
            if self.next_seq is not None and first > self.next_seq:
                self._on_gap(first - self.next_seq)
            self._apply(self._held.pop(first))
            self.next_seq = first + 1
        if self.next_seq is not None:
            self._dups = range(start or 0, self.next_seq)

    def reset(self) -> None:
        """Forget the engine's entries and where its stream was (engine restarted, died, or is unknown)."""
        self._clear()
        self._on_reset()
        self.next_seq = None
        self._held.clear()
        self._dups = None


class Subscriber:
    """Reads one engine's event and replay sockets in the router's event loop and drives its :class:`Feed`."""

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
        self.last_ts: float | None = None  # wall time of the newest batch applied

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
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
        try:
            (sub.bind if self._bind else sub.connect)(self._endpoint)
            # A router that starts beside running engines learns their caches from the replay buffers at once,
            # instead of waiting for their next batch.
            if self._replay_endpoint is not None:
                await self._replay(self.feed._ask(0))
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._on_error("frames")
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                batch = self._decode(frames[2])
                if batch is None:
                    continue  # its sequence number stays unapplied: the next batch shows a gap, and replay retries
                start = self.feed.live(seq, batch)
                if start is not None:
                    await self._replay(start)
        finally:
            sub.close(linger=0)

    async def _replay(self, start: int | None) -> None:
        if start is None:
            return
        batches: list[tuple[int, Batch]] = []
        if self._replay_endpoint is not None:
            self._on_replay()
            batches = await self._fetch(start)
        self.feed.replayed(batches)

    async def _fetch(self, start: int) -> list[tuple[int, Batch]]:
        """The engine's buffered batches from ``start`` on (those that came, if it gave no end marker in time)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, Batch]] = []
        try:
            dealer.connect(self._replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            deadline = time.monotonic() + self._replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(left * 1000):
                    log.warning("engine %s: no replay from %s within %.1f s", self.name, self._replay_endpoint,
                                self._replay_timeout_s)
                    return got
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._on_error("frames")
                    return got
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return got
                batch = self._decode(frames[3])
                if batch is not None:
                    got.append((seq, batch))
        finally:
            dealer.close(linger=0)
