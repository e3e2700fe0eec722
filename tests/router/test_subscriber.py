"""One engine's sockets read by the subscriber, against real ZMQ sockets: vLLM's own publisher, and scripted
ones for what an engine (or a forger in its place) can send: garbage, floods, huge batches, slow or lying
replays."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from kvtier.router.app import RouterApp
from kvtier.router.config import EventLimits, load_router_config
from kvtier.router.events import Feed
from kvtier.router.index import PrefixIndex
from kvtier.router.subscriber import Subscriber
from tests.router.test_events import seq_bytes, stored_payload
from tests.router.test_proxy import ScriptedEngine, WordTokenizer, serve


async def subscribed(pub) -> None:
    """Wait until a subscription reached ``pub``, an XPUB socket (a PUB that hears its subscribers): a message
    published before it arrives is dropped, and a fixed sleep for it is a guess a loaded machine can beat."""
    # (polled, for a blocking socket as for an asyncio one: the event loop runs the subscriber meanwhile)
    await until(lambda: pub.getsockopt(zmq.EVENTS) & zmq.POLLIN, "subscription reaching the publisher")
    message = pub.recv(zmq.NOBLOCK)
    if isinstance(message, asyncio.Future):  # an asyncio socket's
        message = await message
    assert message[:1] == b"\x01", message  # a subscription (b"\x00" is one ending)


async def until(check, what: str, seconds: float = 30.0) -> None:
    """Poll ``check()`` until it is true, for at most ``seconds`` (a bound for a stuck test, not a speed)."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"no {what} in {seconds} s"
        await asyncio.sleep(0.01)


kv_events = pytest.importorskip("vllm.distributed.kv_events")


def test_subscriber_replays_a_full_vllm_buffer_completely(tmp_path):
    """vLLM's own publisher with 6,000 batches buffered: its replay socket drops what exceeds its send queue, so
    the subscriber asks again from the first hole until it has them all."""
    n = 6000
    pub = kv_events.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/rep",
                                      buffer_steps=n)
    try:
        for i in range(n):
            pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[kv_events.BlockStored(
                block_hashes=[i], parent_block_hash=None, token_ids=list(range(16)), block_size=16, lora_id=None,
                medium="GPU", lora_name=None)]))
        deadline = time.monotonic() + 60
        while pub._event_queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.05)
        applied: list[int] = []
        replays = []

        async def main():
            ctx = zmq.asyncio.Context()
            feed = Feed(apply=lambda batch: applied.append(batch.events[0].hashes[0]), clear=lambda: None)
            sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/rep", feed,
                             limits=EventLimits(replay_s=30.0), on_replay=lambda: replays.append(1))
            sub.start()
            deadline = time.monotonic() + 60
            while len(applied) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await sub.stop()
            ctx.term()

        asyncio.run(main())
    finally:
        pub.shutdown()
    assert applied == list(range(n)), (len(applied), len(replays))


def test_subscriber_survives_messages_that_break_decoding_or_applying(tmp_path):



    errors: list[str] = []
    applied: list[float] = []

    async def main():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.bind(f"ipc://{tmp_path}/pub")

        def apply(batch):
            if batch.ts == 13.0:
                raise KeyError("an index bug")
            applied.append(batch.ts)

        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", None, Feed(apply=apply, clear=lambda: None),
                         on_error=errors.append)
        sub.start()
        await subscribed(pub)
        bad_map = b"\x81\x91\x01\x02"  # a map whose key is an array: msgpack raises TypeError
        for seq, payload in [(0, msgpack.packb([0.0, []])), (1, bad_map), (2, msgpack.packb([13.0, []])),
                             (3, msgpack.packb([3.0, []]))]:
            await pub.send_multipart([b"t", seq.to_bytes(8, "big"), payload])
        await until(lambda: "decode" in errors and "apply" in errors and applied[-1:] == [3.0], "four batches read")
        await pub.send_multipart([b"t", (4).to_bytes(8, "big"), msgpack.packb([4.0, []])])
        await until(lambda: applied[-1:] == [4.0], "batch 4 applied")
        await sub.stop()
        pub.close(0)
        ctx.term()

    asyncio.run(main())
    assert "decode" in errors and "apply" in errors
    assert applied[0] == 0.0 and applied[-1] == 4.0  # still applying after both


def test_a_large_batch_is_applied_while_the_event_loop_serves_others(tmp_path):
    """One batch of 20,000 blocks: the router's other tasks run while it is half applied (the index's credit
    seen from another task grows by slices, not at once)."""
    index = PrefixIndex(4)
    seen: set[int] = set()

    async def main():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.bind(f"ipc://{tmp_path}/pub")
        feed = Feed(apply=lambda batch: [index.stored("e0", e) for e in batch.events], clear=lambda: None)
        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", None, feed)
        sub.start()
        await subscribed(pub)
        await pub.send_multipart([b"t", seq_bytes(0), stored_payload(0, 10_000, events=2)])
        for _ in range(100_000):  # until it is all applied: another task of the router's loop
            seen.add(index.blocks("e0"))
            if index.blocks("e0") == 20_000:
                break
            await asyncio.sleep(0)
        await sub.stop()
        pub.close(0)
        ctx.term()

    asyncio.run(main())
    assert 20_000 in seen and len(seen - {0, 20_000}) >= 5, sorted(seen)


def test_the_receive_queue_is_bounded_and_what_it_drops_is_counted(tmp_path):
    """The event loop blocked while an engine publishes 3,000 messages of 20 KB: the router's socket holds at most
    events.queue of them, the engine's own queue the next ones, and ZMQ drops the rest rather than the router's
    memory growing (unbounded, all 3,000 were kept); the gap is counted."""
    arrived: list[float] = []
    errors: list[str] = []
    pad = {"type": "Padding", "bytes": b"x" * 20_000}  # an event type the router ignores

    def publish(pub):
        for seq in range(3000):
            pub.send_multipart([b"t", seq_bytes(seq), msgpack.packb([float(seq), [pad]])], zmq.NOBLOCK)
            if seq % 10 == 0:
                time.sleep(0.001)  # at a pace the publisher's own I/O keeps up with: it drops nothing itself

    async def main():
        ctx = zmq.asyncio.Context()
        pub = zmq.Context.instance().socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, 100)
        pub.bind(f"ipc://{tmp_path}/pub")
        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", None, Feed(apply=lambda b: None, clear=lambda: None),
                         limits=EventLimits(queue=16), on_batch=lambda batch, ignored: arrived.append(batch.ts),
                         on_error=errors.append)
        sub.start()
        await subscribed(pub)
        thread = threading.Thread(target=publish, args=(pub,))
        thread.start()
        thread.join()  # the event loop is blocked meanwhile: nothing is read
        await asyncio.sleep(0.5)  # the loop reads what was kept
        pub.send_multipart([b"t", seq_bytes(3000), msgpack.packb([3000.0, []])])
        for _ in range(200):
            if arrived and arrived[-1] == 3000.0:
                break
            await asyncio.sleep(0.05)
        await sub.stop()
        pub.close(0)
        ctx.term()

    asyncio.run(main())
    assert arrived[-1] == 3000.0
    assert len(arrived) < 1500, len(arrived)  # 16, the transport's buffers and the engine's 100: not all 3,000
    assert "dropped" in errors


class ReplaySocket:
    """An engine's replay socket as a test scripts it: ``answer(start)`` gives the (seq, payload) pairs sent back,
    ``end`` whether the end marker follows."""
    def __init__(self, ctx, endpoint, answer, end=True):
        import zmq

        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.answer, self.end, self.asked = answer, end, []

    async def serve(self):
        while True:
            ident, _, start = await self.sock.recv_multipart()
            start = int.from_bytes(start, "big", signed=True)
            self.asked.append(start)
            for seq, payload in self.answer(start):  # as vLLM's: (client, "", topic, seq, payload)
                await self.sock.send_multipart([ident, b"", b"t", seq_bytes(seq), payload])
            if self.end:
                await self.sock.send_multipart([ident, b"", b"", seq_bytes(-1), b""])


def run_with_replay(tmp_path, answer, end, live, limits=EventLimits(replay_s=0.3),  # noqa: B008 frozen: safe to share
                    until=None, errors=None):
    """A subscriber beside a publisher and a scripted replay socket; ``live`` seqs published 50 ms apart until
    ``until(applied)``; faults counted into ``errors``. Returns (applied ts, clears, replay starts asked)."""
    applied: list[float] = []
    clears: list[int] = []
    out = {}

    async def main():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.bind(f"ipc://{tmp_path}/pub")
        replay = ReplaySocket(ctx, f"ipc://{tmp_path}/rep", answer, end)
        server = asyncio.get_running_loop().create_task(replay.serve())
        feed = Feed(apply=lambda b: applied.append(b.ts), clear=lambda: clears.append(1))
        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/rep", feed, limits=limits,
                         on_error=(errors if errors is not None else []).append)
        sub.start()
        await subscribed(pub)
        await asyncio.sleep(0.3)  # (the replay from 0 a subscriber starts with has had its time)
        for seq in live:
            await pub.send_multipart([b"t", seq_bytes(seq), msgpack.packb([float(seq), []])])
            await asyncio.sleep(0.05)
            if until is not None and until(applied):
                break
        for _ in range(100):
            if until is None or until(applied):
                break
            await asyncio.sleep(0.05)
        out["asked"] = list(replay.asked)
        await sub.stop()
        server.cancel()
        replay.sock.close(0)
        pub.close(0)
        ctx.term()

    asyncio.run(main())
    return applied, clears, out["asked"]


def test_a_replay_socket_that_trickles_holds_live_events_at_most_events_replay_s(tmp_path):
    """A replay socket answering each ask with the one batch asked and never its end marker: each round waited
    2 s for the marker, for up to 64 rounds (128 s without live events); now the whole replay gets replay_s."""
    applied, _, asked = run_with_replay(
        tmp_path, answer=lambda start: [(start, msgpack.packb([float(start), []]))], end=False,
        live=range(100, 140), until=lambda applied: any(ts >= 100 for ts in applied))
    assert any(ts >= 100 for ts in applied), (applied, asked)  # live events applied again, within the test
    assert len(asked) <= 4, asked


def test_replayed_batches_numbered_outside_the_gap_are_ignored(tmp_path):
    """A replay bringing, beside what was asked, a batch numbered far past the live stream: taken, it made every
    later live batch look like a restart that cleared the engine's entries."""
    def answer(start):
        return [(s, msgpack.packb([float(s), []])) for s in range(start, 6)] + \
            [(10**9, msgpack.packb([-1.0, []]))]

    applied, clears, _ = run_with_replay(tmp_path, answer, True, live=range(5, 12),
                                         until=lambda applied: 11.0 in applied)
    assert -1.0 not in applied and clears == []
    assert applied[:6] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and applied[-1] == 11.0


def test_a_replay_stops_at_events_replay_bytes(tmp_path):
    """A replay socket answering every ask with 1,000 batches of 60 KiB each (each under max_message_bytes): the
    router held all it was sent, up to MAX_REPLAY batches a round (4 GiB with the default message limit); now a
    replay holds at most replay_bytes, counts ``replay_bytes``, and live events are applied again after it."""
    sent: list[int] = []

    def answer(start):
        sent.append(start)
        return [(s, msgpack.packb([float(s), [], "x" * 60_000])) for s in range(start, start + 1000)]

    errors: list[str] = []
    limits = EventLimits(replay_s=2.0, max_message_bytes=2**16, replay_bytes=4 * 2**16)
    applied, _, asked = run_with_replay(tmp_path, answer, True, live=range(2000, 2040), limits=limits,
                                        until=lambda applied: 2039.0 in applied, errors=errors)
    replayed = [ts for ts in applied if ts < 2000]
    # one replay at the start, one for the gap before 2000: 4 x 60 KiB fit in 256 KiB each, the 5th does not
    assert len(asked) <= 3 and len(replayed) <= 4 * len(asked), (replayed, asked)
    assert "replay_bytes" in errors and 2039.0 in applied, (errors, asked)


def resident_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // 2**20


def test_zmq_does_not_read_a_replay_ahead_past_events_replay_bytes(tmp_path):
    """A replay socket sending 400 messages of 1 MiB while the router's loop is busy: ZMQ's own thread read them
    all ahead into the router's memory (its queue took 16,385 messages, 400 MiB here and up to 64 GiB with 4 MiB
    messages) whatever replay_bytes said; now it holds about replay_bytes (8 MiB)."""
    endpoint = f"ipc://{tmp_path}/rep"
    asked = threading.Event()

    def engine(ctx):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.bind(endpoint)
        try:
            ident = sock.recv_multipart()[0]
            asked.set()
            payload = zmq.Frame(msgpack.packb([0.0, [], "x" * 2**20]))  # one buffer, sent 400 times without copies
            for seq in range(400):
                sock.send_multipart([ident, b"", b"t", seq_bytes(seq), payload], copy=False)
            time.sleep(4)
        finally:
            sock.close(0)

    grown = {}

    async def main():
        ctx = zmq.asyncio.Context()
        feed = Feed(apply=lambda b: None, clear=lambda: None)
        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", endpoint, feed,
                         limits=EventLimits(replay_s=30.0, max_message_bytes=2 * 2**20, replay_bytes=8 * 2**20))
        thread = threading.Thread(target=engine, args=(zmq.Context.instance(),))
        thread.start()
        sub.start()
        while not asked.is_set():
            await asyncio.sleep(0.01)
        before = resident_mib()
        time.sleep(3)  # the loop is busy: only ZMQ's thread reads
        grown["mib"] = resident_mib() - before
        await sub.stop()
        thread.join()
        ctx.term()

    asyncio.run(main())
    assert grown["mib"] < 64, grown


def test_each_kind_of_bad_message_is_logged_once_and_counted_every_time(tmp_path, caplog):



    errors: list[str] = []

    async def main():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.bind(f"ipc://{tmp_path}/pub")
        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", None, Feed(apply=lambda b: None, clear=lambda: None),
                         limits=EventLimits(max_event_blocks=4), block_size=4, on_error=errors.append)
        sub.start()
        await subscribed(pub)
        for seq in range(300):
            await pub.send_multipart([b"t", seq_bytes(seq), b"\xc1"])  # not msgpack
            await pub.send_multipart([b"t", b"short"])
            await pub.send_multipart([b"t", seq_bytes(seq), stored_payload(seq, 5)])  # 5 blocks: too large
        for _ in range(100):
            if len(errors) >= 900:
                break
            await asyncio.sleep(0.05)
        await sub.stop()
        pub.close(0)
        ctx.term()

    with caplog.at_level(logging.INFO, logger="kvtier.router.events"):
        asyncio.run(main())
    assert {kind: errors.count(kind) for kind in ("decode", "frames", "too_large")} == \
        {"decode": 300, "frames": 300, "too_large": 300}
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    kinds = sorted(kind for kind in ("decode", "frames", "too_large") for r in logged
                   if f"kind='{kind}'" in r.getMessage())
    assert kinds == ["decode", "frames", "too_large"] and len(logged) == 3, [r.getMessage() for r in logged]


def test_the_router_answers_health_while_it_applies_a_large_batch(tmp_path):
    """One batch of 64,000 blocks from an engine (the router binds its events socket): /health is answered
    while the batch is half applied, not only before or after it."""
    midway: list[int] = []

    async def main():
        engine = ScriptedEngine()
        runner, engine.url = await serve(engine.app())
        config = load_router_config({"tokenizer": "unused", "block_size": 4, "engines": [
            {"name": "e0", "url": engine.url, "kv_events": f"ipc://{tmp_path}/ev", "kv_events_bind": True}]})
        app = RouterApp(config, tokenizer=WordTokenizer())
        listeners = await app.listen("127.0.0.1", 0)
        pub = zmq.asyncio.Context.instance().socket(zmq.XPUB)
        pub.connect(f"ipc://{tmp_path}/ev")
        try:
            await subscribed(pub)
            await pub.send_multipart([b"t", seq_bytes(0), stored_payload(0, 8000, events=8)])
            async with aiohttp.ClientSession() as client:
                for _ in range(2000):
                    async with client.get(f"http://127.0.0.1:{app.port()}/health") as reply:
                        assert reply.status == 200
                    blocks = app.index.blocks("e0")
                    if 0 < blocks < 64_000:
                        midway.append(blocks)
                    if blocks == 64_000:
                        break
            assert app.index.blocks("e0") == 64_000
        finally:
            pub.close(0)
            for r in reversed(listeners):
                await r.cleanup()
            await runner.cleanup()

    asyncio.run(main())
    assert midway, "no /health answer while the batch was being applied"
