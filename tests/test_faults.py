"""Faults under a running store: damaged files, a full disk, a read-only disk. Each is a miss or a counted
failure, never wrong KV and never an exception out of put or get."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.conftest import NS

T = 16


def damage_truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def damage_flip_payload_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(data)


def damage_flip_header_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[40] ^= 0x01
    path.write_bytes(data)


def damage_extend(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 64)


def damage_empty(path: Path) -> None:
    path.write_bytes(b"")


def damage_delete(path: Path) -> None:
    path.unlink()


def damage_swap_with_other_chunk(path: Path) -> None:
    other = next(p for p in path.parent.parent.rglob("*.kv") if p != path)
    path.write_bytes(other.read_bytes())  # a valid object, but of another chunk


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip_payload_bit, damage_flip_header_bit,
                                    damage_extend, damage_empty, damage_delete, damage_swap_with_other_chunk])
def test_damaged_file_is_a_counted_miss_and_removed(make_store, tmp_path: Path, damage) -> None:
    store = make_store()
    tokens = synthetic_tokens(1, 4 * T)
    kv = synthetic_kv(tokens)
    store.put(NS, tokens, kv)
    store.flush()
    store.drop_dram()
    third_chunk = [k.hex() for k in __import__("kvtier").chunk_keys(NS, tokens, T)][2]
    victim = next((tmp_path / "fs").rglob(f"{third_chunk}.*.kv"))
    damage(victim)

    assert store.get(NS, tokens) is None  # never wrong KV, never an exception
    assert not victim.exists()
    if damage is not damage_delete:
        assert store.stats()["filesystem"]["corrupt_objects_total"] == 1
    assert store.lookup(NS, tokens) == 2 * T  # the damaged chunk is gone from the index too
    assert torch.equal(store.get(NS, tokens[:2 * T]), kv[:, :, :, :2 * T])
    store.put(NS, tokens, kv)  # the next put heals the hole
    store.flush()
    assert torch.equal(store.get(NS, tokens), kv)


def test_disk_full_keeps_serving_from_dram(make_store, small_fs: Path, caplog) -> None:
    store = make_store(small_fs / "kv", dram="16MiB")
    with caplog.at_level("WARNING"):
        kvs = {}
        for i in range(40):  # 80 shards of 64 KiB: 5 MiB into a 2 MiB filesystem
            tokens = synthetic_tokens(i, 2 * T)
            kvs[i] = (tokens, synthetic_kv(tokens, heads=64))
            store.put(NS, tokens, kvs[i][1])
        store.flush()
    stats = store.stats()["filesystem"]
    assert stats["write_errors_total"] > 0  # the 2 MiB disk filled up for real
    assert stats["written_bytes_total"] > 0
    assert sum("failing" in r.message for r in caplog.records) == 1
    for tokens, kv in kvs.values():
        assert torch.equal(store.get(NS, tokens), kv)
    assert not list((small_fs / "kv" / ".tmp").iterdir())  # failed writes left no temp files


def test_read_only_disk_keeps_serving_from_dram(make_store, small_fs: Path) -> None:
    store = make_store(small_fs / "kv")
    first = synthetic_tokens(1, 2 * T)
    store.put(NS, first, synthetic_kv(first))
    store.flush()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    tokens = synthetic_tokens(2, 2 * T)
    kv = synthetic_kv(tokens)
    store.put(NS, tokens, kv)
    store.flush()
    stats = store.stats()["filesystem"]
    # The first failed write puts the tier to rest; the next one is dropped without trying.
    assert stats["write_errors_total"] == 1 and stats["dropped_writes_total{reason=tier_unavailable}"] == 1
    assert torch.equal(store.get(NS, tokens), kv)
    store.drop_dram()
    assert torch.equal(store.get(NS, first), synthetic_kv(first))  # reads from the read-only disk still work
