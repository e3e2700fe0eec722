"""The guard every tier call goes through: each fault a tier can raise, on each kind of call, becomes one outcome,
counted, with the tier left in use or resting as the fault says."""

from __future__ import annotations

import logging
import time

import pytest

from kvtier import frame
from kvtier.errors import ObjectError, QuotaFull, SealError, TierError
from kvtier.health import FirstOfKind
from kvtier.keys import HeadRange, ShardKey
from kvtier.metrics import StoreMetrics
from kvtier.store.guard import Expired, GuardedTier
from tests.store.test_hostile import DictTier

KEY = ShardKey("a" * 32, "b" * 32, HeadRange(0, 2, 2))


def guard_of(tier: DictTier) -> tuple[GuardedTier, StoreMetrics]:
    metrics = StoreMetrics()
    return GuardedTier(tier, retry_seconds=30.0, metrics=metrics, logged=FirstOfKind()), metrics


def count(metrics: StoreMetrics, name: str, *labels: str) -> float:
    return getattr(metrics, name).labels(*labels)._value.get()


@pytest.mark.parametrize(("exc", "outcome", "counter", "rests", "removed"), [
    (TierError("connection refused"), "error", "read_errors", True, False),
    (ObjectError("a key of the wrong type"), "corrupt", "corrupt", False, True),
    (frame.FrameError("bad checksum"), "corrupt", "corrupt", False, True),
    (frame.UnknownKey("sealed under key 7"), "unknown_key", "unopened", False, False),
    (Expired("written 100 s ago"), "expired", "expired", False, True),
    (KeyError("a tier's bug"), "error", "read_errors", False, False),
])
def test_a_read_fault_is_one_outcome(exc: Exception, outcome: str, counter: str, rests: bool,
                                     removed: bool) -> None:
    tier = DictTier()
    tier.objects[KEY] = b"x"
    guard, metrics = guard_of(tier)

    def read() -> bytes:
        raise exc

    assert guard._read(KEY, read) == (outcome, None)
    assert count(metrics, counter, "mem") == 1
    assert guard.reads.resting() is rests and not guard.writes.resting()
    assert (KEY not in tier.objects) is removed
    assert guard.read(KEY, lambda: b"y") == (None if rests else b"y")  # a resting tier is not called


def test_an_object_under_an_unknown_key_is_planned_without_for_a_while() -> None:
    tier = DictTier()
    tier.objects[KEY] = b"x"
    guard, _ = guard_of(tier)
    assert guard.heads(KEY.namespace, [KEY.chunk]) == [[KEY.heads]]

    def read() -> bytes:
        raise frame.UnknownKey("sealed under key 7")

    assert guard.read(KEY, read) is None
    assert guard.heads(KEY.namespace, [KEY.chunk]) == [[]]  # left in place, but not asked for again
    assert KEY in tier.objects


@pytest.mark.parametrize(("exc", "counter", "rests"), [
    (TierError("timeout"), "read_errors", True),
    (ObjectError("a malformed index entry"), "corrupt", False),
    (RuntimeError("a tier's bug"), "read_errors", False),
])
def test_a_lookup_fault_finds_nothing(exc: Exception, counter: str, rests: bool,
                                      caplog: pytest.LogCaptureFixture) -> None:
    tier = DictTier()
    tier.raise_on["heads"] = exc
    guard, metrics = guard_of(tier)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for _ in range(3):
            assert guard.heads("a" * 32, ["c1", "c2"]) == [[], []]
    assert count(metrics, counter, "mem") == (1 if rests else 3)  # resting: asked once, then skipped
    assert guard.reads.resting() is rests
    assert len(caplog.records) == 1  # the first of its kind logged, the rest counted


def test_a_malformed_lookup_answer_finds_nothing() -> None:
    class Liar(DictTier):
        def heads(self, namespace: str, chunks: object) -> list[list[HeadRange]]:  # type: ignore[override]
            return [[HeadRange(0, 2, 2)]]  # one answer for two chunks

    guard, metrics = guard_of(Liar())
    assert guard.heads("a" * 32, ["c1", "c2"]) == [[], []]
    assert count(metrics, "read_errors", "mem") == 1 and not guard.reads.resting()


@pytest.mark.parametrize(("exc", "outcome", "dropped", "errors", "rests"), [
    (TierError("disk full"), "error", None, 1, True),
    (ObjectError("a key of the wrong type"), "error", None, 1, True),
    (QuotaFull("share full"), "dropped", "share_full", 0, False),
    (SealError("tenant forgotten"), "dropped", "no_tenant_key", 0, False),
    (RuntimeError("a tier's bug"), "error", None, 1, True),
])
def test_a_write_fault_is_one_outcome(exc: Exception, outcome: str, dropped: str | None, errors: int,
                                      rests: bool) -> None:
    tier = DictTier()
    tier.raise_on["put"] = exc
    guard, metrics = guard_of(tier)
    assert guard.write(KEY, lambda: [b"header", b"payload"], 7, time.perf_counter()) == outcome
    if dropped is not None:
        assert count(metrics, "dropped", "mem", dropped) == 1
    assert count(metrics, "write_errors", "mem") == errors
    assert guard.writes.resting() is rests and not guard.reads.resting()  # reads go on: a read-only disk serves


def test_a_written_object_is_counted_with_its_header() -> None:
    tier = DictTier()
    guard, metrics = guard_of(tier)
    assert guard.write(KEY, lambda: [b"header", b"payload"], 7, time.perf_counter()) == "written"
    assert tier.objects[KEY] == b"headerpayload"
    assert count(metrics, "bytes_written", "mem") == len(b"header") + 7


def test_asking_whether_an_object_is_held_is_only_advice() -> None:
    tier = DictTier()
    tier.raise_on["heads"] = TierError("timeout")  # (the base class asks heads)
    guard, metrics = guard_of(tier)
    assert guard.holds(KEY) is False  # the write goes ahead
    assert count(metrics, "read_errors", "mem") == 1 and not guard.reads.resting()


def test_a_cascade_write_is_timed_from_before_asking_whether_the_tier_holds_it(tmp_path: object) -> None:
    """``kvtier_tier_write_seconds`` covers the whole write, the ``exists`` round trip included."""
    from kvtier import KVStore, load_config
    from kvtier.testing import synthetic_kv, synthetic_tokens
    from tests.conftest import NS

    class SlowToAnswer(DictTier):
        def exists(self, key: ShardKey) -> bool:
            time.sleep(0.05)
            return False

    cfg = load_config({"chunk_tokens": 16, "dram": {"capacity_bytes": "8MiB", "page_bytes": "4KiB"},
                       "tiers": [{"type": "filesystem", "name": "mem", "path": "/unused"}]})
    with KVStore(cfg, tiers=[SlowToAnswer()]) as store:
        tokens = synthetic_tokens(0, 16)
        store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
        written = store.stats()["mem"]
    assert written["tier_write_seconds_count"] == 1 and written["tier_write_seconds_sum"] >= 0.05


def test_outage_and_write_lines_keep_the_cascade_logger(caplog: pytest.LogCaptureFixture) -> None:
    tier = DictTier()
    tier.raise_on["put"] = TierError("disk full")
    guard, _ = guard_of(tier)
    with caplog.at_level(logging.INFO, logger="kvtier.cascade"):
        guard.write(KEY, lambda: [b"h"], 0, time.perf_counter())
        guard.reads.failed(TierError("timeout"))
    assert {r.name for r in caplog.records} == {"kvtier.cascade"} and len(caplog.records) == 2
