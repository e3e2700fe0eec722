"""The store's callers while a shared server stalls (a real Redis under CLIENT PAUSE): a lookup that needs the
server waits at most the tier's bound once, then the tier rests and lookups answer from DRAM at once; a lookup
that DRAM answers alone never waits at all."""

from __future__ import annotations

import time

from kvtier import KVStore
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.testing.servers import RedisServer

from .conftest import NS

T = 16
SOCKET_TIMEOUT = 1.0
# A timed-out call is not retried (tests/test_shared_faults.py measures the tier's own bound): one timeout, with a
# margin for a loaded machine short of a second timeout.
BOUND = SOCKET_TIMEOUT + 0.9
# A call that reaches the paused server waits its whole socket timeout: anything well under it never asked
ASKED_NOTHING = SOCKET_TIMEOUT / 2


def test_a_stalled_redis_costs_one_bounded_wait_per_back_off(redis_server: RedisServer, unique_prefix: str) -> None:
    tier = {"type": "redis", **redis_server.tier_options(), "key_prefix": unique_prefix,
            "socket_timeout": SOCKET_TIMEOUT, "connect_timeout": SOCKET_TIMEOUT, "retry_seconds": 5}
    with KVStore.from_config({"chunk_tokens": T, "dram": {"capacity_bytes": "8MiB", "page_bytes": "16KiB"},
                              "tiers": [tier]}) as store:
        cached = synthetic_tokens(1, 2 * T)
        store.put(NS, cached, synthetic_kv(cached))
        store.flush()
        unknown = [synthetic_tokens(100 + i, 2 * T) for i in range(20)]
        assert store.lookup(NS, unknown[0]) == 0  # the connection is warm
        redis_server.cli("client", "pause", "4000", "all")
        try:
            times = []
            for tokens in unknown[1:]:
                start = time.perf_counter()
                assert store.lookup(NS, tokens) == 0 and store.get(NS, tokens) is None
                times.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert store.lookup(NS, cached) == 2 * T  # answered by DRAM: the tier is never asked
            in_dram = time.perf_counter() - start
        finally:
            redis_server.cli("ping")  # answered once the pause ends
        assert times[0] < BOUND, times
        assert max(times[1:]) < ASKED_NOTHING, times  # resting: no call reaches the server until retry_seconds pass
        assert in_dram < ASKED_NOTHING
        assert store.stats()["redis"]["read_errors_total"] == 1
