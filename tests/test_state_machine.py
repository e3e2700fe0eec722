"""A Hypothesis state machine over put / get / lookup / drop DRAM / restart / damage a stored object, run over
the filesystem tier and over a real Redis server.

Invariants: whatever is found is byte-identical to what was put; what was put and not removed is found; a
damaged object is a miss, never wrong data."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import redis
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvtier import KVStore, chunk_keys, frame
from kvtier.keys import HeadRange, cover
from kvtier.testing import synthetic_kv
from tests.conftest import NS, store_config

T = 8
HEADS = 4


def intact(blob: bytes) -> bool:
    try:
        frame.decode(blob)
    except frame.FrameError:
        return False
    return True


def prefixes() -> st.SearchStrategy[tuple[int, ...]]:
    # Few distinct token values, so generated prompts share prefixes often.
    return st.lists(st.integers(0, 3), min_size=T, max_size=5 * T).map(tuple)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-sm-"))
        self.store = self._open()
        self.stored: set[tuple[int, ...]] = set()  # whole-chunk prefixes that must be found

    def _open(self) -> KVStore:
        # A small DRAM (one put's worth of shards) so eviction and promotion happen all the time.
        return KVStore.from_config(store_config(self.dir, chunk_tokens=T, dram="80KiB", page_bytes="4KiB"))

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(tokens=prefixes(), tp_size=st.sampled_from([1, 2, 4]))
    def put(self, tokens: tuple[int, ...], tp_size: int) -> None:
        kv = synthetic_kv(tokens, heads=HEADS)
        per = HEADS // tp_size
        for rank in range(tp_size):
            self.store.put(NS, tokens, kv[:, :, rank * per:(rank + 1) * per], tp_rank=rank, tp_size=tp_size)
        self.store.flush()
        n = len(tokens) // T * T
        for i in range(1, n // T + 1):
            self.stored.add(tokens[:i * T])

    @rule(tokens=prefixes(), tp_size=st.sampled_from([1, 2, 4]), data=st.data())
    def get(self, tokens: tuple[int, ...], tp_size: int, data: st.DataObject) -> None:
        n = self.store.lookup(NS, tokens)
        assert n % T == 0
        assert tokens[:n] in self.stored or n == 0
        longest = max((i * T for i in range(len(tokens) // T + 1) if tokens[:i * T] in self.stored), default=0)
        assert n == longest, f"lookup found {n} tokens, {longest} were stored"
        if n:
            rank = data.draw(st.integers(0, tp_size - 1))
            per = HEADS // tp_size
            got = self.store.get(NS, tokens[:n], tp_rank=rank, tp_size=tp_size)
            assert got is not None
            assert torch.equal(got, synthetic_kv(tokens[:n], heads=HEADS)[:, :, rank * per:(rank + 1) * per])

    @rule()
    def drop_dram(self) -> None:
        self.store.drop_dram()

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = self._open()

    @precondition(lambda self: bool(self.stored))
    @rule(data=st.data())
    def damage_a_file(self, data: st.DataObject) -> None:
        """Flip a byte in one stored file and drop DRAM: the chunk misses unless other shards still cover it."""
        prefix = data.draw(st.sampled_from(sorted(self.stored)))
        chunk = chunk_keys(NS, prefix, T)[-1].hex()
        files = sorted(self.dir.rglob(f"{chunk}.*.kv"))
        assert files, f"stored chunk {chunk} has no file"
        victim = data.draw(st.sampled_from(files))
        blob = bytearray(victim.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        victim.write_bytes(blob)
        self.store.drop_dram()
        # Shards damaged earlier and not read since are still there, and still bad: only intact ones count.
        others = [HeadRange.parse(f.name.split(".")[1]) for f in files
                  if f != victim and f.exists() and intact(f.read_bytes())]
        still_whole = cover(others, 0, HEADS) is not None
        got = self.store.get(NS, prefix)
        if still_whole:  # the reader falls back to the good shards
            assert got is not None and torch.equal(got, synthetic_kv(prefix, heads=HEADS))
        else:
            assert got is None and not victim.exists()
            self.stored = {p for p in self.stored if p[:len(prefix)] != prefix}

    @invariant()
    def nothing_lost(self) -> None:
        stats = self.store.stats()
        for tier in [t.name for t in self.store.tiers]:
            assert stats.get(tier, {}).get("dropped_writes_total{reason=queue_full}", 0) == 0
            assert stats.get(tier, {}).get("write_errors_total", 0) == 0
        assert stats.get("dram", {}).get("dropped_writes_total{reason=dram_full}", 0) == 0


SETTINGS = settings(max_examples=80, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = SETTINGS


class RedisStoreMachine(StoreMachine):
    """The same machine with a Redis server as the only secondary tier; damage hits a stored hash field."""

    url = ""  # set by the test below

    def __init__(self) -> None:
        self.prefix = f"sm{uuid.uuid4().hex[:12]}:"
        self.client = redis.Redis.from_url(self.url)
        super().__init__()

    def _open(self) -> KVStore:
        return KVStore.from_config({"chunk_tokens": T, "dram": {"capacity_bytes": "80KiB", "page_bytes": "4KiB"},
                                    "tiers": [{"type": "redis", "url": self.url, "key_prefix": self.prefix,
                                               "queue_depth": 4096}]})

    def teardown(self) -> None:
        super().teardown()
        self.client.close()

    @precondition(lambda self: bool(self.stored))
    @rule(data=st.data())
    def damage_a_file(self, data: st.DataObject) -> None:
        prefix = data.draw(st.sampled_from(sorted(self.stored)))
        name = f"{self.prefix}{NS.id}:{chunk_keys(NS, prefix, T)[-1].hex()}"
        fields = sorted(self.client.hkeys(name))
        assert fields, f"stored chunk {name} has no fields"
        victim = data.draw(st.sampled_from(fields))
        blob = bytearray(self.client.hget(name, victim) or b"")
        blob[len(blob) // 2] ^= 0xFF
        self.client.hset(name, victim, bytes(blob))
        self.store.drop_dram()
        others = [HeadRange.parse(f.decode().rpartition(":")[0]) for f in fields
                  if f != victim and intact(self.client.hget(name, f) or b"")]
        still_whole = cover(others, 0, HEADS) is not None
        got = self.store.get(NS, prefix)
        if still_whole:
            assert got is not None and torch.equal(got, synthetic_kv(prefix, heads=HEADS))
        else:
            assert got is None and victim not in self.client.hkeys(name)
            self.stored = {p for p in self.stored if p[:len(prefix)] != prefix}


def test_redis_state_machine(redis_server) -> None:
    RedisStoreMachine.url = redis_server.url
    run_state_machine_as_test(RedisStoreMachine, settings=SETTINGS)
