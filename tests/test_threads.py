"""Where kvtier's threads run: the cores an engine's bound OpenMP threads leave free (read from the environment
vLLM gives its CPU workers), and every kvtier thread moved there and named in the OS when it starts."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import _threadstart, threads
from kvtier.threads import DaemonPool, spare_cpus

ALL = set(range(8))


@pytest.mark.parametrize(("environ", "spare"), [
    ({"OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}, set(range(1, 8))),  # vLLM's own form (libgomp, no preload)
    ({"OMP_PLACES": "{0}"}, set(range(1, 8))),  # libgomp binds by default once places are given
    ({"OMP_PLACES": "{0}", "OMP_PROC_BIND": "spread,close"}, set(range(1, 8))),
    ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, set(range(3, 8))),
    ({"OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "close"}, set(range(2, 8))),
    ({"OMP_PLACES": "{0:4}", "OMP_PROC_BIND": "true"}, set(range(4, 8))),  # interval: 4 places from 0
    ({"OMP_PLACES": "{0:2:2}", "OMP_PROC_BIND": "true"}, ALL - {0, 2}),  # and a stride
    ({"GOMP_CPU_AFFINITY": "0 1"}, set(range(2, 8))),
    ({"GOMP_CPU_AFFINITY": "0-3"}, set(range(4, 8))),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1]"}, set(range(2, 8))),
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true", "VLLM_CPU_OMP_THREADS_BIND": "auto"}, set(range(2, 8))),
])
def test_the_cores_an_engine_binding_leaves(environ: dict[str, str], spare: set[int]) -> None:
    assert spare_cpus(environ, ALL, ALL - spare) == spare


@pytest.mark.parametrize(("environ", "current", "why"), [
    ({}, {0}, "no binding in the environment"),
    ({"OMP_PLACES": "{0}", "OMP_PROC_BIND": "false"}, {0}, "binding off"),
    ({"OMP_PLACES": "{0,1}:4:2", "OMP_PROC_BIND": "true"}, {0, 1}, "replicated places: not parsed here"),
    ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, {0}, "an abstract place: not known which cores"),
    ({"OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}, set(ALL), "the thread is not bound: binding did not happen"),
    ({"OMP_PLACES": "{9}", "OMP_PROC_BIND": "true"}, {9}, "bound outside where the process may run"),
    ({"OMP_PLACES": "{0-7}", "OMP_PROC_BIND": "true"}, {0}, "a form not parsed"),
    ({"GOMP_CPU_AFFINITY": "0-7"}, set(ALL), "every core computes: none left"),
    # cores a user listed for vLLM: perhaps one of several engines' on the host, whose others' look free here
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true", "VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}, {0, 1},
     "cores listed by the user"),
])
def test_no_binding_known_leaves_threads_where_they_are(environ: dict[str, str], current: set[int],
                                                        why: str) -> None:
    assert spare_cpus(environ, ALL, current) is None, why


def test_smt_siblings_of_busy_cores_and_other_nodes_are_not_spare() -> None:
    """Two nodes of 4 CPUs, CPU n and n+4 one physical core's two threads (a hypothetical layout, for the
    rule): the worker bound to CPU 0 of node {0, 1, 4, 5} keeps off 0 and its sibling 4, and off the other node."""
    siblings = {n: {n % 4, n % 4 + 4} for n in ALL}
    nodes = [{0, 1, 4, 5}, {2, 3, 6, 7}]
    assert spare_cpus({"OMP_PLACES": "{0}"}, ALL, {0}, siblings=siblings, nodes=nodes) == {1, 5}


def test_this_machines_topology_is_read() -> None:
    siblings, nodes = threads.topology()
    for cpu in os.sched_getaffinity(0):
        assert cpu in siblings.get(cpu, {cpu})
    assert all(nodes)  # a node listed has CPUs


@pytest.fixture
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setattr(_threadstart, "_placement_failed", False)  # logged once per process
    yield cpus[0], cpus[1]
    threads.run_on(None)


def _comm(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_kvtier_threads_run_on_the_given_cores_and_are_named(two_cpus: tuple[int, int]) -> None:
    """As in a vLLM CPU worker: the thread starting kvtier's threads is bound to the engine's core; without the
    move every thread it starts would be bound there too."""
    compute, spare = two_cpus
    seen: dict[str, tuple[set[int], str]] = {}

    def where(label: str) -> None:
        seen[label] = (os.sched_getaffinity(0), _comm(threading.get_native_id()))

    def engine_thread() -> None:
        os.sched_setaffinity(0, {compute})
        threads.start(lambda: where("before"), "kvtier-before").join()  # nothing set yet: where its starter is
        threads.run_on(frozenset({spare}))
        threads.start(lambda: where("started"), "kvtier-started").join()
        pool = DaemonPool("kvtier-pool", 1)
        pool.submit(lambda: where("pool")).result(timeout=10)
        pool.close(wait=5)

    starter = threading.Thread(target=engine_thread)
    starter.start()
    starter.join(timeout=30)
    assert seen["before"] == ({compute}, "kvtier-before")
    assert seen["started"] == ({spare}, "kvtier-started")
    assert seen["pool"] == ({spare}, "kvtier-pool-0")


def test_a_core_that_cannot_be_had_leaves_the_thread_where_it_started(two_cpus: tuple[int, int],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    threads.run_on(frozenset({4096}))  # no such CPU
    seen: list[set[int]] = []
    threads.start(lambda: seen.append(os.sched_getaffinity(0)), "kvtier-nowhere").join()
    assert seen == [os.sched_getaffinity(0)]
    assert "cannot move thread kvtier-nowhere to CPUs 4096" in caplog.text


def test_a_librarys_threads_started_by_call_run_where_kvtiers_do(two_cpus: tuple[int, int]) -> None:
    compute, spare = two_cpus
    seen: list[tuple[set[int], str]] = []

    def library() -> threading.Thread:  # e.g. start_http_server: a thread of its own, still serving after
        thread = threading.Thread(target=lambda: seen.append(
            (os.sched_getaffinity(0), _comm(threading.get_native_id()))))
        thread.start()
        return thread

    def engine_thread() -> None:
        os.sched_setaffinity(0, {compute})
        threads.run_on(frozenset({spare}))
        threads.call(library, "kvtier-metrics").join()
        try:
            threads.call(lambda: 1 // 0, "kvtier-raises")
        except ZeroDivisionError as exc:
            raised.append(exc)

    raised: list[BaseException] = []
    starter = threading.Thread(target=engine_thread)
    starter.start()
    starter.join(timeout=30)
    assert seen == [({spare}, "kvtier-metrics")]
    assert len(raised) == 1  # what fn raised reaches the caller


def test_a_pool_closing_cancels_what_is_queued_and_waits_for_what_runs() -> None:
    """close(cancel=True): a job still queued is cancelled (its future's callbacks run at once), one under way is
    waited for, and the pool says it is idle only once that one has ended; an idle pool says so at once."""
    from concurrent.futures import CancelledError

    from kvtier.threads import DaemonPool

    pool = DaemonPool("kvtier-test", 1)
    gate, started = threading.Event(), threading.Event()
    running = pool.submit(lambda: (started.set(), gate.wait(10)))
    queued = pool.submit(lambda: "never")
    called: list[bool] = []
    queued.add_done_callback(lambda f: called.append(f.cancelled()))
    assert started.wait(10)
    pool.stop(cancel=True)
    assert called == [True]
    with pytest.raises(CancelledError):
        queued.result()
    assert not pool.wait_idle(0.1)  # the running job holds it
    threading.Timer(0.1, gate.set).start()
    assert pool.wait_idle(10) and running.result() == (None, True)
    with pytest.raises(RuntimeError, match="submit after close"):
        pool.submit(lambda: None)
    idle = [DaemonPool(f"kvtier-idle-{i}", 2) for i in range(10)]
    for p in idle:
        p.submit(lambda: None).result()
    assert all(p.close(wait=1.0, cancel=True) for p in idle)  # (returns as soon as its last job has ended)
