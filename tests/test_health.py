"""The outage state that guards every tier's reads and writes."""

from __future__ import annotations

import logging

import pytest

from kvtier import health
from kvtier.health import MAX_REST_SECONDS, Outage


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: now[0])
    return now


def test_rest_doubles_while_failing_and_resets_on_success(clock: list[float], caplog) -> None:
    outage = Outage("redis", "reads", retry_seconds=1.0)
    assert not outage.resting()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        rests = []
        for _ in range(8):
            outage.failed(ConnectionError("refused"))
            start = clock[0]
            while outage.resting():
                clock[0] += 0.25
            rests.append(clock[0] - start)
        assert rests == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_REST_SECONDS, MAX_REST_SECONDS, MAX_REST_SECONDS]
        outage.succeeded()
        assert not outage.resting()
        outage.failed(ConnectionError("refused again"))  # a new outage starts from retry_seconds
        clock[0] += 1.0
        assert not outage.resting()
    messages = [r.message for r in caplog.records]
    assert sum("failing" in m for m in messages) == 2  # once per outage
    assert sum("working again" in m for m in messages) == 1


def test_zero_retry_seconds_never_rests(clock: list[float]) -> None:
    outage = Outage("s3", "writes", retry_seconds=0.0)
    outage.failed(TimeoutError("slow"))
    outage.failed(TimeoutError("slow"))
    assert not outage.resting()


def test_classify_names_each_fault_of_a_tier_call() -> None:
    from kvtier import frame
    from kvtier.errors import ConfigError, ObjectError, QuotaFull, SealError, TierError
    from kvtier.health import Fault, classify

    assert classify(frame.UnknownKey("sealed under key 3")) is Fault.UNKNOWN_KEY  # before its base, FrameError
    assert classify(frame.FrameError("bad checksum")) is Fault.CORRUPT
    assert classify(ObjectError("a Redis key of the wrong type")) is Fault.CORRUPT  # before its base, TierError
    assert classify(QuotaFull("share full")) is Fault.SHARE_FULL
    assert classify(SealError("forgotten")) is Fault.NO_TENANT_KEY
    assert classify(TierError("connection refused")) is Fault.OUTAGE
    assert classify(ConfigError("x")) is Fault.UNEXPECTED
    assert classify(KeyError("a tier's bug")) is Fault.UNEXPECTED


def test_first_of_kind_is_true_once_per_kind_across_threads() -> None:
    import threading

    from kvtier.health import FirstOfKind

    seen = FirstOfKind()
    firsts: list[bool] = []
    workers = [threading.Thread(target=lambda: firsts.append(seen.first("redis", "get", "KeyError")))
               for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert firsts.count(True) == 1
    assert seen.first("redis", "get", "ValueError") and seen.first("s3", "get", "KeyError")
    assert not seen.first("redis", "get", "ValueError")
