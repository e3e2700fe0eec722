"""vLLM's KV events: the wire format, and one engine's stream put in order (runs in the router's event loop).

An engine publishes batches on a ZMQ PUB socket as three frames: topic, an 8-byte big-endian sequence number
(restarting at 0 with the engine process) and a msgpack ``[timestamp, events, data_parallel_rank]``. Events are
maps tagged ``"type"`` (vLLM >= 0.26, fields at their default omitted) or, from older engines, arrays whose first
item is the type. :func:`decode_batch` reads both into :class:`Stored`, :class:`Removed` and :class:`Cleared`.

:class:`Feed` applies one engine's batches to the index exactly once and in order: a gap asks the engine's
replay socket for what was missed, a sequence number that goes back means the engine restarted, and its entries
are cleared. :class:`~kvtier.router.subscriber.Subscriber` moves the frames between the sockets and the feed.

Whoever can publish on an engine's sockets is trusted for what it says, not for how much: every event is
bounded (:class:`~kvtier.router.config.EventLimits`), and the feed applies what arrives in slices of at most
``slice_blocks`` blocks, the event loop serving requests between two slices.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgpack

from kvtier.router.config import EventLimits

log = logging.getLogger(__name__)

BlockHash = int | bytes
END_SEQ = -1  # the replay socket's "no more batches" marker, as a signed 8-byte sequence number


class EventError(ValueError):
    """A batch or event that does not have vLLM's KV-event shape."""

    kind = "decode"  # how the subscriber counts it (kvtier_router_event_errors{kind})


class EventTooLarge(EventError):
    """A batch with an event or array past :class:`EventLimits` (refused before it is indexed)."""

    kind = "too_large"


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
    part: int = 0  # a piece of a larger batch that the feed applies in pieces: 0 for its first (or the whole)


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


def _hashes(fields: dict, max_blocks: int) -> tuple[BlockHash, ...]:
    raw = _list(fields, "block_hashes")
    if len(raw) > max_blocks:
        raise EventTooLarge(f"{len(raw)} block hashes in one event, more than events.max_event_blocks "
                            f"({max_blocks})")
    return tuple(_hash(h) for h in raw)


def _event(raw: object, max_blocks: int) -> Event | None:
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
        hashes = _hashes(fields, max_blocks)
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
        return Removed(hashes=_hashes(fields, max_blocks),
                       medium=_opt_str(fields, "medium"), group=_opt_int(fields, "group_idx"),
                       locality=_opt_str(fields, "locality"), ownership=_opt_str(fields, "ownership"))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes, limits: EventLimits = EventLimits(),  # noqa: B008 frozen: safe to share
                 block_size: int = 16) -> tuple[Batch, int]:
    """A batch from its msgpack payload, and how many of its events were of a type the router ignores.

    Raises :class:`EventError` when the payload is not a batch; an event that is malformed fails the batch too,
    since applying the rest out of context could credit blocks the engine does not hold. An event (or any
    array: token ids are ``block_size`` a block) larger than ``limits`` allows is :class:`EventTooLarge`, refused
    by msgpack before it is built."""
    longest = limits.max_event_blocks * max(1, block_size)
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_array_len=longest, max_map_len=4096)
    except ValueError as exc:  # what msgpack raises for an array or map past the limits given
        if "exceeds max_" in str(exc):
            raise EventTooLarge(f"an array or map longer than {longest} ({limits.max_event_blocks} blocks of "
                                f"{block_size} token ids, events.max_event_blocks)") from exc
        raise EventError(f"not msgpack: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # msgpack raises several kinds (TypeError for an unhashable map key, ...)
        raise EventError(f"not msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(raw, (list, tuple)) or len(raw) not in (2, 3) or not isinstance(raw[1], (list, tuple)):
        raise EventError(f"a batch must be [ts, events, dp_rank], got {raw!r:.80}")
    ts = raw[0]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventError(f"batch ts: expected a number, got {ts!r:.40}")
    try:
        events = [_event(e, limits.max_event_blocks) for e in raw[1]]
    except EventError:
        raise
    except Exception as exc:  # e.g. an unhashable value where a hash belongs
        raise EventError(f"malformed event: {type(exc).__name__}: {exc}") from exc
    kept = tuple(e for e in events if e is not None)
    dp_rank = raw[2] if len(raw) == 3 else None
    return Batch(ts=float(ts), events=kept, dp_rank=dp_rank if isinstance(dp_rank, int) else None), \
        len(events) - len(kept)


def _blocks(event: Event) -> int:
    """What applying ``event`` costs, in blocks (a clear: one, its own slices aside)."""
    return 1 if isinstance(event, Cleared) else max(1, len(event.hashes))


def _split(event: Event, k: int) -> list[Event]:
    """``event`` as events of at most ``k`` blocks, in order; each piece of a stored chain after the first names
    the previous piece's last block as its parent, which the index has just learned."""
    if isinstance(event, Cleared) or len(event.hashes) <= k:
        return [event]
    n = len(event.hashes)
    if isinstance(event, Removed):
        return [dataclasses.replace(event, hashes=event.hashes[i:i + k]) for i in range(0, n, k)]
    if len(event.token_ids) % n:
        return [event]  # not whole blocks: the index skips it whole, at no cost
    bs = len(event.token_ids) // n
    return [dataclasses.replace(event, hashes=event.hashes[i:i + k],
                                parent=event.parent if i == 0 else event.hashes[i - 1],
                                token_ids=event.token_ids[i * bs:(i + k) * bs],
                                extra_keys=None if event.extra_keys is None else event.extra_keys[i:i + k])
            for i in range(0, n, k)]


def pieces(batch: Batch, k: int) -> list[Batch]:
    """``batch`` as batches of at most ``k`` blocks each (``part`` 0, 1, ...), for the feed to apply one a slice."""
    if sum(_blocks(e) for e in batch.events) <= k:
        return [batch]
    groups: list[list[Event]] = [[]]
    size = 0
    for event in batch.events:
        for piece in _split(event, k):
            if groups[-1] and size + _blocks(piece) > k:
                groups.append([])
                size = 0
            groups[-1].append(piece)
            size += _blocks(piece)
    return [dataclasses.replace(batch, events=tuple(group), part=i) for i, group in enumerate(groups)]


@dataclasses.dataclass
class _Work:
    """Work on the index, pending in order: a batch's piece to apply or a clear; ``steps`` once it began, its
    remaining slices (a clear runs a slice at a time)."""

    run: Callable[[], Iterable[None] | None]
    blocks: int
    steps: Iterator[None] | None = None


SLICE_BLOCKS = 2048  # index work between two turns of the event loop (~20 ms at ~9 us a stored block)
MAX_REPLAY = 16384  # batches one replay may bring (vLLM buffers 10,000 steps by default)


class Feed:
    """One engine's batches, applied once each and in sequence order.

    ``apply`` receives the batches in order; ``clear`` forgets what the engine was credited with (either may
    return an iterator of slices, run one per :meth:`drain`). ``live`` returns the sequence number to ask the
    replay socket for when batches are missing (None: go on), and the replay's answer goes to ``replayed``. A
    hole that no replay can fill any more (the engine's buffer moved past it) leaves the index unsure of what
    the engine holds: its entries are cleared and rebuilt from what follows.

    ``live`` and ``replayed`` only queue the work; :meth:`drain` does it, ``slice_blocks`` blocks at a time, so
    that a large batch or replay never holds the event loop for long.
    """

    def __init__(self, apply: Callable[[Batch], Iterable[None] | None], clear: Callable[[], Iterable[None] | None],
                 on_gap: Callable[[int], None] = lambda missed: None,
                 on_reset: Callable[[], None] = lambda: None, slice_blocks: int = SLICE_BLOCKS,
                 warn: Callable[..., None] = lambda kind, message, *args: log.warning(message, *args)) -> None:
        self._apply = apply
        self._warn = warn  # (kind, message, *args): "restart" and "lost", which a forged publisher can repeat
        self._clear = clear
        self._on_gap = on_gap
        self._on_reset = on_reset
        self.slice_blocks = slice_blocks
        self.next_seq: int | None = None  # the sequence number expected next; None: nothing applied yet
        self.live_seq: int | None = None  # the last live batch's: no replay brings a batch past it
        self._asked = 0  # where the replay out (or the last one) starts
        self._held: dict[int, Batch] = {}  # batches past a gap, waiting for the replay to fill it
        # What the last replay applied: the live socket may bring the same batches again. Kept by content, so a
        # restarted engine's new batch under an old number is not taken for a duplicate.
        self._recent: dict[int, Batch] = {}
        self._pending: collections.deque[_Work] = collections.deque()
        self.replaying = False
        self.generation = 0  # bumped by reset: a replay asked before a reset answers a question no longer asked

    def live(self, seq: int, batch: Batch) -> int | None:
        self.live_seq = seq
        if self.next_seq is None:
            # Joined a running engine (or it restarted): what came before is in its replay buffer.
            self._held[seq] = batch
            return self.ask(0)
        if seq >= self.next_seq:
            self._recent.clear()  # the live stream is past what the last replay brought
        if seq == self.next_seq and not self._held:
            self._queue(batch)
            self.next_seq += 1
            return None
        if seq >= self.next_seq:
            self._held[seq] = batch
            return self.ask(self.next_seq)
        if self._held.get(seq) == batch or self._recent.get(seq) == batch:
            return None  # a duplicate of what a replay brought, queued on the live socket meanwhile
        # The sequence went back with other content: a new engine process (numbers restart at 0).
        self._warn("restart", "event sequence went back from %d to %d: the engine restarted; its entries are "
                   "cleared", self.next_seq, seq)
        self._clear_later()
        self._restart()
        self._held[seq] = batch
        return self.ask(0)

    def arrived(self, seq: int) -> int:
        """Note a live batch's number (decodable or not); how many numbers the live socket skipped before it."""
        last, self.live_seq = self.live_seq, seq
        return seq - last - 1 if last is not None and seq > last + 1 else 0

    def ask(self, start: int) -> int | None:
        """``start`` if no replay is out (the caller is to ask for one from there), else None."""
        if self.replaying:
            return None
        self.replaying = True
        self._asked = start
        return start

    def wanted(self, seq: int) -> bool:
        """Whether a replayed batch is one the replay was asked for: numbered from its start to the last live
        batch (before any, at most :data:`MAX_REPLAY` on). Past it, a forged number would make every live batch
        after it look like an engine's restart."""
        high = self.live_seq if self.live_seq is not None else self._asked + MAX_REPLAY - 1
        return self._asked <= seq <= high

    def replayed(self, batches: Sequence[tuple[int, Batch]]) -> None:
        """The replay's answer, as complete as the engine could make it (batches it was not asked for are
        ignored): queues it and the held batches that follow on. A hole still left is lost for good: counted as a
        gap, and the engine's entries are rebuilt from the batches after it."""
        self.replaying = False
        batches = [(seq, batch) for seq, batch in batches if self.wanted(seq)]
        for seq, batch in batches:
            self._held.setdefault(seq, batch)
        self._recent = dict(batches)
        if self.next_seq is None and self._held and min(self._held) > 0:
            # Joined late: the engine no longer holds its first batches, so it may hold blocks never announced.
            log.info("joined an engine's events at %d: what it announced before is unknown", min(self._held))
        held, self._held = self._held, {}
        for seq in sorted(held):
            if self.next_seq is not None and seq < self.next_seq:
                continue  # already applied
            if self.next_seq is not None and seq > self.next_seq:
                self._warn("lost", "events %d-%d are lost (no longer in the engine's replay buffer): its entries "
                           "are rebuilt from the events after them", self.next_seq, seq - 1)
                self._on_gap(seq - self.next_seq)
                self._clear_later()
                self._on_reset()
            self._queue(held[seq])
            self.next_seq = seq + 1

    def drain(self) -> bool:
        """Do one slice of the pending work: pieces of batches up to ``slice_blocks`` blocks, or one slice of a
        clear. Whether work is left (the caller lets the event loop run, then calls again)."""
        budget = self.slice_blocks
        while self._pending and budget > 0:
            work = self._pending[0]
            if work.steps is None:
                budget -= work.blocks
                work.steps = iter(work.run() or ())
            for _ in work.steps:
                return True  # one slice of a clear done: the next call goes on with it
            self._pending.popleft()
        return bool(self._pending)

    def _queue(self, batch: Batch) -> None:
        for piece in pieces(batch, self.slice_blocks):
            self._pending.append(_Work(functools.partial(self._apply, piece),
                                       sum(_blocks(e) for e in piece.events)))

    def _clear_later(self) -> None:
        """Clear the engine's entries after the work queued so far (batches before a restart still come first:
        what they put on a shared tier stays)."""
        self._pending.append(_Work(self._clear, 1))

    def _restart(self, counted: bool = True) -> None:
        if counted:
            self._on_reset()
        self.generation += 1
        self.next_seq = None
        self._held.clear()
        self._recent.clear()
        self.replaying = False

    def reset(self, counted: bool = True) -> None:
        """Forget the engine's entries, at once, and where its stream was (engine restarted, died, or is
        unknown); ``counted`` False when the caller counts the reset under a cause of its own."""
        self._pending.clear()
        for _ in self._clear() or ():
            pass
        self._restart(counted)
