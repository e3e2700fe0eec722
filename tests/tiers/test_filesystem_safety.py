"""The filesystem tier against hostile or broken directory contents: foreign and open directories, links,
FIFOs, giant sparse files, two writers of one key, writers in another PID namespace (issue 8)."""

from __future__ import annotations

import fcntl
import os
import re
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from kvtier import ConfigError, FilesystemTier, TierError, frame
from kvtier.keys import HeadRange, ShardKey
from kvtier.testing.tiers import NS_A, key

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")


def open_tier(path: Path | str, **options: object) -> FilesystemTier:
    tier = FilesystemTier.from_config("fs", {"path": str(path), **options}, "tiers[0]")
    assert isinstance(tier, FilesystemTier)
    return tier


def shard_file(root: Path, k: ShardKey) -> Path:
    return root / k.namespace / k.chunk[:2] / f"{k.chunk}.{k.heads}.kv"


def stored_file(root: Path, k: ShardKey) -> Path:
    """The one file holding ``k`` (found by its chunk, whatever the layout names it)."""
    (path,) = (root / k.namespace / k.chunk[:2]).glob(f"{k.chunk}.{k.heads}.*kv")
    return path


def shard(k: ShardKey, created: float, fill: int = 0) -> bytes:
    """A whole stored object (header and payload) as the store writes it."""
    meta = frame.ShardMeta(1, 4, 2, torch.uint8, k.heads)
    payload = bytes([fill]) * meta.nbytes
    return frame.encode_header(k, meta, [payload], created=created) + payload


def temp_name(pid: int) -> str:
    return f"{pid}.{uuid.uuid4().hex}.part"


# -- 1: whose directories, and links inside the root -------------------------------------------------------------
@needs_root
def test_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(TierError, match=rf"{re.escape(str(root))}.*owned by uid 65534"):
        open_tier(root)


def test_root_writable_by_others_is_refused_not_chmodded(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)  # a /tmp-like directory
    with pytest.raises(TierError, match=rf"{re.escape(str(root))}.*writable by group or other"):
        open_tier(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o1777


@pytest.mark.parametrize("inner", [".tmp", ".shares", NS_A, f"{NS_A}/00"])
@pytest.mark.parametrize("change", ["chown", "chmod"])
def test_foreign_or_open_inner_directory_is_refused(tmp_path: Path, inner: str, change: str) -> None:
    root = tmp_path / "fs"
    open_tier(root).put(key(1), [b"kv"])  # chunk 00..01: makes .tmp, the namespace and its 00 directory
    if change == "chown":
        if os.geteuid() != 0:
            pytest.skip("needs root to chown to another uid")
        os.chown(root / inner, 65534, 65534)
    else:
        os.chmod(root / inner, 0o777)
    refused = "(owned by uid 65534|writable by group or other)"
    with pytest.raises(TierError, match=rf"{re.escape(str(root / inner))}.*{refused}"):
        open_tier(root)


def test_symlinked_tmp_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    (victim / temp_name(999_999_999)).write_text("also keep me")  # named like a dead writer's temp file
    before = sorted(victim.iterdir())
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    (root / ".tmp").symlink_to(victim)
    with pytest.raises(TierError, match=rf"{re.escape(str(root))}.*symbolic link"):
        open_tier(root)
    assert sorted(victim.iterdir()) == before


def test_symlinked_namespace_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "00").mkdir(parents=True, mode=0o700)
    os.chmod(outside, 0o700)
    planted = f"{key(2).chunk}.{key(2).heads}.kv"
    (outside / "00" / planted).write_bytes(shard(key(2), time.time()))
    root = tmp_path / "fs"
    tier = open_tier(root)
    (root / NS_A).symlink_to(outside)
    with pytest.raises(TierError, match="symbolic link"):
        tier.put(key(1), [b"secret kv"])
    assert [p.name for p in (outside / "00").iterdir()] == [planted]  # nothing written through the link
    assert tier.heads(NS_A, [key(2).chunk]) == [[]] and tier.get(key(2)) is None
    again = open_tier(root)  # start-up skips the link too
    assert list(again.list()) == []


def test_symlink_at_a_chunk_name_is_removed_never_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not kv, not yours")
    root = tmp_path / "fs"
    tier = open_tier(root)
    tier.put(key(1), [b"kv one"])
    tier.put(key(2), [b"kv two"])
    links = [stored_file(root, k) for k in (key(1), key(2))]
    for link in links:
        link.unlink()
        link.symlink_to(secret)
    assert tier.get(key(1)) is None  # indexed, then swapped for a link: a miss
    assert not links[0].is_symlink()
    again = open_tier(root)  # found at start: removed, not indexed
    assert list(again.list()) == [] and again.get(key(2)) is None
    assert not links[1].is_symlink()
    assert secret.read_bytes() == b"not kv, not yours"
    assert tier.counters()["rejected_files"] == 1 and again.counters()["rejected_files"] == 1


def test_empty_path_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    os.chmod(tmp_path, 0o755)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path"):
        open_tier("")
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755  # the working directory was not chmodded


def test_created_parents_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        open_tier(tmp_path / "a" / "b" / "fs").put(key(1), [b"kv"])
    finally:
        os.umask(old)
    made = [tmp_path / "a", tmp_path / "a" / "b", *[p for p in (tmp_path / "a").rglob("*") if p.is_dir()]]
    assert {stat.S_IMODE(p.stat().st_mode) for p in made} == {0o700}


# -- 2: one file per key ---------------------------------------------------------------------------------------
def test_one_file_per_key_when_two_processes_write_it(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    first, second = open_tier(root), open_tier(root)  # two processes sharing the directory
    first.put(key(1), [b"k" * 100])
    time.sleep(0.01)  # a later creation time: the old layout then named a second file
    second.put(key(1), [b"k" * 100])
    assert [p.name for p in root.rglob("*.kv")] == [shard_file(root, key(1)).name]
    assert second.heads(NS_A, [key(1).chunk]) == [[HeadRange(0, 4, 4)]]
    assert first.used_bytes() == second.used_bytes() == 100  # what the disk holds, counted once
    assert second.delete(key(1))  # e.g. `kvtier cache purge --all`
    assert open_tier(root).get(key(1)) is None  # nothing left to serve after a restart


def test_capacity_holds_for_the_directory_shared_by_several_processes(tmp_path: Path) -> None:
    """TP workers (or engines) sharing one directory each write their own files: the capacity is the disk's.

    Each worker sees the others' files only at its walks, so the bound is checked once every worker has walked
    after the last write (how many files it missed in between depends on the machine's speed, not on kvtier)."""
    root = tmp_path / "fs"
    workers = [open_tier(root, capacity_bytes=10_000, rescan_seconds=0.05) for _ in range(3)]
    try:
        for i in range(60):
            workers[i % 3].put(key(i, HeadRange(i % 3, i % 3 + 1, 3)), [b"k" * 400])  # 24,000 bytes written
        time.sleep(0.1)  # every worker's next put walks the directory first
        for n, w in enumerate(workers):
            w.put(key(100 + n, HeadRange(n, n + 1, 3)), [b"k" * 400])
        on_disk = sum(p.stat().st_size for p in root.rglob("*.kv"))
        assert on_disk <= 10_000 * 0.95, on_disk  # without the walks each keeps its own 21 files: 25,200
        assert sum(w.counters()["evictions"] for w in workers) >= 63 - on_disk // 400
    finally:
        for w in workers:
            w.close()


def test_reindex_migrates_the_earlier_layout_keeping_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    open_tier(root).close()
    old, mid, new = time.time() - 30, time.time() - 20, time.time() - 10
    one, two = key(1), key(2, HeadRange(0, 2, 4))
    for k, created, fill in [(one, old, 1), (one, new, 2), (one, mid, 3), (two, mid, 4)]:
        path = shard_file(root, k).with_suffix(f".{int(created * 1000)}.kv")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_bytes(shard(k, created, fill))
    tier = open_tier(root)
    assert sorted(p.name for p in root.rglob("*.kv")) == sorted(shard_file(root, k).name for k in (one, two))
    assert bytes(tier.get(one) or b"") == shard(one, new, 2)
    assert {o.key: round(o.created, 3) for o in tier.list()} == {one: round(new, 3), two: round(mid, 3)}
    assert tier.used_bytes() == len(shard(one, new)) + len(shard(two, mid))


def test_ttl_counts_from_the_header_and_a_read_does_not_extend_it(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    tier = open_tier(root, ttl_seconds=1.0)
    tier.put(key(1), [shard(key(1), time.time() - 0.7)])
    assert tier.get(key(1)) is not None  # sets the file's mtime (last use) to now
    tier.close()
    time.sleep(0.4)
    again = open_tier(root, ttl_seconds=1.0)
    assert list(again.list()) == [] and not list(root.rglob("*.kv"))
    assert again.counters()["expired"] == 1


# -- 3: temp files are cleaned by lock, not by PID --------------------------------------------------------------
HOLDER = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"half a shard")
    print("ready", flush=True)
    sys.stdin.readline()
""")


def test_temp_files_are_cleaned_by_lock_not_by_pid(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    open_tier(root).close()
    # A live writer whose PID means nothing here (another PID namespace), and a dead one whose PID is alive here.
    live, dead, foreign = root / ".tmp" / temp_name(999_999_999), root / ".tmp" / temp_name(os.getpid()), \
        root / ".tmp" / "notes.txt"
    dead.write_bytes(b"torn")
    foreign.write_text("not ours")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(live)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"ready"
        tier = open_tier(root)
        assert live.exists() and not dead.exists() and foreign.exists()
        assert tier.counters()["removed_temp_files"] == 1
    finally:
        holder.communicate(b"\n", timeout=30)
    assert open_tier(root).counters()["removed_temp_files"] == 1  # the writer is gone: now its file goes


def test_put_holds_a_lock_on_its_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = open_tier(tmp_path / "fs", durability="fsync")
    seen: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        for part in (tmp_path / "fs" / ".tmp").iterdir():  # while writing: can someone else lock it?
            probe = os.open(part, os.O_RDONLY)
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append(False)
            except BlockingIOError:
                seen.append(True)
            finally:
                os.close(probe)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tier.put(key(1), [b"kv"])
    assert seen and all(seen)


# -- 4: only regular files of a sane size are read -------------------------------------------------------------
@pytest.mark.timeout(60)
def test_fifo_at_a_chunk_name_is_a_prompt_miss(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    tier = open_tier(root)
    tier.put(key(1), [b"kv"])
    tier.put(key(2), [b"kv"])
    fifos = [stored_file(root, k) for k in (key(1), key(2))]
    for fifo in fifos:
        fifo.unlink()
        os.mkfifo(fifo)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(tier.get(key(1))), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # the old behaviour: blocked opening the FIFO; give it a writer so it ends
        os.close(os.open(fifos[0], os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("get blocked on a FIFO")
    assert got == [None] and not fifos[0].exists()
    assert tier.counters()["rejected_files"] == 1
    again = open_tier(root)  # found at start: removed, not indexed
    assert list(again.list()) == [] and not fifos[1].exists()


@pytest.mark.timeout(60)
def test_sparse_giant_file_is_a_miss_never_allocated(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    tier = open_tier(root)
    tier.put(key(1), [b"kv"])
    tier.put(key(2), [b"kv"])
    giants = [stored_file(root, k) for k in (key(1), key(2))]
    for giant in giants:
        os.truncate(giant, 2**40)  # 1 TiB, all holes
    assert tier.get(key(1)) is None
    assert not giants[0].exists() and tier.counters()["rejected_files"] == 1
    again = open_tier(root)  # found at start: removed, not indexed
    assert list(again.list()) == [] and not giants[1].exists()
    assert again.counters()["rejected_files"] == 1


def test_a_longer_file_is_read_one_byte_past_its_indexed_size(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    tier = open_tier(root)
    tier.put(key(1), [b"k" * 100])
    os.truncate(stored_file(root, key(1)), 2**30)  # grew behind the index: damaged, not worth a GiB
    got = tier.get(key(1))
    assert got is not None and len(got) == 101  # enough for the store's check to call it too long


def test_anything_but_files_in_tmp_does_not_stop_the_start(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    open_tier(root).close()
    target = tmp_path / "target"
    target.write_text("keep me")
    tmp = root / ".tmp"
    (tmp / temp_name(999_999_999)).mkdir()
    os.mkfifo(tmp / temp_name(999_999_998))
    (tmp / temp_name(999_999_997)).symlink_to(target)
    tier = open_tier(root)
    tier.put(key(1), [b"kv"])
    assert bytes(tier.get(key(1)) or b"") == b"kv"
    assert target.read_text() == "keep me" and len(list(tmp.iterdir())) == 3


def test_a_key_that_is_not_hex_never_names_a_path(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "root")
    try:
        for bad in (ShardKey("..", "ab" * 16, HeadRange(0, 1, 1)), ShardKey("ab" * 16, "../" * 4, HeadRange(0, 1, 1))):
            with pytest.raises(TierError, match="not a namespace id"):
                tier.put(bad, [b"x"])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
    finally:
        tier.close()


@pytest.mark.parametrize("suffix", ["", ".lock"], ids=["ledger", "lock"])
@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_a_share_ledger_that_is_not_a_regular_file_is_replaced_never_followed(tmp_path: Path, planted: str,
                                                                              suffix: str) -> None:
    """Whoever could plant a ledger (or its lock file) could steer every process's count of a share: a link or a
    FIFO in its place is removed (the link's target untouched) and a file of the tier's own made."""
    from kvtier.quotas import share_id

    root = tmp_path / "fs"
    open_tier(root).close()
    planted_at = root / ".shares" / (share_id("rule0") + suffix)
    ledger = root / ".shares" / share_id("rule0")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    if planted == "link":
        planted_at.symlink_to(victim)
    else:
        os.mkfifo(planted_at, 0o600)
    tier = open_tier(root)
    tier.set_share(NS_A, "rule0", 10)
    tier.put(key(1), [b"kv"])
    assert stat.S_ISREG(planted_at.lstat().st_mode) and NS_A in ledger.read_text()
    assert victim.read_text() == "keep me"
    assert tier.share_bytes("rule0") == 2
