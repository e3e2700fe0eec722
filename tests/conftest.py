from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import KVStore, Namespace
from kvtier.testing.servers import MooncakeServer, RedisCluster, RedisServer, S3Server

NS = Namespace(model="test-model", dtype="bfloat16")


CLEAN_AUDIT = {"refs": 0, "pending": 0, "lost_pages": 0, "idle_mismatch": 0, "share_mismatch": 0}


def settled(store: KVStore) -> dict[str, int]:
    """The DRAM pool's accounting once the reads ahead a load no longer needs have ended (up to 10 s): their entries
    are aborted when their reads (or decryptions) end, which may be after the load returned."""
    deadline = time.monotonic() + 10
    while (audit := store.dram.audit())["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return audit


def store_config(path: Path | str | None, *, chunk_tokens: int = 16, dram: str | int = "8MiB",
                 page_bytes: str | int = "16KiB", **tier: object) -> dict:
    """A small store config; ``path`` adds a filesystem tier with ``tier`` options."""
    cfg: dict = {"chunk_tokens": chunk_tokens, "dram": {"capacity_bytes": dram, "page_bytes": page_bytes}}
    if path is not None:
        cfg["tiers"] = [{"type": "filesystem", "path": str(path), "queue_depth": 4096, **tier}]
    return cfg


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator:
    """Build stores over ``tmp_path/fs`` (or a given path); all are closed at teardown."""
    stores: list[KVStore] = []

    def make(path: Path | None = tmp_path / "fs", **kw: object) -> KVStore:
        store = KVStore.from_config(store_config(path, **kw))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (needs root to mount): fills up for real, and can be remounted read-only."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount to make a real small filesystem")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- real servers on loopback, started once per test session and stopped by PID at its end -------------------
@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"), replicas=1).start()  # 3 primaries, 3 replicas
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mooncake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeServer]:
    server = MooncakeServer(tmp_path_factory.mktemp("mooncake")).start()
    yield server
    server.stop()


@pytest.fixture
def unique_prefix() -> str:
    """A key prefix of this test's own, so tests sharing one server never see each other's objects."""
    return f"t{uuid.uuid4().hex[:12]}/"
