"""How kvtier tells a tier's faults apart and reports them: the one place a tier's exception becomes an outcome.

- :func:`classify` maps what a tier call raised to what it means for the caller (a corrupt object, an object
  under a key this process lacks, a full share, an outage, a bug).
- :class:`Outage` is the health of one tier's reads or writes: a failure rests the tier for a while (callers skip
  it), the first one is logged, the recovery too.
- :class:`FirstOfKind` logs the first fault of each kind and leaves the rest to the metrics.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Hashable
from typing import Protocol

from kvtier import frame
from kvtier.errors import NotEncodable, ObjectError, PartUnavailable, QuotaFull, SealError, TierError

log = logging.getLogger(__name__)
MAX_REST_SECONDS = 30.0


class Fault(enum.Enum):
    """What one failed tier call means. ``value``: the outcome a trace span records."""

    UNKNOWN_KEY = "unknown_key"  # a sealed object under a key this process lacks: a miss, left in place
    REFUSED_CODEC = "refused_codec"  # stored with a codec the reader does not accept: a miss, left in place
    NOT_ENCODABLE = "not_encodable"  # KV a lossy codec cannot store (NaN, infinity): the write is dropped
    CORRUPT = "corrupt"  # the object is malformed or fails its checks: a miss, counted and removed
    SHARE_FULL = "share_full"  # the tenant's share refused a write (QuotaFull): dropped, the tier answered
    NO_TENANT_KEY = "no_tenant_key"  # the tenant was forgotten since the put (SealError): nothing is written
    PART_OUTAGE = "part_outage"  # one part of the tier failed (PartUnavailable): a miss, the rest serves
    OUTAGE = "error"  # the tier's I/O failed (TierError): counts toward its outage
    UNEXPECTED = "unexpected"  # anything else: a tier's bug or a reply no check foresaw


def classify(exc: BaseException) -> Fault:
    """What ``exc``, raised by a tier call (or by checking what it returned), means for the caller."""
    if isinstance(exc, frame.UnknownKey):
        return Fault.UNKNOWN_KEY
    if isinstance(exc, frame.RefusedCodec):
        return Fault.REFUSED_CODEC
    if isinstance(exc, NotEncodable):
        return Fault.NOT_ENCODABLE
    if isinstance(exc, ObjectError):  # (a frame.FrameError is one)
        return Fault.CORRUPT
    if isinstance(exc, QuotaFull):
        return Fault.SHARE_FULL
    if isinstance(exc, SealError):
        return Fault.NO_TENANT_KEY
    if isinstance(exc, PartUnavailable):
        return Fault.PART_OUTAGE
    if isinstance(exc, TierError):
        return Fault.OUTAGE
    return Fault.UNEXPECTED


class FirstOfKind:
    """Which faults were seen already: :meth:`first` is true once per kind (e.g. tier, operation, exception
    type), so the first of each kind is logged and the rest only counted. Kinds are few (bounded by the tiers,
    operations and exception types), so they are all kept. Thread-safe."""

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def first(self, *kind: Hashable) -> bool:
        if kind in self._seen:
            return False
        with self._lock:
            if kind in self._seen:
                return False
            self._seen.add(kind)
            return True


class Gauge(Protocol):
    """Where an outage shows: 1 while failing, 0 once working (``kvtier_tier_outage{tier, op}``)."""

    def set(self, value: float) -> None: ...


class Outage:
    """The health of one tier's reads, or of its writes (a read-only disk still serves reads).

    The first failure of an outage is logged, the ones after it only counted, and the recovery logged again.
    After a failure the tier rests: callers skip it (a read is a miss, a write is dropped and counted) instead
    of each waiting for a dead server's timeout. The first call after the rest tries the tier again, so it
    comes back by itself once the server answers. The rest starts at ``retry_seconds`` and doubles with each
    failed retry, up to :data:`MAX_REST_SECONDS`, so a long outage costs one slow call now and then.
    ``kvtier_tier_outage`` is 1 from a failure until the next success.
    """

    def __init__(self, tier: str, what: str, retry_seconds: float, gauge: Gauge | None = None,
                 logger: logging.Logger = log) -> None:
        self._log = logger
        self._tier, self._what = tier, what
        self._gauge = gauge
        self._retry = retry_seconds
        self._rest = retry_seconds
        self._failing = False
        self._until = 0.0  # monotonic time the rest ends
        self._lock = threading.Lock()

    def resting(self) -> bool:
        return self._failing and time.monotonic() < self._until

    @property
    def failing(self) -> bool:
        """In an outage: failed since its last success (resting or not)."""
        return self._failing

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            first, self._failing = not self._failing, True
            self._rest = self._retry if first else min(max(self._retry, self._rest * 2), MAX_REST_SECONDS)
            self._until = time.monotonic() + self._rest
            if self._gauge is not None:  # under the lock: a success racing this failure cannot leave it stale
                self._gauge.set(1)
        if first:
            self._log.warning("tier %s: %s failing (further failures counted, not logged; retrying after %.1f s, "
                        "then less often): %s", self._tier, self._what, self._retry, exc)

    def succeeded(self) -> None:
        if self._failing:
            with self._lock:
                was, self._failing = self._failing, False
                if self._gauge is not None:
                    self._gauge.set(0)
            if was:
                self._log.warning("tier %s: %s working again", self._tier, self._what)
