"""The audit log: `kvtier cache purge` and `verify --repair` append who, what, when, objects and bytes (never
prompt content); the hash chain finds an edited, removed or inserted record; two processes appending at once keep
it whole; an unwritable log stops a purge before anything is removed."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import stat
import threading
from pathlib import Path

import pytest
import yaml

import kvtier.audit
from kvtier import KVStore
from kvtier.audit import AuditLog, Verdict, verify
from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.conftest import NS, store_config

T = 16


def setup_store(tmp_path: Path, audit: Path) -> Path:
    cfg = store_config(tmp_path / "fs") | {"audit_log": str(audit)}
    with KVStore.from_config(cfg) as store:
        for seed in (1, 2):
            tokens = synthetic_tokens(seed, 2 * T)
            store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_purge_is_recorded_and_the_chain_finds_tampering(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    audit = tmp_path / "audit.jsonl"
    config = setup_store(tmp_path, audit)
    assert main(["cache", "purge", "--config", str(config), "--namespace", NS.id]) == 0
    start, done, records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert start["action"] == "purge-start" and start["objects"] == 4 and start["namespace"] == NS.id
    assert done["action"] == "purge" and done["tier"] == "filesystem" and done["failed"] is False
    assert done["objects"] == 4 and done["bytes"] > 0 and done["who"]["pid"] > 0 and done["time"]
    # then the namespace's directory, the one record of it beside its objects on a disk
    assert (records["action"], records["namespace"], records["records"], records["failed"]) == \
        ("purge-records", NS.id, 1, False)
    assert main(["cache", "purge", "--config", str(config), "--all"]) == 0
    assert main(["cache", "audit", "--config", str(config)]) == 0
    assert "5 records, chain intact" in capsys.readouterr().out
    lines = audit.read_text().splitlines()
    head = Path(f"{audit}.head").read_text()
    forged = json.loads(lines[-1]) | {"objects": 99}
    for tampered in ([lines[0].replace('"objects":4', '"objects":0'), *lines[1:]],  # an early record edited
                     lines[1:],  # the first removed
                     [lines[0], lines[0], *lines[1:]],  # one inserted
                     [*lines[:-1], json.dumps(forged, sort_keys=True, separators=(",", ":"))],  # the last edited
                     lines[:-2]):  # the end cut off
        audit.write_text("\n".join(tampered) + "\n")
        Path(f"{audit}.head").write_text(head)
        assert main(["cache", "audit", "--config", str(config)]) == 1
        assert "BROKEN" in capsys.readouterr().out
    audit.unlink()  # the whole log deleted: its head remains
    assert main(["cache", "audit", "--config", str(config)]) == 1
    assert "the log is gone" in capsys.readouterr().out


def test_a_purge_that_fails_part_way_records_what_it_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    from kvtier.errors import TierError
    from kvtier.tiers.filesystem import FilesystemTier

    audit = tmp_path / "audit.jsonl"
    config = setup_store(tmp_path, audit)
    real = FilesystemTier.delete
    calls = []

    def failing(self, key):
        calls.append(key)
        if len(calls) == 3:
            raise TierError("disk gone")
        return real(self, key)

    monkeypatch.setattr(FilesystemTier, "delete", failing)
    assert main(["cache", "purge", "--config", str(config), "--all"]) == 2
    start, done = [json.loads(line) for line in audit.read_text().splitlines()]
    assert start["objects"] == 4 and done["objects"] == 2 and done["failed"] is True


def test_a_log_kvtier_cannot_trust_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    victim = tmp_path / "victim"
    victim.write_text("")
    link = tmp_path / "audit.jsonl"
    link.symlink_to(victim)
    config = setup_store(tmp_path, link)
    assert main(["cache", "purge", "--config", str(config), "--all"]) == 2
    assert "nothing was removed" in capsys.readouterr().err and victim.read_text() == ""
    link.unlink()
    link.write_text("")
    link.chmod(0o666)  # made by someone else, readable by all
    assert main(["cache", "purge", "--config", str(config), "--all"]) == 2
    assert "no group or other access" in capsys.readouterr().err
    assert len(list((tmp_path / "fs").rglob("*.kv"))) == 4


def _append(path: str, n: int, start) -> None:
    log = AuditLog(path)
    start.wait()
    for i in range(n):
        log.record("purge", tier="t", objects=i, bytes=0)


def test_processes_appending_at_once_keep_the_chain_whole(tmp_path: Path) -> None:
    path = str(tmp_path / "audit.jsonl")
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(4)  # all append at the same moment
    procs = [ctx.Process(target=_append, args=(path, 100, start)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert verify(path) == Verdict(400)
    assert Path(path).stat().st_mode & 0o077 == 0


def test_an_unwritable_log_stops_the_purge_before_anything_is_removed(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    config = setup_store(tmp_path, tmp_path / "no-such-dir" / "audit.jsonl")
    assert main(["cache", "purge", "--config", str(config), "--all"]) == 2
    assert "nothing was removed" in capsys.readouterr().err
    assert len(list((tmp_path / "fs").rglob("*.kv"))) == 4
    bad = yaml.safe_load(config.read_text()) | {"audit_log": "relative.jsonl"}
    config.write_text(yaml.safe_dump(bad))
    assert main(["cache", "stats", "--config", str(config)]) == 2
    assert "audit_log: an absolute path" in capsys.readouterr().err


def _bounded(call, fifo: Path, release_flags: int) -> int:
    """``call()``'s result; fails (instead of hanging the suite) when it blocks on ``fifo``, opening the other
    end to let it go."""
    out: list[int] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(20)
    hung = thread.is_alive()
    if hung:
        os.close(os.open(fifo, release_flags | os.O_NONBLOCK))
        thread.join(20)
    assert not hung, f"blocked on the FIFO {fifo}"
    return out[0]


def purged(tmp_path: Path, audit: Path) -> Path:
    """A store's config whose audit log holds the 3 records of one namespace's purge."""
    config = setup_store(tmp_path, audit)
    assert main(["cache", "purge", "--config", str(config), "--namespace", NS.id]) == 0
    return config


def test_an_audit_directory_another_user_could_write_is_refused(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    where = tmp_path / "audit"
    where.mkdir(mode=0o700)
    audit = where / "audit.jsonl"
    config = purged(tmp_path, audit)
    stored = len(list((tmp_path / "fs").rglob("*.kv")))
    capsys.readouterr()
    # whoever may write the directory may delete the log and its head, or put a forged pair in their place
    for mode in (0o770, 0o703, 0o1777):
        where.chmod(mode)
        assert main(["cache", "audit", "--config", str(config)]) == 2
        assert "writable by group or other" in capsys.readouterr().err
        audit.unlink()
        Path(f"{audit}.head").unlink()  # what such a user can do: not "no records yet"
        assert main(["cache", "audit", "--config", str(config)]) == 2
        assert main(["cache", "purge", "--config", str(config), "--all"]) == 2
        assert "nothing was removed" in capsys.readouterr().err
        where.chmod(0o700)
        audit.unlink(missing_ok=True)
        config = purged(tmp_path, audit)
        capsys.readouterr()
    if os.geteuid() == 0:  # another user's directory (root can hand it over)
        os.chown(where, 12345, -1)
        assert main(["cache", "audit", "--config", str(config)]) == 2
        assert "owned by uid 12345" in capsys.readouterr().err
        assert main(["cache", "purge", "--config", str(config), "--all"]) == 2
        os.chown(where, 0, -1)
    assert main(["cache", "audit", "--config", str(config)]) == 0
    assert len(list((tmp_path / "fs").rglob("*.kv"))) == stored


@pytest.mark.skipif(os.geteuid() != 0, reason="hands files to another uid (CI runs as root)")
def test_a_log_or_head_another_user_owns_or_may_write_fails_the_audit(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    audit = tmp_path / "audit.jsonl"
    config = purged(tmp_path, audit)
    head = Path(f"{audit}.head")
    for path in (audit, head):
        os.chown(path, 12345, -1)  # a consistent pair forged by that user would pass the chain
        assert main(["cache", "audit", "--config", str(config)]) == 1
        assert f"{path} is owned by uid 12345" in capsys.readouterr().out
        os.chown(path, 0, -1)
        path.chmod(0o620)
        assert main(["cache", "audit", "--config", str(config)]) == 1
        assert f"{path} is writable by group or other" in capsys.readouterr().out
        path.chmod(0o600)
    assert main(["cache", "audit", "--config", str(config)]) == 0


def test_a_fifo_or_link_in_place_of_the_log_or_head_fails_at_once(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    audit = tmp_path / "audit.jsonl"
    config = purged(tmp_path, audit)
    head = Path(f"{audit}.head")
    check = lambda: main(["cache", "audit", "--config", str(config)])  # noqa: E731
    purge = lambda: main(["cache", "purge", "--config", str(config), "--all"])  # noqa: E731
    saved = head.read_bytes()
    stored = len(list((tmp_path / "fs").rglob("*.kv")))
    head.unlink()
    os.mkfifo(head, 0o600)
    assert _bounded(check, head, os.O_WRONLY) == 1
    assert f"{head} is not a regular file" in capsys.readouterr().out
    # not opened, and not replaced either: a head rebuilt over it would bless whatever the log's end now holds
    assert _bounded(purge, head, os.O_WRONLY) == 2
    assert "log and head disagree" in (err := capsys.readouterr().err) and "nothing was removed" in err
    assert len(list((tmp_path / "fs").rglob("*.kv"))) == stored and stat.S_ISFIFO(head.lstat().st_mode)
    head.unlink()
    head.write_bytes(saved)
    head.chmod(0o600)
    assert purge() == 0
    assert check() == 0
    assert "5 records, chain intact" in capsys.readouterr().out
    head.unlink()
    head.symlink_to(tmp_path / "elsewhere")
    assert check() == 1
    assert "is a symbolic link" in capsys.readouterr().out
    audit.unlink()
    os.mkfifo(audit, 0o600)
    assert _bounded(check, audit, os.O_WRONLY) == 1
    assert f"{audit} is not a regular file" in capsys.readouterr().out


def test_a_planted_head_temp_file_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.record("purge", tier="t", objects=0, bytes=0)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = Path(f"{path}.head.tmp")
    for plant in (lambda: os.mkfifo(planted, 0o600), lambda: planted.symlink_to(victim), planted.mkdir):
        plant()
        _bounded(lambda: log.record("purge", tier="t", objects=1, bytes=0), planted, os.O_RDONLY)
        (planted.rmdir if planted.is_dir() and not planted.is_symlink() else planted.unlink)()
    assert verify(path) == Verdict(4)
    assert victim.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.jsonl.head", "victim"]


def test_a_crash_mid_append_is_reported_and_mended_by_the_next_record(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    audit = tmp_path / "audit.jsonl"
    config = purged(tmp_path, audit)
    check = lambda: main(["cache", "audit", "--config", str(config)])  # noqa: E731
    whole = audit.read_bytes()
    with audit.open("ab") as log:
        log.write(b'{"action":"purge","zz')  # the process died in the middle of its write
    assert check() == 0
    out = capsys.readouterr().out
    assert "3 records, chain intact" in out and "an unfinished last line of 21 bytes after record 3" in out
    head = Path(f"{audit}.head")
    before = head.read_bytes()
    assert main(["cache", "purge", "--config", str(config), "--all"]) == 0
    data = audit.read_bytes()
    assert data.startswith(whole) and b'"zz' not in data and data.endswith(b"\n")
    assert json.loads(data.splitlines()[3])["torn_tail_cut"] == 21
    assert check() == 0
    assert "5 records, chain intact" in capsys.readouterr().out
    # the other crash: the record appended, its head not yet replaced
    head.write_bytes(before)
    lines = data.splitlines(keepends=True)
    audit.write_bytes(b"".join(lines[:4]))
    assert check() == 0
    assert "4 records, chain intact" in (out := capsys.readouterr().out) and "its head trails by one" in out
    AuditLog(audit).record("purge", tier="t", objects=0, bytes=0)
    assert verify(audit) == Verdict(5)


def test_a_head_past_the_log_is_tampering(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    audit = tmp_path / "audit.jsonl"
    config = purged(tmp_path, audit)
    audit.write_bytes(b"")  # emptied: its head still counts 3
    assert main(["cache", "audit", "--config", str(config)]) == 1
    assert "its head says 3" in capsys.readouterr().out
    audit.unlink()  # gone, and its head a FIFO
    head = Path(f"{audit}.head")
    head.unlink()
    os.mkfifo(head, 0o600)
    assert main(["cache", "audit", "--config", str(config)]) == 1
    assert "the log is gone" in capsys.readouterr().out
    head.unlink()  # both gone, in a directory only this user may write: nothing was ever recorded
    assert main(["cache", "audit", "--config", str(config)]) == 0
    assert "no records yet" in capsys.readouterr().out


def _log_of(tmp_path: Path, records: int) -> tuple[AuditLog, Path]:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for i in range(records):
        log.record("purge", tier="t", objects=i, bytes=0)
    return log, path


def test_no_record_rebuilds_the_head_over_a_cut_or_removed_end(tmp_path: Path) -> None:
    log, path = _log_of(tmp_path, 3)
    whole = path.read_bytes()
    last = whole[:-1].rfind(b"\n") + 1
    # the final newline cut: the last record looks like a crash's unfinished line, but the head counts it
    for cut in (whole[:-1], whole[:last]):  # and the whole last record removed, at a line boundary
        path.write_bytes(cut)
        assert verify(path).broken is not None
        with pytest.raises(ConfigError, match="log and head disagree.*kvtier cache audit"):
            log.record("purge", tier="t", objects=9, bytes=0)
        with pytest.raises(ConfigError, match="log and head disagree"):
            AuditLog(path)  # a purge is refused before it removes anything
        assert path.read_bytes() == cut
        assert verify(path).broken is not None
    # and no "the next record cuts it" when the unfinished line follows a record the head does not count
    path.write_bytes(whole[:-1])
    assert verify(path).notes == (f"an unfinished last line of {len(whole) - 1 - last} bytes after record 2",)
    head = Path(f"{path}.head")
    path.write_bytes(whole)
    head.unlink()  # a missing head is no licence either
    with pytest.raises(ConfigError, match="its head .* is missing"):
        log.record("purge", tier="t", objects=9, bytes=0)


def test_a_head_that_trails_by_one_is_counted_up_before_the_next_append(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    log, path = _log_of(tmp_path, 2)
    head = Path(f"{path}.head")
    behind = head.read_bytes()
    log.record("purge", tier="t", objects=2, bytes=0)
    head.write_bytes(behind)  # a crash between the append and the head's update
    # and then the process killed in the middle of the next append: the head must already count record 3
    real = kvtier.audit._write_all

    def killed_mid_append(fd: int, data: bytes) -> None:
        if os.path.samestat(os.fstat(fd), path.stat()):
            real(fd, data[:len(data) // 2])
            raise KeyboardInterrupt  # not an OSError: nothing takes the half line back
        real(fd, data)

    monkeypatch.setattr(kvtier.audit, "_write_all", killed_mid_append)
    with pytest.raises(KeyboardInterrupt):
        log.record("purge", tier="t", objects=3, bytes=0)
    monkeypatch.undo()
    verdict = verify(path)
    assert (verdict.records, verdict.broken) == (3, None) and "the next record cuts it" in verdict.notes[0]
    assert "torn_tail_cut" in log.record("purge", tier="t", objects=4, bytes=0)
    assert verify(path) == Verdict(4)


def test_a_record_that_fails_leaves_no_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log, path = _log_of(tmp_path, 1)
    stale = tmp_path / "audit.jsonl.head.0123456789abcdef.tmp"
    stale.mkdir()  # at a name the stale-temp cleanup matches: left, and in nobody's way
    log.record("purge", tier="t", objects=1, bytes=0)
    assert verify(path) == Verdict(2) and stale.is_dir()
    before = path.read_bytes()

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvtier.audit._write_head", full)
    with pytest.raises(ConfigError, match="No space left"):
        log.record("purge", tier="t", objects=2, bytes=0)
    assert path.read_bytes() == before
    monkeypatch.undo()
    log.record("purge", tier="t", objects=3, bytes=0)
    assert verify(path) == Verdict(3)


def test_a_socket_in_place_of_the_log_or_head_is_not_a_regular_file(tmp_path: Path) -> None:
    log, path = _log_of(tmp_path, 1)
    head = Path(f"{path}.head")
    for where in (head, path):
        saved = where.read_bytes()
        where.unlink()
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(where))  # opening it gives ENXIO, not ELOOP
            assert verify(path).broken == f"{where} is not a regular file"
            with pytest.raises(ConfigError, match="not a regular file"):
                log.record("purge", tier="t", objects=1, bytes=0)
            assert stat.S_ISSOCK(where.lstat().st_mode)  # not replaced
        where.unlink()
        where.write_bytes(saved)
        where.chmod(0o600)
    assert verify(path) == Verdict(1)
