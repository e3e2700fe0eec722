"""What the quota tests share: stores configured with a tenant share per tier kind, and the helpers that drive
them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier import KVStore, Namespace, frame, quotas
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.tiers.filesystem import FilesystemOptions, FilesystemTier


T = 16
PAGE = 16 * 2**10


def chunk_bytes() -> int:
    """What one chunk takes in DRAM: its payload in whole pages."""
    return -(-payload_bytes() // PAGE) * PAGE


def payload_bytes() -> int:
    kv = synthetic_kv(synthetic_tokens(0, T))
    return kv.numel() * kv.element_size()


def config(tmp_path: Path | None, quota: dict, tiers: list[str] = ()) -> dict:
    cfg: dict = {"chunk_tokens": T, "dram": {"capacity_bytes": "16MiB", "page_bytes": PAGE},
                 "placement": [{"salt": "team-*", "tiers": list(tiers), "quota": quota}, {"tiers": list(tiers)}]}
    if tiers:
        cfg["tiers"] = [{"type": "filesystem", "name": name, "path": str(tmp_path / name), "queue_depth": 4096}
                        for name in tiers]
    return cfg


def ns(salt: str | None) -> Namespace:
    return Namespace(model="m", dtype="bfloat16", cache_salt=salt)


@pytest.fixture
def age(monkeypatch: pytest.MonkeyPatch):
    """Tiers never evict a share's objects used in the last RECENT_SECONDS (a prompt's own chunks): shortened
    here (to a second: a prompt's chunks written to a network tier on a loaded machine stay within it), and
    ``age()`` lets everything stored so far grow older than that."""
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 1.0)
    return lambda: time.sleep(1.1)


# -- Redis: the shares are counted in the server, over every engine's writes -------------------------------------
SHARD = payload_bytes() + frame.HEADER_LEN  # what one chunk's object takes in Redis (one engine, all heads)


def redis_config(server, prefix: str, quota_shards: int, **tier: object) -> dict:
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "16MiB", "page_bytes": PAGE},
            "tiers": [{"type": "redis", "name": "shared", **server.tier_options(), "key_prefix": prefix,
                       "queue_depth": 4096, **tier}],
            "placement": [{"salt": "team-*", "tiers": ["shared"], "quota": {"shared": quota_shards * SHARD}}]}


def held(store: KVStore, tenant: str) -> int:
    return sum(1 for _ in store.tiers[0].list(ns(tenant).id))


def put(store: KVStore, tenant: str, tokens: list[int]) -> None:
    store.put(ns(tenant), tokens, synthetic_kv(tokens))
    store.flush()


# -- S3: each engine counts a share from listings of the bucket ---------------------------------------------------
def s3_config(server, prefix: str, quota_shards: int, **tier: object) -> dict:
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "16MiB", "page_bytes": PAGE},
            "tiers": [{"type": "s3", "name": "shared", **server.tier_options(), "prefix": prefix,
                       "queue_depth": 4096, "share_refresh_seconds": 0, **tier}],
            "placement": [{"salt": "team-*", "tiers": ["shared"], "quota": {"shared": quota_shards * SHARD}}]}


def listed_age() -> None:
    """``age()`` for objects in an S3 listing: S3 lists write times to the second (the server's ``Date`` too),
    so a listed object may count as written up to 2 s after it was."""
    time.sleep(2.0 + quotas.RECENT_SECONDS + 0.1)


# -- Mooncake: each engine counts a share from the master's key list ---------------------------------------------
def mooncake_config(server, prefix: str, quota_shards: int, **tier: object) -> dict:
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "16MiB", "page_bytes": PAGE},
            "tiers": [{"type": "mooncake", "name": "shared", **server.tier_options(), "key_prefix": prefix,
                       "queue_depth": 4096, "share_refresh_seconds": 0, **tier}],
            "placement": [{"salt": "team-*", "tiers": ["shared"], "quota": {"shared": quota_shards * SHARD}}]}


# -- Filesystem: a share is the directory's, whichever processes and threads write it ----------------------------
FS_SHARD = 1000  # bytes per shard in the tier-level tests: small, so they are quick


def fs_tier(path: Path, **options: object) -> FilesystemTier:
    return FilesystemTier("fs", FilesystemOptions(path=str(path), **options))


def files_of(path: Path, namespace: str) -> int:
    return sum(1 for _ in (path / namespace).rglob("*.kv"))
