"""How the processes and threads sharing one directory hold a share to its quota together (kvtier.quotas.ledger):
the ledger's token, its compaction and limit, and processes killed or failing mid-write."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier import quotas
from kvtier.errors import QuotaFull, TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas import index as quota_index, ledger as share_ledger
from kvtier.testing.tiers import NS_A, NS_B, key as tier_key
from tests.quotas.conftest import FS_SHARD, files_of, fs_tier


def _fill_share(path: Path, first: int, shards: int, threads: int, slow: bool, start: Any = None) -> None:
    """One process: ``threads`` writers, each putting its own ``shards`` shards of NS_A into a share of 12 (once
    every process has opened the tier, when ``start`` is a barrier)."""
    tier = fs_tier(path)
    if slow:  # a fault: the write itself takes a while, so concurrent puts overlap between check and rename
        create = tier._create_temp
        tier._create_temp = lambda: (time.sleep(0.05), create())[1]  # type: ignore[method-assign]
    tier.set_share(NS_A, "rule0", 12 * FS_SHARD)
    if start is not None:
        start.wait(30)

    def write(t: int) -> None:
        for i in range(shards):
            with contextlib.suppress(QuotaFull):
                tier.put(tier_key(first + 100 * t + i), [b"x" * FS_SHARD])

    workers = [threading.Thread(target=write, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    tier.close()


@pytest.mark.parametrize("recent", [quotas.RECENT_SECONDS, 0.0], ids=["refused", "evicted"])
def test_three_processes_on_one_directory_hold_one_share_to_its_quota(tmp_path: Path, recent: float,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each process puts 12 shards into a share of 12: together they hold 12, not 36, whether the share refuses
    (all recent) or evicts (nothing recent; then one process evicts the others' files)."""
    monkeypatch.setattr(quotas, "RECENT_SECONDS", recent)
    fs_tier(tmp_path / "fs").close()  # the root exists before the processes race to make it
    fork = multiprocessing.get_context("fork")  # inherits the patched window; nothing to import again
    start = fork.Barrier(3)  # all three indexed the empty directory before any writes
    procs = [fork.Process(target=_fill_share, args=(tmp_path / "fs", 10_000 * p, 12, 1, False, start))
             for p in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert files_of(tmp_path / "fs", NS_A) == 12
    again = fs_tier(tmp_path / "fs")
    again.set_share(NS_A, "rule0", 12 * FS_SHARD)
    assert again.share_bytes("rule0") == 12 * FS_SHARD


def test_four_writer_threads_hold_a_share_to_its_quota(tmp_path: Path) -> None:
    """``workers: 4``: puts of one share check and commit one at a time, so slow writes that overlap still stop at
    the quota (every shard recent: the rest are refused)."""
    _fill_share(tmp_path / "fs", 0, 6, 4, True)
    assert files_of(tmp_path / "fs", NS_A) == 12


def test_a_process_alone_on_its_share_counts_it_from_its_index(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The share is listed from the directory only when another process changed it: once at the first put (the
    ledger's token is new to this process), then never, however many files the share evicts; once more after
    another process's write."""
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.0)
    tier, other = fs_tier(tmp_path / "fs"), fs_tier(tmp_path / "fs")
    listings = []
    recount = tier._recount_share
    monkeypatch.setattr(tier, "_recount_share", lambda ledger: (listings.append(1), recount(ledger)))
    tier.set_share(NS_A, "rule0", 4 * FS_SHARD)
    for i in range(20):
        tier.put(tier_key(i), [b"x" * FS_SHARD])
    assert (len(listings), files_of(tmp_path / "fs", NS_A), tier.counters()["share_evictions"]) == (1, 4, 16)
    other.set_share(NS_A, "rule0", 4 * FS_SHARD)
    other.put(tier_key(100), [b"y" * FS_SHARD])  # evicts one of the first process's files
    tier.put(tier_key(101), [b"x" * FS_SHARD])
    assert len(listings) == 2 and files_of(tmp_path / "fs", NS_A) == 4
    assert tier.share_bytes("rule0") == 4 * FS_SHARD


def test_a_share_counted_again_lists_only_the_chunk_directories_changed(tmp_path: Path) -> None:
    """Counting a share again skips a chunk directory whose mtime is the one seen at its last listing (and was
    old then), and lists one another process changed since: its removal and its new file are both seen."""
    def shard_key(sub: int) -> ShardKey:
        return ShardKey(NS_A, f"{sub:02x}" + "0" * 30, HeadRange(0, 4, 4))

    a, b = fs_tier(tmp_path / "fs"), fs_tier(tmp_path / "fs")
    for tier in (a, b):
        tier.set_share(NS_A, "rule0", 20 * FS_SHARD)
    for sub in range(4):
        a.put(shard_key(sub), [b"a" * FS_SHARD])
    old = time.time() - 60
    for sub in range(4):
        os.utime(tmp_path / "fs" / NS_A / f"{sub:02x}", (old, old))  # as if written a minute ago
    b.put(shard_key(4), [b"b" * FS_SHARD])  # a must count the share again at its next put
    a.put(shard_key(5), [b"a" * FS_SHARD])  # lists every directory; notes 00-03 as old
    b.delete(shard_key(1))
    b.put(shard_key(0x20), [b"b" * FS_SHARD])
    seen: list[tuple[str, bool]] = []
    listed = a._listed.unchanged
    a._listed.unchanged = lambda ns, sub, fd: seen.append((sub, listed(ns, sub, fd))) or seen[-1][1]  # type: ignore
    a.put(shard_key(6), [b"a" * FS_SHARD])
    skipped = {sub for sub, unchanged in seen if unchanged}
    assert skipped == {"00", "02", "03"}  # 01 lost a file, 04 and 05 are new, 20 is new
    assert a.share_bytes("rule0") == files_of(tmp_path / "fs", NS_A) * FS_SHARD == 7 * FS_SHARD


def _ledger_path(path: Path) -> Path:
    return path / ".shares" / quotas.share_id("rule0")


def _grow_ledger(path: Path, namespaces: int) -> None:
    """Lines as other processes' joins append them (one per namespace a salt-hopping client made), none with files."""
    with _ledger_path(path).open("ab") as f:
        f.write(b"".join(b"%032x\n" % (i + 1) for i in range(namespaces)))


def test_a_ledger_past_its_size_limit_is_compacted_never_replaced_under_a_running_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger grown past 4 MiB (a namespace per salt) is not removed by the next process to open it, which would
    leave the running one locking a file no one else locks: the share stays at its quota, and the ledger shrinks
    to the namespaces that hold files."""
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.0)
    a = fs_tier(tmp_path / "fs")
    a.set_share(NS_A, "rule0", 12 * FS_SHARD)
    a.put(tier_key(0), [b"a" * FS_SHARD])
    _grow_ledger(tmp_path / "fs", 130_000)
    assert _ledger_path(tmp_path / "fs").stat().st_size > 4 * 2**20
    b = fs_tier(tmp_path / "fs")
    b.set_share(NS_A, "rule0", 12 * FS_SHARD)
    for first, tier in ((1, a), (1000, b), (2000, a), (3000, b)):
        for i in range(12):
            tier.put(tier_key(first + i), [b"x" * FS_SHARD])
    assert files_of(tmp_path / "fs", NS_A) == 12
    assert _ledger_path(tmp_path / "fs").stat().st_size < 4096


def test_a_ledger_full_of_namespaces_with_files_refuses_a_new_namespace(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Compacting cannot shrink a ledger whose namespaces all hold files: a put of a new namespace into the share
    is refused (share_full) rather than the ledger growing past its limit; a namespace it names still writes."""
    monkeypatch.setattr(share_ledger, "_MAX_BYTES", 38 + 3 * 33)  # the header and three namespaces
    tier = fs_tier(tmp_path / "fs")
    spaces = [f"{i:032x}" for i in range(1, 5)]
    for namespace in spaces:
        tier.set_share(namespace, "rule0", 100 * FS_SHARD)
    for namespace in spaces[:3]:
        tier.put(tier_key(1, namespace=namespace), [b"x" * FS_SHARD])
    with pytest.raises(QuotaFull):
        tier.put(tier_key(1, namespace=spaces[3]), [b"x" * FS_SHARD])
    tier.put(tier_key(2, namespace=spaces[0]), [b"x" * FS_SHARD])
    assert tier.counters()["share_refused_writes"] == 1 and files_of(tmp_path / "fs", spaces[3]) == 0
    assert _ledger_path(tmp_path / "fs").stat().st_size <= 38 + 3 * 33


def test_namespaces_learned_from_the_ledger_never_push_out_the_processs_own(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The store tells a tier a namespace's share once: however many namespaces other processes' ledgers name,
    the ones this process was told keep their quota (the learned ones are the bounded kind)."""
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.0)
    monkeypatch.setattr(quota_index, "_KEPT", 50)
    tier = fs_tier(tmp_path / "fs")
    tier.set_share(NS_A, "rule0", 12 * FS_SHARD)
    tier.put(tier_key(0), [b"a" * FS_SHARD])
    _grow_ledger(tmp_path / "fs", 200)
    other = fs_tier(tmp_path / "fs")
    other.set_share(NS_B, "rule0", 12 * FS_SHARD)
    other.put(tier_key(0, namespace=NS_B), [b"b" * FS_SHARD])  # a new token: the first one learns the ledger again
    for i in range(40):
        tier.put(tier_key(i), [b"x" * FS_SHARD])
    assert files_of(tmp_path / "fs", NS_A) + files_of(tmp_path / "fs", NS_B) == 12


def test_a_put_into_an_unchanged_share_reads_no_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put reads the ledger's token only, unless another process changed the share: then it reads it once."""
    tier, other = fs_tier(tmp_path / "fs"), fs_tier(tmp_path / "fs")
    tier.set_share(NS_A, "rule0", 100 * FS_SHARD)
    other.set_share(NS_A, "rule0", 100 * FS_SHARD)
    tier.put(tier_key(0), [b"x" * FS_SHARD])
    ledger = tier._ledgers.of(quotas.share_id("rule0"))
    reads = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: (reads.append(n) if fd == ledger._fd and n > 16 else None,
                                                        pread(fd, n, at))[1])
    for i in range(1, 10):
        tier.put(tier_key(i), [b"x" * FS_SHARD])
    assert reads == []
    other.put(tier_key(100), [b"y" * FS_SHARD])
    tier.put(tier_key(10), [b"x" * FS_SHARD])
    assert len(reads) == 1 and tier.share_bytes("rule0") == 12 * FS_SHARD


def test_telling_a_tier_of_a_share_takes_no_lock_another_process_holds(tmp_path: Path) -> None:
    """``set_share`` runs on the store's request path: a new namespace must not wait for another process's put
    into the same share (its ledger's lock); the namespace joins the ledger at its first put."""
    import fcntl

    tier = fs_tier(tmp_path / "fs")
    tier.set_share(NS_A, "rule0", 100 * FS_SHARD)
    tier.put(tier_key(0), [b"x" * FS_SHARD])
    held = [os.open(p, os.O_RDONLY) for p in (tmp_path / "fs" / ".shares").iterdir()]
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: as another process's put holds it
    try:
        told = threading.Thread(target=tier.set_share, args=(NS_B, "rule0", 100 * FS_SHARD), daemon=True)
        told.start()
        told.join(2)
        assert not told.is_alive()
    finally:
        for fd in held:
            os.close(fd)
    told.join(10)
    tier.put(tier_key(1, namespace=NS_B), [b"y" * FS_SHARD])
    assert NS_B in _ledger_path(tmp_path / "fs").read_text() and tier.share_bytes("rule0") == 2 * FS_SHARD


def test_a_process_killed_between_its_rename_and_its_token_leaves_the_share_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put draws a token no process saw before it evicts or renames: a process killed after its rename, before
    its last token, still makes the others count the share again (they hold it to its quota, not above)."""
    monkeypatch.setattr(quotas, "RECENT_SECONDS", 0.0)
    survivor = fs_tier(tmp_path / "fs")
    survivor.set_share(NS_A, "rule0", 12 * FS_SHARD)
    for i in range(12):
        survivor.put(tier_key(i), [b"b" * FS_SHARD])
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            killed = fs_tier(tmp_path / "fs")
            killed.set_share(NS_A, "rule0", 12 * FS_SHARD)
            rename = killed._rename_into_place
            killed._rename_into_place = lambda tmp, key: (rename(tmp, key), os._exit(9))  # type: ignore
            killed.put(tier_key(5000), [b"a" * FS_SHARD])
        finally:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] >> 8 == 9
    for i in range(3):
        survivor.put(tier_key(100 + i), [b"b" * FS_SHARD])
    assert files_of(tmp_path / "fs", NS_A) == 12 == survivor.share_bytes("rule0") // FS_SHARD


def test_a_ledger_rewrite_that_fails_leaves_the_ledger_as_it_was(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A purge's (or a compaction's) rewrite is written aside and renamed over the ledger: failing at the rename
    (as a crash there would) leaves every line of the old one, and the tier goes on holding the share to its quota."""
    tier = fs_tier(tmp_path / "fs")
    for namespace in (NS_A, NS_B):
        tier.set_share(namespace, "rule0", 3 * FS_SHARD)
        tier.put(tier_key(0, namespace=namespace), [b"x" * FS_SHARD])
    before = _ledger_path(tmp_path / "fs").read_text().split("\n")[1:]
    rename = os.rename
    def failing(src: str, dst: str, **kw: Any) -> None:
        if str(src).endswith(".new"):
            raise OSError(28, "No space left on device")
        rename(src, dst, **kw)
    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(TierError):
        tier.remove_records([NS_B])
    assert _ledger_path(tmp_path / "fs").read_text().split("\n")[1:] == before
    assert [p.name for p in (tmp_path / "fs" / ".shares").iterdir() if p.name.endswith(".new")] == []
    monkeypatch.setattr(os, "rename", rename)
    tier.remove_records([NS_B])
    assert NS_B not in _ledger_path(tmp_path / "fs").read_text()
    for i in range(1, 5):
        with contextlib.suppress(QuotaFull):
            tier.put(tier_key(i), [b"x" * FS_SHARD])
    assert tier.share_bytes("rule0") <= 3 * FS_SHARD
