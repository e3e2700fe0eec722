"""One engine's KV-event sockets, read in the router's event loop: the live SUB socket and the replay socket.

The engine's replay socket is a ROUTER; the router talks to it with a DEALER, since a REQ socket takes one reply
only. Every frame goes to the engine's :class:`~kvtier.router.events.Feed`; what the feed queues is done here,
a slice at a time, yielding to the event loop between slices.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import types
from collections.abc import Callable, Container, Iterable

import zmq
import zmq.asyncio

from kvtier.router.config import EventLimits
from kvtier.router.events import END_SEQ, MAX_REPLAY, Batch, EventError, Feed, decode_batch
from kvtier.router.metrics import LogOnce

log = logging.getLogger(__name__)

_REPLAY_ROUNDS = 64  # an engine's replay socket drops what exceeds its send queue: ask again from the first hole
# A round that brought something and then nothing for this long is over: its end marker was dropped with the rest
# of what exceeded the engine's send queue (or the router's receive queue), so the next round asks from the hole.
_QUIET_S = 0.5


def _first_hole(seqs: Iterable[int], low: int) -> int | None:
    """The first number from ``low`` on missing before the largest of ``seqs`` (in the time of sorting them,
    however far apart they are)."""
    expected = low
    for seq in sorted(s for s in seqs if s >= low):
        if seq != expected:
            return expected
        expected += 1
    return None


class _Counts:
    """The subscriber's ``on_error`` in the shape :class:`LogOnce` counts through (``labels(kind).inc()``)."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count

    def labels(self, kind: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(inc=functools.partial(self._count, kind))


class Subscriber:
    """Reads one engine's event and replay sockets in the router's event loop and drives its :class:`Feed`.

    Nothing an engine sends can stop it: a message that cannot be decoded or applied is counted and skipped
    (the sequence hole it leaves is replayed), and should the task fail anyway it starts again, rebuilding the
    engine's entries from its replay buffer. Each kind of fault is logged once and counted every time
    (``on_error``). Nothing an engine sends can hold it long either: the live socket queues at most
    ``limits.queue`` messages (ZMQ drops the rest; the gap is counted as ``dropped`` and replayed), a message
    is at most ``limits.max_message_bytes``, a replay takes at most ``limits.replay_s``, ``limits.replay_bytes``
    and :data:`MAX_REPLAY` batches, and the feed's work runs in slices.
    """

    def __init__(self, ctx: zmq.asyncio.Context, name: str, endpoint: str, replay_endpoint: str | None,
                 feed: Feed, *, bind: bool = False,
                 limits: EventLimits = EventLimits(), block_size: int = 16,  # noqa: B008 frozen: safe to share
                 on_batch: Callable[[Batch, int], None] = lambda batch, ignored: None,
                 on_error: Callable[[str], None] = lambda reason: None,
                 on_replay: Callable[[], None] = lambda: None) -> None:
        self._ctx = ctx
        self.name = name
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self.feed = feed
        self._bind = bind
        self._limits = limits
        self._block_size = block_size
        self._on_batch = on_batch
        self._errors = LogOnce(_Counts(on_error), "kvtier_router_event_errors", log, logging.WARNING)
        self._on_replay = on_replay
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._restart_s = 1.0  # doubles at each failure in a row, up to 60 s
        self._replay_room = limits.replay_bytes  # what is left of it in the replay under way
        # Set once the engine's replay buffer has been read at start (or there is none, or it failed): the index
        # holds what the engine held, so it may be routed to.
        self.replayed = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self.name}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if self._stopping or task.cancelled():
            return
        log.error("engine %s: KV-event task failed (%r); restarting it in %.0f s, its entries rebuilt by replay",
                  self.name, task.exception(), self._restart_s)
        self._errors("task", "engine %s: KV-event task failed", self.name)
        self.replayed.set()  # routed by health alone until the restarted task rebuilds its entries
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
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 stopping: how the task ended no longer matters
                pass

    def _decode(self, payload: bytes) -> Batch | None:
        try:
            batch, ignored = decode_batch(payload, self._limits, self._block_size)
        except EventError as exc:
            self._errors(exc.kind, "engine %s: KV-event batch skipped: %s", self.name, str(exc))
            return None
        self._on_batch(batch, ignored)
        return batch

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[ADDRESS]:PORT too (an IPv4 address still works)
        # ZMQ drops a larger message (and the connection that sent it): a gap, replayed
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        return sock

    async def _run(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # Bounded: while the loop is busy, ZMQ drops what exceeds the queue rather than let a publisher fill the
        # router's memory; the sequence gap this leaves is counted and replayed.
        sub.setsockopt(zmq.RCVHWM, self._limits.queue)
        try:
            (sub.bind if self._bind else sub.connect)(self._endpoint)
            await self._settle()  # what a reset before a restart left
            # A router that starts beside running engines learns their caches from the replay buffers at once,
            # instead of waiting for their next batch.
            if self._replay_endpoint is not None:
                await self._replay(self.feed.ask(0))
            self.replayed.set()
            while True:
                frames = await sub.recv_multipart()
                self._restart_s = 1.0  # reading again
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._errors("frames", "engine %s: a KV-event message of %d frames skipped (expected topic, "
                                 "8-byte sequence number, payload)", self.name, len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                missed = self.feed.arrived(seq)
                if missed:
                    self._errors("dropped", "engine %s: %d KV-event batches before %d never arrived (events.queue "
                                 "full, or the engine's own queue): asking its replay socket", self.name, missed,
                                 seq)
                batch = self._decode(frames[2])
                if batch is None:
                    continue  # its sequence number stays unapplied: the next batch shows a gap, and replay retries
                start = self.feed.live(seq, batch)
                if not await self._settle():
                    start = self.feed.ask(0)
                await self._replay(start)
        finally:
            sub.close(linger=0)

    async def _settle(self) -> bool:
        """Do the feed's pending work a slice at a time, the event loop serving requests in between; False if
        it failed (the engine's entries are then cleared, to be rebuilt by a replay from 0)."""
        try:
            while self.feed.drain():
                await asyncio.sleep(0)
        except Exception as exc:  # noqa: BLE001 an index bug must not blind the router to this engine for good
            self._errors("apply", "engine %s: applying KV events failed (%r); its entries are rebuilt", self.name,
                         exc)
            self.feed.reset()
            return False
        return True

    async def _replay(self, start: int | None) -> None:
        """Fetch from ``start`` until the engine's answer is contiguous and ended (its socket drops what
        exceeds its send queue), stops bringing anything new, or ``limits.replay_s`` is over; then hand it to
        the feed and apply it."""
        if start is None:
            return
        got: dict[int, Batch] = {}
        ask = start
        generation = self.feed.generation
        deadline = time.monotonic() + self._limits.replay_s
        self._replay_room = self._limits.replay_bytes
        for _ in range(_REPLAY_ROUNDS if self._replay_endpoint is not None else 0):
            self._on_replay()
            batches, ended = await self._fetch(ask, deadline, got)
            wanted = [(seq, b) for seq, b in batches if self.feed.wanted(seq)]
            if len(wanted) < len(batches):
                self._errors("replay_range", "engine %s: %d replayed batches numbered outside %d-%s, the range "
                             "asked for, were ignored", self.name, len(batches) - len(wanted), start,
                             self.feed.live_seq)
            new = [seq for seq, _ in wanted if seq not in got]
            got.update((seq, b) for seq, b in wanted if seq not in got)
            if not new or (ask > start and ask not in got) or len(got) >= MAX_REPLAY or self._replay_room <= 0:
                break  # nothing new, the hole asked for is not coming (gone, undecodable), or enough
            hole = _first_hole(got, max(start, min(got)))
            if hole is None and ended:
                break
            ask = hole if hole is not None else max(got) + 1
        if self.feed.generation != generation:
            self.feed.replaying = False
            return  # the feed was reset meanwhile: the next batch asks for everything again
        try:
            self.feed.replayed(sorted(got.items()))
        except Exception as exc:  # noqa: BLE001 contained like _settle's: counted, logged, entries rebuilt
            self._errors("apply", "engine %s: applying replayed KV events failed (%r); its entries are cleared",
                         self.name, exc)
            self.feed.reset()
            return
        await self._settle()

    async def _fetch(self, start: int, deadline: float,
                     kept: Container[int]) -> tuple[list[tuple[int, Batch]], bool]:
        """The engine's buffered batches from ``start`` on, and whether its end marker came (else: what came
        before the deadline or a quiet :data:`_QUIET_S`, the first :data:`MAX_REPLAY`, or what fits in what is left
        of ``replay_bytes``, where batches already ``kept`` by an earlier round are not charged again)."""
        assert self._replay_endpoint is not None, "_replay fetches only from an engine with a replay socket"
        dealer = self._socket(zmq.DEALER)
        # ZMQ reads ahead of this loop into a queue counted in messages, not bytes: at most replay_bytes of
        # max_message_bytes messages (64 at the defaults), so that what it holds is bounded like what is kept.
        # What the engine sends past it is dropped by the engine's socket; the next round asks for it again.
        dealer.setsockopt(zmq.RCVHWM, max(2, min(MAX_REPLAY + 1,
                                                 self._limits.replay_bytes // self._limits.max_message_bytes)))
        got: list[tuple[int, Batch]] = []
        try:
            try:
                dealer.connect(self._replay_endpoint)
            except zmq.ZMQError as exc:
                self._errors("replay_endpoint", "engine %s: cannot reach its replay socket %s: %s", self.name,
                             self._replay_endpoint, exc)
                return got, False
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while len(got) < MAX_REPLAY:
                left = deadline - time.monotonic()
                if got and left > 0 and not await dealer.poll(min(left, _QUIET_S) * 1000):
                    return got, False  # the rest (and the end marker) dropped on the way: ask again
                if left <= 0 or not await dealer.poll(left * 1000):
                    self._errors("replay_timeout", "engine %s: replay from %s: no end marker within events."
                                 "replay_s (%.1f s)", self.name, self._replay_endpoint, self._limits.replay_s)
                    return got, False
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._errors("frames", "engine %s: a replay message of %d frames skipped (expected 4)",
                                 self.name, len(frames))
                    return got, False
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return got, True
                if seq not in kept:
                    self._replay_room -= len(frames[3])
                if self._replay_room < 0:
                    self._errors("replay_bytes", "engine %s: replay from %s: stopped past events.replay_bytes "
                                 "(%d bytes); what did not fit is a gap", self.name, self._replay_endpoint,
                                 self._limits.replay_bytes)
                    return got, False
                batch = self._decode(frames[3])
                if batch is not None:
                    got.append((seq, batch))
            return got, False
        finally:
            dealer.close(linger=0)
