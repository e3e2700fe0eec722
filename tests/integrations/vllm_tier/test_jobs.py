"""The tier's job threads: loads run before stores queued earlier, a job that raises is a failed result (never an
exception out of the scheduler's calls), drain waits for every job, and after close a job fails at once."""

from __future__ import annotations

import threading

import pytest

from kvtier.integrations.vllm_tier._jobs import LOAD, STORE, Jobs


def test_loads_run_before_the_stores_queued_before_them() -> None:
    started, gate, ran = threading.Event(), threading.Event(), []

    def run(job: str) -> str:
        if job == "first":
            started.set()
            gate.wait(10)
        ran.append(job)
        return job

    jobs: Jobs[str, str] = Jobs(run, lambda job, exc: f"failed {job}", 1, "test-jobs")
    try:
        jobs.submit("first", STORE)  # holds the one thread while the rest queue
        assert started.wait(10)
        for name, priority in [("store-1", STORE), ("store-2", STORE), ("load-1", LOAD), ("load-2", LOAD)]:
            jobs.submit(name, priority)
        assert jobs.pending
        gate.set()
        assert jobs.drain(10)
        assert ran == ["first", "load-1", "load-2", "store-1", "store-2"]
        assert sorted(jobs.take()) == sorted(ran)
        assert not jobs.pending and jobs.take() == []
    finally:
        jobs.close()


def test_a_job_that_raises_is_its_failure_and_close_fails_later_jobs(caplog: pytest.LogCaptureFixture) -> None:
    def run(job: int) -> str:
        raise OSError(f"disk gone ({job})")

    jobs: Jobs[int, str] = Jobs(run, lambda job, exc: f"failed {job}: {exc}", 2, "test-jobs")
    for i in range(3):
        jobs.submit(i, LOAD)
    assert jobs.drain(10)
    assert sorted(jobs.take()) == [f"failed {i}: disk gone ({i})" for i in range(3)]
    assert sum("a transfer job failed (OSError" in r.message for r in caplog.records) == 1  # then only counted
    jobs.close()
    jobs.submit(7, STORE)
    assert jobs.take() == ["failed 7: the tier is shut down"]
    assert not jobs.pending


def test_drain_times_out_while_a_job_runs() -> None:
    gate = threading.Event()
    jobs: Jobs[int, int] = Jobs(lambda job: gate.wait(10) and job, lambda job, exc: -job, 1, "test-jobs")
    try:
        jobs.submit(1, STORE)
        assert not jobs.drain(0.05)
        gate.set()
        assert jobs.drain(10) and jobs.take() == [1]
    finally:
        gate.set()
        jobs.close()
