"""The audit log: `kvtier cache purge` and `verify --repair` append who, what, when, objects and bytes (never
prompt content); the hash chain finds an edited, removed or inserted record; two processes appending at once keep
it whole; an unwritable log stops a purge before anything is removed."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import yaml

from kvtier import KVStore
from kvtier.audit import AuditLog, verify
from kvtier.cli import main
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
    from kvtier.tiers._filesystem import FilesystemTier

    audit = tmp_path / "audit.jsonl"
    config = setup_store(tmp_path, audit)
    real = FilesystemTier.delete
    calls = []

    def failing(self, key):  # noqa: ANN001, ANN202
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


def _append(path: str, n: int, start) -> None:  # noqa: ANN001
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
    assert verify(path) == (400, None)
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
