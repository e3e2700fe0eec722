"""Stopping a server process (:mod:`kvtier.fleet.process`) ends its whole group, not only its leader: a vLLM API
server's engine process, which holds kvtier's metrics port, outlived its leader by over 10 s once, and the port a
fleet started again on was still taken."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.fleet.process import Process, group_alive, start_time, stop_recorded

# A leader that exits on SIGTERM, and a child of its group that ignores SIGTERM (as a process busy in a native
# call, or one whose shutdown takes its time), told apart by the child's line on the leader's standard output.
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                          "print('ready', flush=True)\\ntime.sleep(300)"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(300)
"""


def started(tmp_path: Path) -> tuple[Process, int]:
    proc = Process("leader", [sys.executable, "-c", LEADER], tmp_path / "leader.log", {}, lambda: True).start()
    deadline = time.monotonic() + 60
    while not (text := (tmp_path / "leader.log").read_text()).strip():
        assert proc.running() and time.monotonic() < deadline, text
        time.sleep(0.05)
    child = int(text.split()[0])
    assert start_time(child) is not None and proc.pid is not None and group_alive(proc.pid)
    return proc, child


def end_group(pgid: int) -> None:
    """(A failed run leaves no sleeper behind.)"""
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_stopped_process_leaves_no_member_of_its_group(tmp_path: Path) -> None:
    proc, child = started(tmp_path)
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
    proc, child = started(tmp_path)
    assert proc.pid is not None
    try:
        assert stop_recorded(proc.pid, start_time(proc.pid), timeout=2)
        assert start_time(child) is None and not group_alive(proc.pid)
    finally:
        end_group(proc.pid)
        proc.kill()  # (reaps the leader)
    assert not stop_recorded(proc.pid, None)  # a process gone is not signalled again


def test_the_group_of_a_process_without_children_ends_with_it(tmp_path: Path) -> None:
    proc = Process("plain", [sys.executable, "-c", "import time; time.sleep(300)"], tmp_path / "plain.log", {},
                   lambda: True).start()
    begin = time.monotonic()
    proc.stop()
    assert time.monotonic() - begin < 30 and proc.pid is not None and not group_alive(proc.pid)
    assert isinstance(proc.proc, subprocess.Popen) and proc.proc.returncode == -signal.SIGTERM
