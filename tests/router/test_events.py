"""The KV-event wire format (both shapes, encoded by vLLM's own classes) and one engine's stream put in order."""

from __future__ import annotations

import msgpack
import pytest

from kvtier.router.config import EventLimits
from kvtier.router.events import Batch, Cleared, EventError, EventTooLarge, Feed, Removed, Stored, decode_batch

kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")


def vllm_payload(*events: object, ts: float = 1.0) -> bytes:
    """A batch exactly as vLLM's ZMQ publisher encodes it."""
    return msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=ts, events=list(events)))


def test_map_form_from_vllm_decodes_every_field():
    stored = kv_events.BlockStored(block_hashes=[11, 12], parent_block_hash=10, token_ids=list(range(8)),
                                   block_size=4, lora_id=None, medium="GPU", lora_name=None,
                                   extra_keys=[("salt-a",), None], group_idx=0)
    removed = kv_events.BlockRemoved(block_hashes=[12], medium="CPU", locality="LOCAL", ownership="kvtier:dram")
    batch, ignored = decode_batch(vllm_payload(stored, removed, kv_events.AllBlocksCleared(), ts=5.5))
    assert ignored == 0 and batch.ts == 5.5
    assert batch.events == (
        Stored(hashes=(11, 12), parent=10, token_ids=tuple(range(8)), block_size=4, medium="GPU",
               extra_keys=(["salt-a"], None), group=0),
        Removed(hashes=(12,), medium="CPU", locality="LOCAL", ownership="kvtier:dram"),
        Cleared())


def test_defaults_omitted_by_vllm_read_as_none():
    # omit_defaults: a BlockRemoved with only its required fields; a bytes hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    removed = kv_events.BlockRemoved(block_hashes=[b"\x01" * 32], medium=None)
    batch, _ = decode_batch(vllm_payload(removed))
    assert batch.events == (Removed(hashes=(b"\x01" * 32,)),)


def test_array_form_of_older_engines():
    payload = msgpack.packb([2.0, [["BlockStored", [1], None, [5, 6], 2, None, "GPU"],
                                   ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"]], 0])
    batch, ignored = decode_batch(payload)
    assert ignored == 0 and batch.dp_rank == 0
    assert batch.events == (Stored(hashes=(1,), parent=None, token_ids=(5, 6), block_size=2, medium="GPU"),
                            Removed(hashes=(1,), medium="GPU"), Cleared())


def test_unknown_event_types_are_counted_not_fatal():
    payload = msgpack.packb([1.0, [{"type": "SomethingNew", "x": 1}, {"type": "AllBlocksCleared"}]])
    batch, ignored = decode_batch(payload)
    assert ignored == 1 and batch.events == (Cleared(),)


@pytest.mark.parametrize("payload", [
    b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, "x"]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5], "parent_block_hash": None,
                          "token_ids": [1], "block_size": 1}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": ["a"], "block_size": 1}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                          "token_ids": [1, 2], "block_size": 1, "extra_keys": [None]}]]),
    msgpack.packb([1.0, [["BlockRemoved", [1], "GPU", 0, None, None, "too", "many"]]]),
    msgpack.packb([1.0, [42]]),
])
def test_malformed_batches_raise_event_error(payload):
    with pytest.raises(EventError):
        decode_batch(payload)


class Recorder:
    def __init__(self):
        self.applied: list[float] = []
        self.clears = 0
        self.gaps: list[int] = []

    def feed(self) -> Feed:
        return SettledFeed(apply=lambda b: self.applied.append(b.ts), clear=self._clear, on_gap=self.gaps.append)

    def _clear(self):
        self.clears += 1


class SettledFeed(Feed):
    """A feed whose queued work is done before live and replayed return, as the subscriber does between them."""

    def live(self, seq, batch):
        start = super().live(seq, batch)
        while self.drain():
            pass
        return start

    def replayed(self, batches):
        super().replayed(batches)
        while self.drain():
            pass


def b(seq: int) -> Batch:
    return Batch(ts=float(seq), events=())


def test_feed_joins_by_replaying_from_zero_then_applies_in_order():
    r = Recorder()
    feed = r.feed()
    assert feed.live(5, b(5)) == 0  # joined a running engine: ask for everything it buffered
    assert feed.live(6, b(6)) is None  # held while the replay is out
    feed.replayed([(s, b(s)) for s in range(0, 7)])
    assert r.applied == [0, 1, 2, 3, 4, 5, 6] and r.gaps == []
    # the live socket then brings what the replay already applied: duplicates, not a restart
    assert feed.live(5, b(5)) is None and feed.live(6, b(6)) is None
    assert feed.live(7, b(7)) is None
    assert r.applied[-1] == 7 and r.clears == 0


def test_feed_gap_is_replayed_and_lost_batches_are_counted():
    r = Recorder()
    feed = r.feed()
    feed.live(0, b(0))
    feed.replayed([(0, b(0))])
    assert feed.live(1, b(1)) is None
    assert feed.live(4, b(4)) == 2  # 2 and 3 missing
    feed.replayed([(3, b(3)), (4, b(4))])  # the engine's buffer no longer has 2
    # not knowing what batch 2 did, the engine's entries are rebuilt from what follows
    assert r.applied == [0, 1, 3, 4] and r.gaps == [1] and r.clears == 1
    feed.live(5, b(5))
    assert r.applied[-1] == 5


def test_feed_sequence_going_back_is_a_restart_and_clears():
    r = Recorder()
    feed = r.feed()
    feed.live(0, b(0))
    feed.replayed([])
    for s in range(1, 10):
        feed.live(s, b(s))
    # 7 after 9 with no replay in between: a new engine process whose first batches were missed
    assert feed.live(7, b(107)) == 0
    assert r.clears == 1
    feed.replayed([(s, b(100 + s)) for s in range(8)])
    assert r.applied[10:] == [100 + s for s in range(8)]


def test_feed_restart_at_zero():
    r = Recorder()
    feed = r.feed()
    feed.live(0, b(0))
    feed.replayed([])
    feed.live(1, b(1))
    assert feed.live(0, b(100)) == 0  # a new process: seq 0 again
    assert r.clears == 1
    feed.replayed([(0, b(100))])
    assert r.applied == [0, 1, 100]


def test_feed_without_replay_answer_applies_what_it_holds():
    r = Recorder()
    feed = r.feed()
    assert feed.live(3, b(3)) == 0
    feed.replayed([])  # the replay socket gave nothing in time
    assert r.applied == [3] and r.gaps == []  # joined late: nothing applied was missed, nothing to count


def test_feed_a_restarted_engines_batch_under_a_replayed_number_is_not_a_duplicate():
    r = Recorder()
    feed = r.feed()
    feed.live(3, b(3))
    feed.replayed([(s, b(s)) for s in range(4)])
    assert feed.live(2, b(2)) is None and r.clears == 0  # the same batch again: a duplicate
    assert feed.live(0, Batch(ts=99.0, events=())) == 0  # same number, other content: a new process
    assert r.clears == 1


def test_subscriber_replays_a_full_vllm_buffer_completely(tmp_path):
    """vLLM's own publisher with 6,000 batches buffered: its replay socket drops what exceeds its send queue, so
    the subscriber asks again from the first hole until it has them all."""
    import asyncio
    import time

    import zmq.asyncio

    from kvtier.router.events import Subscriber

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
    import asyncio

    import zmq
    import zmq.asyncio

    from kvtier.router.events import Subscriber

    errors: list[str] = []
    applied: list[float] = []

    async def main():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp_path}/pub")

        def apply(batch):
            if batch.ts == 13.0:
                raise KeyError("an index bug")
            applied.append(batch.ts)

        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", None, Feed(apply=apply, clear=lambda: None),
                         on_error=errors.append)
        sub.start()
        await asyncio.sleep(0.3)  # the subscription takes a moment
        bad_map = b"\x81\x91\x01\x02"  # a map whose key is an array: msgpack raises TypeError
        for seq, payload in [(0, msgpack.packb([0.0, []])), (1, bad_map), (2, msgpack.packb([13.0, []])),
                             (3, msgpack.packb([3.0, []]))]:
            await pub.send_multipart([b"t", seq.to_bytes(8, "big"), payload])
        await asyncio.sleep(0.5)
        await pub.send_multipart([b"t", (4).to_bytes(8, "big"), msgpack.packb([4.0, []])])
        await asyncio.sleep(0.5)
        await sub.stop()
        pub.close(0)
        ctx.term()

    asyncio.run(main())
    assert "decode" in errors and "apply" in errors
    assert applied[0] == 0.0 and applied[-1] == 4.0  # still applying after both


def test_a_replay_answer_from_before_a_reset_is_not_applied():
    r = Recorder()
    feed = r.feed()
    assert feed.live(5, b(5)) == 0
    generation = feed.generation
    feed.reset()  # e.g. the engine was lost while the replay was out
    assert feed.generation != generation and feed.next_seq is None


# --- bounds: what a publisher (or a forger in its place) can make the router do ------------------------------

def stored_payload(seq: int, blocks: int, *, bs: int = 4, events: int = 1) -> bytes:
    """A batch of ``events`` BlockStored chains of ``blocks`` blocks, hashes numbered from ``seq * 10**6``."""
    out = []
    for e in range(events):
        first = seq * 10**6 + e * blocks
        out.append({"type": "BlockStored", "block_hashes": list(range(first, first + blocks)),
                    "parent_block_hash": None, "token_ids": [seq] * (blocks * bs), "block_size": bs})
    return msgpack.packb([float(seq), out])


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def test_an_event_past_the_limits_is_refused_before_it_is_built():
    limits = EventLimits(max_event_blocks=8)
    decode_batch(stored_payload(0, 8), limits, block_size=4)
    for payload in (stored_payload(0, 9), msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes":
                                                              list(range(9))}]]),
                    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                          "token_ids": [0] * 33, "block_size": 4}]])):
        with pytest.raises(EventTooLarge):
            decode_batch(payload, limits, block_size=4)


def test_a_large_stored_chain_is_applied_in_pieces_that_index_as_the_whole():
    from kvtier.router.events import pieces
    from kvtier.router.index import PrefixIndex, request_keys

    tokens = list(range(40 * 4))
    whole = Stored(hashes=tuple(range(40)), parent=None, token_ids=tuple(tokens), block_size=4,
                   extra_keys=tuple([None] * 40))
    parts = pieces(Batch(ts=1.0, events=(whole, Removed(hashes=tuple(range(30, 40))), Cleared())), 16)
    assert [p.part for p in parts] == [0, 1, 2, 3] and [len(e.hashes) for e in parts[0].events] == [16]
    index = PrefixIndex(4)
    for part in parts:
        for event in part.events:
            if isinstance(event, Stored):
                index.stored("e0", event)
            elif isinstance(event, Removed):
                index.removed("e0", event)
    assert index.match(request_keys(tokens, 4), ["e0"])["e0"].engine == 30


def test_a_large_batch_is_applied_while_the_event_loop_serves_others(tmp_path):
    """One batch of 20,000 blocks: the router's other tasks run while it is half applied (the index's credit
    seen from another task grows by slices, not at once)."""
    import asyncio

    import zmq.asyncio

    from kvtier.router.events import Subscriber
    from kvtier.router.index import PrefixIndex

    index = PrefixIndex(4)
    seen: set[int] = set()

    async def main():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp_path}/pub")
        feed = Feed(apply=lambda batch: [index.stored("e0", e) for e in batch.events], clear=lambda: None)
        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", None, feed)
        sub.start()
        await asyncio.sleep(0.3)  # the subscription takes a moment
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
    import asyncio
    import threading
    import time

    import zmq.asyncio

    from kvtier.router.events import Subscriber

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
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100)
        pub.bind(f"ipc://{tmp_path}/pub")
        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", None, Feed(apply=lambda b: None, clear=lambda: None),
                         limits=EventLimits(queue=16), on_batch=lambda batch, ignored: arrived.append(batch.ts),
                         on_error=errors.append)
        sub.start()
        await asyncio.sleep(0.3)  # the subscription takes a moment
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


def run_with_replay(tmp_path, answer, end, live, limits=EventLimits(replay_s=0.3), until=None):
    """A subscriber beside a publisher and a scripted replay socket; ``live`` seqs published 50 ms apart until
    ``until(applied)``. Returns (applied ts, clears, replay starts asked)."""
    import asyncio

    import zmq.asyncio

    from kvtier.router.events import Subscriber

    applied: list[float] = []
    clears: list[int] = []
    out = {}

    async def main():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp_path}/pub")
        replay = ReplaySocket(ctx, f"ipc://{tmp_path}/rep", answer, end)
        server = asyncio.get_running_loop().create_task(replay.serve())
        feed = Feed(apply=lambda b: applied.append(b.ts), clear=lambda: clears.append(1))
        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/rep", feed, limits=limits)
        sub.start()
        await asyncio.sleep(0.3)
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


def test_feed_ignores_replayed_batches_outside_what_it_asked_for():
    r = Recorder()
    feed = r.feed()
    assert feed.live(5, b(5)) == 0
    feed.replayed([(s, b(s)) for s in range(6)] + [(10**9, b(-1)), (-3, b(-2))])
    for s in range(6, 9):
        assert feed.live(s, b(s)) is None
    assert r.applied == [float(s) for s in range(9)] and r.clears == 0


def test_each_kind_of_bad_message_is_logged_once_and_counted_every_time(tmp_path, caplog):
    import asyncio
    import logging

    import zmq.asyncio

    from kvtier.router.events import Subscriber

    errors: list[str] = []

    async def main():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp_path}/pub")
        sub = Subscriber(ctx, "e0", f"ipc://{tmp_path}/pub", None, Feed(apply=lambda b: None, clear=lambda: None),
                         limits=EventLimits(max_event_blocks=4), block_size=4, on_error=errors.append)
        sub.start()
        await asyncio.sleep(0.3)
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
    import asyncio

    import aiohttp
    import zmq.asyncio

    from kvtier.router.app import RouterApp
    from kvtier.router.config import load_router_config
    from tests.router.test_proxy import ScriptedEngine, WordTokenizer, serve

    midway: list[int] = []

    async def main():
        engine = ScriptedEngine()
        runner, engine.url = await serve(engine.app())
        config = load_router_config({"tokenizer": "unused", "block_size": 4, "engines": [
            {"name": "e0", "url": engine.url, "kv_events": f"ipc://{tmp_path}/ev", "kv_events_bind": True}]})
        app = RouterApp(config, tokenizer=WordTokenizer())
        listeners = await app.listen("127.0.0.1", 0)
        pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
        pub.connect(f"ipc://{tmp_path}/ev")
        try:
            await asyncio.sleep(0.3)  # the subscription takes a moment
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
