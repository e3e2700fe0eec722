"""The KV-event wire format (both shapes, encoded by vLLM's own classes), its bounds, and one engine's stream put in
order (the feed; its sockets are test_subscriber.py's)."""

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
    feed.replayed([(s, b(s)) for s in range(7)])
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


def test_feed_ignores_replayed_batches_outside_what_it_asked_for():
    r = Recorder()
    feed = r.feed()
    assert feed.live(5, b(5)) == 0
    feed.replayed([(s, b(s)) for s in range(6)] + [(10**9, b(-1)), (-3, b(-2))])
    for s in range(6, 9):
        assert feed.live(s, b(s)) is None
    assert r.applied == [float(s) for s in range(9)] and r.clears == 0


def test_restarts_a_forged_publisher_repeats_are_logged_once_a_minute_and_all_counted(caplog, monkeypatch):
    """Each sequence that goes back is a restart, each jump a loss (cleared and counted each time), but each kind of
    warning is logged at most once every 60 s: a publisher sending 5, 0, 5, 0 ... cannot flood the log. After the
    minute, the next is logged again, with how many were not."""
    import logging

    import kvtier.router.metrics as metrics
    from kvtier.router.metrics import LogOnce

    now = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    resets = []
    log = logging.getLogger("test.feed")
    feed = SettledFeed(apply=lambda b: None, clear=lambda: None, on_reset=lambda: resets.append(1),
                       warn=lambda kind, *a: LIMIT(kind, *a))
    LIMIT = LogOnce(None, "kvtier_router_event_resets", log, logging.WARNING, every_s=60)
    feed.live(0, b(0))
    feed.replayed([])
    with caplog.at_level(logging.WARNING, logger="test.feed"):
        for i in range(50):
            feed.live(5, b(1000 + 2 * i))
            feed.replayed([])
            feed.live(0, b(1001 + 2 * i))  # back to 0 with other content: a restart
            feed.replayed([])
        assert len(resets) == 100  # each cycle: 1-4 lost (a jump from 0 to 5), then a restart
        assert [r.getMessage()[:20] for r in caplog.records] == ["events 1-4 are lost ", "event sequence went "]
        now[0] += 61
        feed.live(5, b(5000))
        feed.replayed([])
        feed.live(0, b(5001))
    assert len(resets) == 102 and len(caplog.records) == 4
    assert all("49 since the last one logged" in r.getMessage() for r in caplog.records[2:])
