"""The store from several threads at once: puts, gets, lookups, DRAM drops, promotions and cascade writes
overlapping. What is found is byte-identical to what was put, what was stored is found, hits do happen, and
the DRAM pool's accounting returns to zero once the threads are done."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvtier import KVStore
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.conftest import NS, store_config

T = 8
HEADS = 4
IDLE = {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def run_together(jobs: list[Callable[[], object]]) -> list[object]:
    """Start every job at the same moment on a thread of its own; re-raise the first failure."""
    barrier = threading.Barrier(len(jobs))
    results: list[object] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_concurrent_puts_and_gets_hit_and_match(make_store) -> None:
    store = make_store(dram="8MiB")
    hits = [0] * 4

    def work(seed: int) -> None:
        for j in range(20):
            tokens = synthetic_tokens(seed * 100 + j % 5, 3 * 16)
            kv = synthetic_kv(tokens)
            assert store.put(NS, tokens, kv) == 3 * 16
            got = store.get(NS, tokens)
            assert got is not None and torch.equal(got, kv)  # room for all: every get hits
            hits[seed] += 1

    run_together([lambda s=s: work(s) for s in range(4)])
    assert hits == [20] * 4
    store.flush()
    assert store.dram.audit() == IDLE


def test_concurrent_puts_and_gets_under_eviction(make_store) -> None:
    store = make_store(dram="256KiB")
    whole, hits = [0], [0]  # puts that stored every chunk; gets that found them
    lock = threading.Lock()

    def work(seed: int) -> None:
        for j in range(20):
            tokens = synthetic_tokens(seed * 100 + j % 5, 3 * 16)
            kv = synthetic_kv(tokens)
            stored = store.put(NS, tokens, kv)
            store.flush()  # now on disk too: a chunk evicted from DRAM since is promoted back
            got = store.get(NS, tokens)
            with lock:
                whole[0] += stored == 3 * 16
                if got is not None:
                    assert torch.equal(got, kv)
                    hits[0] += 1
                else:
                    assert stored < 3 * 16  # a miss only where the put found DRAM full of pinned entries

    run_together([lambda s=s: work(s) for s in range(4)])
    assert whole[0] > 0 and hits[0] >= whole[0], (whole, hits)
    store.flush()
    assert store.dram.audit() == IDLE


def prefixes() -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, 3), min_size=T, max_size=4 * T).map(tuple)


OPS = st.one_of(
    st.tuples(st.just("put"), prefixes(), st.sampled_from([1, 2, 4])),
    st.tuples(st.just("get"), prefixes(), st.sampled_from([1, 2, 4]), st.integers(0, 3)),
    st.tuples(st.just("lookup"), prefixes()),
    st.tuples(st.just("drop")),
)


class ConcurrentStoreMachine(RuleBasedStateMachine):
    """Each step runs 2-4 operations at once on threads; checks hold between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-csm-"))
        # A small pool (about one put's worth) so reads promote and writes evict all the time.
        self.store = KVStore.from_config(store_config(self.dir, chunk_tokens=T, dram="96KiB", page_bytes="4KiB"))
        self.stored: set[tuple[int, ...]] = set()

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _put(self, tokens: tuple[int, ...], tp_size: int) -> list[tuple[int, ...]]:
        kv = synthetic_kv(tokens, heads=HEADS)
        per = HEADS // tp_size
        held = min(self.store.put(NS, tokens, kv[:, :, r * per:(r + 1) * per], tp_rank=r, tp_size=tp_size)
                   for r in range(tp_size))
        return [tokens[:i * T] for i in range(1, held // T + 1)]

    def _get(self, tokens: tuple[int, ...], tp_size: int, rank: int) -> None:
        rank %= tp_size
        n = self.store.lookup(NS, tokens)
        if not n:
            return
        got = self.store.get(NS, tokens[:n], tp_rank=rank, tp_size=tp_size)
        per = HEADS // tp_size
        if got is not None:  # a concurrent eviction may make it a miss; never wrong bytes
            assert torch.equal(got, synthetic_kv(tokens[:n], heads=HEADS)[:, :, rank * per:(rank + 1) * per])

    @rule(ops=st.lists(OPS, min_size=2, max_size=4))
    def together(self, ops: list[tuple]) -> None:
        jobs: list[Callable[[], object]] = []
        for op in ops:
            if op[0] == "put":
                jobs.append(lambda op=op: self._put(op[1], op[2]))
            elif op[0] == "get":
                jobs.append(lambda op=op: self._get(op[1], op[2], op[3]))
            elif op[0] == "lookup":
                jobs.append(lambda op=op: self.store.lookup(NS, op[1]))
            else:
                jobs.append(self.store.drop_dram)
        for result, op in zip(run_together(jobs), ops):
            if op[0] == "put":
                self.stored.update(result)  # type: ignore[arg-type]
        self.store.flush()

    @invariant()
    def accounting_returns_to_zero(self) -> None:
        assert self.store.dram.audit() == IDLE

    @invariant()
    def what_was_stored_is_found_intact(self) -> None:
        longest = [p for p in self.stored if not any(q[:len(p)] == p and len(q) > len(p) for q in self.stored)]
        for prefix in longest:
            assert self.store.lookup(NS, prefix) == len(prefix), f"stored prefix of {len(prefix)} tokens lost"
            got = self.store.get(NS, prefix)
            assert got is not None and torch.equal(got, synthetic_kv(prefix, heads=HEADS))


def test_concurrent_state_machine() -> None:
    run_state_machine_as_test(ConcurrentStoreMachine, settings=settings(
        max_examples=25, stateful_step_count=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
