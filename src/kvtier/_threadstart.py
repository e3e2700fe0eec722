"""Starting kvtier's threads: each named in the OS and run on the CPUs :func:`run_on` set, if any.

The lowest layer of :mod:`kvtier.threads` (which re-exports all of it, and says why threads are placed), apart
so that :mod:`kvtier.tracing`, whose context the daemon pools carry, starts its exporter on such a thread
without importing them back.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Collection
from typing import Any, TypeVar

log = logging.getLogger("kvtier")
_T = TypeVar("_T")

_cpus: frozenset[int] | None = None  # where kvtier's threads run (None: where the thread starting them may)
_placement_failed = False  # logged once
_PR_SET_NAME = 15  # prctl(2): the calling thread's name, 15 bytes at most
_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None  # this process's own C library


def run_on(cpus: frozenset[int] | None) -> None:
    """Have every kvtier thread started from now on run on ``cpus`` (None: wherever its starter may run)."""
    global _cpus
    _cpus = cpus


def placed_on() -> frozenset[int] | None:
    """The CPUs :func:`run_on` set for kvtier's threads (None: not placed)."""
    return _cpus


def entered(name: str) -> None:
    """First thing on every kvtier thread: its name in the OS, and its CPUs (:func:`run_on`). Never raises: a
    thread that cannot move runs where it was started (logged once)."""
    global _placement_failed
    if _libc is not None:
        try:
            _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        except (AttributeError, OSError):  # not Linux: the name stays the process's
            pass
    cpus = _cpus
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread
        except OSError as exc:  # e.g. the CPUs left the process's cpuset since
            if not _placement_failed:
                _placement_failed = True
                log.warning("kvtier: cannot move thread %s to CPUs %s (%s); it runs where it was started",
                            name, cpu_list(cpus), exc)


def start(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread running ``target`` that first calls :func:`entered`."""
    def run() -> None:
        entered(name)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def call(fn: Callable[[], _T], name: str) -> _T:
    """``fn()`` run on a kvtier thread of its own (named ``name``), its result returned and what it raises
    raised: the threads a library starts inside it (a metrics server's, a span exporter's) inherit its CPUs and
    its name in the OS."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 handed to the caller, raised there
            box.append((False, exc))

    start(run, name).join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def cpu_list(cpus: Collection[int]) -> str:
    """``{2, 0, 1}`` -> ``0,1,2`` (for messages)."""
    return ",".join(str(c) for c in sorted(cpus))
