"""Stopping a server process (:mod:`kvtier.fleet.process`) ends its whole group, not only its leader: a vLLM API
server's engine process, which holds kvtier's metrics port, outlived its leader by over 10 s once, and the port a
fleet started again on was still taken. Also where the leader ended by itself first (a crashed API server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.fleet.process import Process, group_alive, start_time, stop_recorded

# A leader that exits on SIGTERM (or at once, with "exit"), and a child of its group that ignores SIGTERM (as a
# process busy in a native call, or one whose shutdown takes its time); the leader prints the child's PID.
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                          "print('ready', flush=True)\\ntime.sleep(300)"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
if sys.argv[1:] != ["exit"]:
    time.sleep(300)
"""


def end_group(pgid: int) -> None:
    """(A failed run leaves no sleeper behind.)"""
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


def started(tmp_path: Path, *args: str) -> tuple[Process, int, int | None]:
    """The leader, its child's PID, and the leader's start time (read at once, as ``kvtier fleet up`` records it)."""
    proc = Process("leader", [sys.executable, "-c", LEADER, *args], tmp_path / "leader.log", {},
                   lambda: True).start()
    assert proc.pid is not None
    recorded = start_time(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while not (text := (tmp_path / "leader.log").read_text()).strip():
            assert (proc.running() or args) and time.monotonic() < deadline, text
            time.sleep(0.05)
        child = int(text.split()[0])
        assert start_time(child) is not None and group_alive(proc.pid)
    except BaseException:
        end_group(proc.pid)
        raise
    return proc, child, recorded


@pytest.mark.timeout(120)
def test_a_stopped_process_leaves_no_member_of_its_group(tmp_path: Path) -> None:
    proc, child, _ = started(tmp_path)
    assert proc.pid is not None
    try:
        begin = time.monotonic()
        proc.kill(signal.SIGTERM, timeout=2)  # the leader ends at once; its child only at the SIGKILL after 2 s
        assert time.monotonic() - begin >= 1.9
        assert start_time(child) is None and not group_alive(proc.pid)
    finally:
        end_group(proc.pid)


@pytest.mark.timeout(120)
def test_a_recorded_process_stopped_from_another_process_leaves_no_member_of_its_group(tmp_path: Path) -> None:
    """As ``kvtier fleet down`` stops what ``fleet up`` recorded: by PID and start time, not as the parent."""
    proc, child, _ = started(tmp_path)
    assert proc.pid is not None
    try:
        assert stop_recorded(proc.pid, start_time(proc.pid), timeout=2)
        assert start_time(child) is None and not group_alive(proc.pid)
    finally:
        end_group(proc.pid)
        proc.kill()  # (reaps the leader)


@pytest.mark.timeout(120)
def test_the_group_of_a_leader_that_ended_by_itself_is_stopped(tmp_path: Path) -> None:
    """A leader that crashed (here: exited) before it was stopped, its child still running: stopping it, as its
    parent or by its recorded PID, ends the child."""
    for by_record in (False, True):
        proc, child, recorded = started(tmp_path, "exit")
        assert proc.pid is not None and proc.proc is not None
        try:
            assert recorded is not None
            proc.proc.wait(timeout=60)  # reaped (by kvtier fleet up, when it is not this test)
            assert start_time(child) is not None  # the orphan runs on
            if by_record:
                assert stop_recorded(proc.pid, recorded, timeout=2)
            else:
                proc.kill(signal.SIGTERM, timeout=2)
            assert start_time(child) is None and not group_alive(proc.pid)
        finally:
            end_group(proc.pid)
        (tmp_path / "leader.log").unlink()


def test_the_group_of_a_process_without_children_ends_with_it(tmp_path: Path) -> None:
    proc = Process("plain", [sys.executable, "-c", "import time; time.sleep(300)"], tmp_path / "plain.log", {},
                   lambda: True).start()
    assert proc.pid is not None
    try:
        begin = time.monotonic()
        proc.stop()
        assert time.monotonic() - begin < 30 and not group_alive(proc.pid)
        assert isinstance(proc.proc, subprocess.Popen) and proc.proc.returncode == -signal.SIGTERM
    finally:
        end_group(proc.pid)


def test_a_process_whose_name_is_not_utf8_does_not_break_a_stop(tmp_path: Path) -> None:
    """The kernel cuts a process's name at 15 bytes, mid-character maybe: any process of the host may have one."""
    odd = subprocess.Popen([sys.executable, "-c", "import ctypes, time\n"
                            "ctypes.CDLL(None).prctl(15, b'kvtier-\\xe2\\x82', 0, 0, 0)\nprint(1, flush=True)\n"
                            "time.sleep(300)"], stdout=subprocess.PIPE)
    try:
        assert odd.stdout is not None and odd.stdout.readline() == b"1\n"
        assert Path(f"/proc/{odd.pid}/comm").read_bytes() == b"kvtier-\xe2\x82\n"
        assert start_time(odd.pid) is not None and group_alive(os.getpgid(odd.pid))
        plain = Process("plain", [sys.executable, "-c", "import time; time.sleep(300)"], tmp_path / "plain.log",
                        {}, lambda: True).start()
        plain.stop()
        assert plain.pid is not None and not group_alive(plain.pid)
    finally:
        odd.kill()
        odd.wait()
