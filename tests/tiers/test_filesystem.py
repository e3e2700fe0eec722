from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier import ConfigError, FilesystemTier
from kvtier.keys import HeadRange
from kvtier.testing.tiers import NS_A, TierConformance, key
from kvtier.tiers.filesystem import FilesystemOptions


def open_tier(path: Path, **options: object) -> FilesystemTier:
    tier = FilesystemTier.from_config("fs", {"path": str(path), **options}, "tiers[0]")
    assert isinstance(tier, FilesystemTier)
    return tier


def test_reading_a_header_is_not_a_use(tmp_path: Path) -> None:
    """``kvtier cache ls --codecs`` reads each header: the LRU order (the index's, and the files' times a restart
    finds) stays as it was; a get records its use."""
    tier = open_tier(tmp_path / "fs")
    try:
        tier.put(key(1), [b"h" * 200])
        (path,) = list((tmp_path / "fs").rglob("*.kv"))
        os.utime(path, (1_000_000, 1_000_000))
        before = next(o.last_used for o in tier.list())
        assert tier.head(key(1), 96) == b"h" * 96
        assert path.stat().st_mtime == 1_000_000 and next(o.last_used for o in tier.list()) == before
        tier.get(key(1))
        assert path.stat().st_mtime > 1_000_000
    finally:
        tier.close()


class TestFilesystemConformance(TierConformance):
    @pytest.fixture
    def tier_config(self, tmp_path: Path) -> dict[str, object]:
        return {"type": "filesystem", "path": str(tmp_path / "stores")}

    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[FilesystemTier]:
        tier = open_tier(tmp_path / "fs")
        yield tier
        tier.close()

    @pytest.fixture
    def reopen(self, tmp_path: Path) -> Callable[[FilesystemTier], FilesystemTier]:
        def reopen(old: FilesystemTier) -> FilesystemTier:
            old.close()
            return open_tier(tmp_path / "fs")
        return reopen


def test_files_are_private(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "fs")
    tier.put(key(1), [b"secret kv"])
    files = [p for p in (tmp_path / "fs").rglob("*") if p.is_file()]
    dirs = [p for p in (tmp_path / "fs").rglob("*") if p.is_dir()] + [tmp_path / "fs"]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in dirs)


def test_restart_reindexes(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "fs")
    for i in range(20):
        tier.put(key(i, HeadRange(i % 2, i % 2 + 1, 2)), [bytes([i]) * (i + 1)])
    tier.close()
    again = open_tier(tmp_path / "fs")
    assert {(o.key, o.size) for o in again.list()} == {
        (key(i, HeadRange(i % 2, i % 2 + 1, 2)), i + 1) for i in range(20)}
    assert again.used_bytes() == sum(range(1, 21))


def test_capacity_watermarks_evict_least_recently_used(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "fs", capacity_bytes=10_000, high_watermark=0.9, low_watermark=0.5)
    for i in range(9):
        tier.put(key(i), [b"x" * 1000])
    assert tier.used_bytes() == 9000  # at the high watermark, not above: nothing evicted yet
    assert tier.get(key(0)) is not None  # key 0 is now the most recently used
    tier.put(key(9), [b"x" * 1000])  # 10,000 > 9,000: evict down to 5,000
    assert tier.used_bytes() == 5000
    assert {o.key for o in tier.list()} == {key(0), key(6), key(7), key(8), key(9)}
    assert tier.counters()["evictions"] == 5


def test_eviction_order_survives_restart(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "fs")
    for i in range(4):
        tier.put(key(i), [b"y" * 100])
        time.sleep(0.02)
    tier.get(key(0))  # 0 becomes the most recently used, on disk too
    tier.close()
    again = open_tier(tmp_path / "fs", capacity_bytes=300, high_watermark=1.0, low_watermark=0.5)
    # 400 bytes > 300: the restart evicts the least recently used (1, 2, 3 in order) down to 150.
    assert {o.key for o in again.list()} == {key(0)}


def test_ttl_expires_by_age_also_across_restart(tmp_path: Path) -> None:
    ttl = 1.5  # (a loaded machine may pause between a put and the next line: not past this)
    tier = open_tier(tmp_path / "fs", ttl_seconds=ttl)
    tier.put(key(1), [b"old"])
    assert tier.get(key(1)) is not None
    time.sleep(ttl + 0.1)
    assert tier.heads(NS_A, [key(1).chunk]) == [[]]
    assert tier.get(key(1)) is None
    tier.put(key(2), [b"new"])
    tier.close()
    time.sleep(ttl + 0.1)
    again = open_tier(tmp_path / "fs", ttl_seconds=ttl)
    assert list(again.list()) == []
    assert not any(p.suffix == ".kv" for p in (tmp_path / "fs").rglob("*"))


def test_foreign_files_are_ignored(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "fs")
    tier.put(key(1), [b"kv"])
    (tmp_path / "fs" / NS_A / "zz").mkdir()
    (tmp_path / "fs" / NS_A / "zz" / "README.txt").write_text("not ours")
    (tmp_path / "fs" / NS_A / "zz" / "nothex.0-1of1.5.kv").write_text("not ours")
    tier.close()
    assert [o.key for o in open_tier(tmp_path / "fs").list()] == [key(1)]


@pytest.mark.parametrize(("options", "field"), [
    ({"capacity_bytes": -1}, "capacity_bytes"),
    ({"low_watermark": 0.9, "high_watermark": 0.5}, "low_watermark"),
    ({"durability": "always"}, "durability"),
    ({"ttl_seconds": "soon"}, "ttl_seconds"),
    ({"colour": "blue"}, "colour"),
])
def test_bad_options_name_the_field(tmp_path: Path, options: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"tiers\[0\]\.{field}"):
        open_tier(tmp_path / "fs", **options)


def test_fsync_durability_writes(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "fs", durability="fsync")
    tier.put(key(1), [b"durable"])
    assert bytes(tier.get(key(1)) or b"") == b"durable"
    assert FilesystemOptions(path="x").durability == "none"


@pytest.mark.parametrize("durability", ["none", "fsync"])
@pytest.mark.parametrize("short", [False, True], ids=["whole writes", "short writes"])
def test_a_large_object_is_written_a_piece_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      durability: str, short: bool) -> None:
    """No write() call is given more than WRITE_PIECE bytes (one call of a whole 21 MB chunk took 55 ms where 1 MiB
    calls took 4 ms, on ext4 here); the object is exact, whatever its parts' sizes, also where write() takes only
    part of what it is given (a signal, a full pipe: POSIX allows it)."""
    import os

    from kvtier.tiers.filesystem import writes

    sizes: list[int] = []
    real = os.write

    def write(fd: int, data) -> int:  # type: ignore[no-untyped-def]
        sizes.append(len(memoryview(data).cast("B")))
        return real(fd, memoryview(data)[:4097] if short else data)

    monkeypatch.setattr(writes.os, "write", write)
    tier = open_tier(tmp_path / "fs", durability=durability)
    parts = [os.urandom(96), os.urandom(3 * writes.WRITE_PIECE + 12345), os.urandom(writes.WRITE_PIECE)]
    tier.put(key(1), parts)
    assert max(sizes) == writes.WRITE_PIECE
    assert short or sum(sizes) == sum(len(p) for p in parts)  # (short: the rest of each offered again)
    assert bytes(tier.get(key(1)) or b"") == b"".join(parts)


def test_chunks_written_by_another_process_are_found_on_lookup(tmp_path: Path) -> None:
    reader = open_tier(tmp_path / "fs")  # indexed while the directory was empty
    writer = open_tier(tmp_path / "fs")  # stands for another process sharing the directory
    writer.put(key(1, HeadRange(0, 2, 4)), [b"lo"])
    writer.put(key(1, HeadRange(2, 4, 4)), [b"hi"])
    writer.put(key(2), [b"next"])
    got = reader.heads(NS_A, [key(1).chunk, key(3).chunk, key(2).chunk])
    assert sorted(got[0]) == [HeadRange(0, 2, 4), HeadRange(2, 4, 4)]
    assert got[1] == [] and got[2] == []  # the prefix ends at chunk 3: nothing after it is looked for
    assert bytes(reader.get(key(1, HeadRange(2, 4, 4))) or b"") == b"hi"
    assert reader.heads(NS_A, [key(2).chunk]) == [[HeadRange(0, 4, 4)]]


def test_get_into_more_buffers_than_one_readv_takes(tmp_path: Path) -> None:
    """A DRAM entry scattered over many pages is read in several readv calls (Linux takes 1024 buffers at most)."""
    import os

    tier = FilesystemTier("fs", FilesystemOptions(path=str(tmp_path)))
    blob = os.urandom(96 + 3000 * 16)
    tier.put(key(1), [blob])
    pages = [bytearray(16) for _ in range(3000)]
    assert tier.get_into(key(1), 96, [memoryview(p) for p in pages]) == blob[:96]
    assert b"".join(pages) == blob[96:]


def test_an_expired_file_does_not_exist_and_is_removed(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "fs", ttl_seconds=1.5)  # (past any pause of a loaded machine between two lines)
    tier.put(key(1), [b"old"])
    assert tier.exists(key(1))
    time.sleep(1.6)
    assert not tier.exists(key(1))  # as get: past its TTL it is gone, counted and removed from disk
    assert tier.counters()["expired"] == 1
    assert not any(p.suffix == ".kv" for p in (tmp_path / "fs").rglob("*"))
