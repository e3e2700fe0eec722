"""Fixtures of the router's end-to-end fleets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.testing.servers import RedisServer


@pytest.fixture(scope="module")
def roomy_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis of the module's own, with room for all its fleet's float32 KV (2 GB): the session's (512 MB, shared
    with the other tests of a worker) evicts by LRU, which neither kvtier nor the router is told of, so a chunk
    found missing, or a prediction gone wrong, would fail a test by chance."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), maxmemory="2gb").start()
    yield server
    server.stop()
