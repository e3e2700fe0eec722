"""A server process started in a session of its own, waited on by its health check, stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path


def http_ok(url: str) -> Callable[[], bool]:
    """A health check: ``url`` answers with a 2xx."""

    def check() -> bool:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return True
        except OSError:
            return False

    return check


class Process:
    """One server: its command line, log file and health check. Its whole process group is signalled (vLLM's API
    server has children), and only by the PID this object started."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str],
                 health: str | Callable[[], bool]) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = env
        self.health_url = health if isinstance(health, str) else ""
        self.healthy: Callable[[], bool] = http_ok(health) if isinstance(health, str) else health
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Process:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 600, stop: threading.Event | None = None) -> None:
        """Return once the health check passes; RuntimeError if the process exits, ``timeout`` passes or ``stop``
        is set first."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if stop is not None and stop.is_set():
                raise RuntimeError(f"interrupted while waiting for {self.name}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); its log ({self.log}) ends:\n"
                                   + log_tail(self.log))
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer its health check "
                                   f"{self.health_url or ''} within {timeout:.0f} s; its log ({self.log}) ends:\n"
                                   + log_tail(self.log))
            time.sleep(0.5)

    def send(self, sig: int) -> None:
        """Send ``sig`` to the process's whole group: children left by a leader that died go too. Before the leader
        is reaped (``returncode`` unset) its PID, the group's id, cannot have been reused; after, only to an
        :func:`orphaned_group` (a crashed API server's engine process, which still holds its ports)."""
        if self.proc is None or (self.proc.returncode is not None and not orphaned_group(self.proc.pid)):
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 60) -> None:
        """Send ``sig`` to the process's group and wait for the process to go (SIGKILL after ``timeout``)."""
        self.send(sig)
        self.wait_gone(timeout)

    def wait_gone(self, timeout: float) -> None:
        """Wait for the process and then the rest of its group (SIGKILL to the group after ``timeout``): vLLM's
        engine process, which serves kvtier's metrics port, outlived its API server by over 10 s once."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        if self.proc.returncode is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        wait_group_gone(self.proc.pid, deadline)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


def stop_all(processes: list[Process], timeout: float = 60) -> None:
    """SIGTERM to every process at once, then wait for each (SIGKILL to one still there after ``timeout``)."""
    for proc in processes:
        proc.send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in processes:
        proc.wait_gone(max(deadline - time.monotonic(), 0.1))


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if there is no such process (or it has
    ended): with the PID it names one process for good, where a PID alone may have been reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()  # (bytes: a name is cut at 15 bytes, mid-character maybe)
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()
    return None if fields[0] == b"Z" else int(fields[19])  # a zombie has ended; only its parent's wait is due


def group_alive(pgid: int) -> bool:
    """Whether a process of the process group ``pgid`` still runs (a zombie has ended)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_bytes().rsplit(b")", 1)[1].split()
            if fields[0] != b"Z" and int(fields[2]) == pgid:
                return True
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not a stat line this reads
            continue
    return False


def orphaned_group(pgid: int) -> bool:
    """Whether members of the group ``pgid`` run after its leader ended. No process holds ``pgid`` as its PID (the
    kernel gives no new process a group's id while the group has a member), so these are the old group's."""
    return start_time(pgid) is None and group_alive(pgid)


def wait_group_gone(pgid: int, deadline: float) -> None:
    """Wait for every process of the group ``pgid`` (its leader already gone) to end; SIGKILL to the group at
    ``deadline``."""
    while orphaned_group(pgid):
        if time.monotonic() >= deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + 10  # SIGKILL ends it at once; bounded all the same
            while orphaned_group(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        time.sleep(0.1)


def stop_recorded(pid: int, started: int | None, timeout: float = 60) -> bool:
    """Stop the process group of ``pid`` if ``pid`` is still the process that started at ``started`` (SIGTERM,
    then SIGKILL after ``timeout``), and wait for the whole group to end; where the leader ended by itself, its
    group's members that still run (:func:`orphaned_group`). False if nothing of it was left."""
    leader = started is not None and start_time(pid) == started
    if not leader and (started is None or not orphaned_group(pid)):
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while leader and start_time(pid) == started and time.monotonic() < deadline:
        time.sleep(0.2)
    if leader and start_time(pid) == started:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_group_gone(pid, deadline)
    return True
