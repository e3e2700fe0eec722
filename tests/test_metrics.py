from __future__ import annotations

import urllib.request
from pathlib import Path

from kvtier import KVStore
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.testing.servers import free_port
from tests.conftest import NS, store_config

T = 16


def test_stats_and_prometheus_agree(tmp_path: Path) -> None:
    port = free_port()
    cfg = store_config(tmp_path / "fs") | {"metrics_port": port}
    with KVStore.from_config(cfg) as store:
        tokens = synthetic_tokens(1, 3 * T)
        store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
        store.drop_dram()
        store.get(NS, tokens)
        store.get(NS, synthetic_tokens(2, T))  # a miss
        stats = store.stats()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    fs = stats["filesystem"]
    assert fs["promotions_total"] == 3 and fs["hit_chunks_total"] == 3
    assert stats["dram"]["evictions_total"] == 3
    assert stats["_store"]["miss_chunks_total"] == 1
    assert fs["written_bytes_total"] == fs["read_bytes_total"] > 0
    assert f'kvtier_promotions_total{{tier="filesystem"}} {fs["promotions_total"]}' in body
    assert f'kvtier_written_bytes_total{{tier="filesystem"}} {fs["written_bytes_total"]}' in body
    assert 'kvtier_tier_read_seconds_bucket{le="0.001",tier="filesystem"}' in body
    assert 'kvtier_tier_events_total{event="evictions",tier="filesystem"} 0.0' in body


def test_served_samples_carry_the_process_labels_set_after_serving_began(tmp_path: Path) -> None:
    port = free_port()
    cfg = store_config(tmp_path / "fs") | {"metrics_port": port}
    with KVStore.from_config(cfg) as store:
        store.metrics.process_labels.update(role="worker", tp_rank="1")  # as the vLLM connector sets them
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        only = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?name[]=kvtier_hit_chunks_total",
                                      timeout=5).read().decode()
    samples = [ln for ln in body.splitlines() if ln.startswith("kvtier_")]
    assert samples and all('role="worker"' in ln and 'tp_rank="1"' in ln for ln in samples)
    assert 'kvtier_capacity_bytes{role="worker",tier="dram",tp_rank="1"}' in body
    asked = [ln for ln in only.splitlines() if ln and not ln.startswith("#")]  # one family asked for by name
    assert asked and all(ln.startswith("kvtier_hit_chunks_total{") and 'role="worker"' in ln for ln in asked)


def test_the_skip_reasons_declared_at_zero_are_those_the_connector_raises() -> None:
    """Dashboards read kvtier_connector_skipped_requests_total by reason from start: each reason a request can be
    skipped for is declared (at 0), and no other."""
    import re
    from pathlib import Path

    from kvtier.integrations.vllm import _namespace as _vllm_namespace
    from kvtier.integrations.vllm._shared import SKIP_REASONS

    raised = set(re.findall(r'Skip\("(\w+)"', Path(_vllm_namespace.__file__).read_text()))
    assert raised == set(SKIP_REASONS)


def test_the_outage_gauge_follows_a_tier_failing_and_coming_back(tmp_path: Path, monkeypatch) -> None:
    """kvtier_tier_outage{what="writes"} is 0 from the start, 1 once a write fails, 0 again after a write succeeds;
    the used bytes and queue depth are read at each scrape, not only by stats()."""
    from kvtier.errors import TierError

    port = free_port()
    cfg = store_config(tmp_path / "fs", retry_seconds=0) | {"metrics_port": port}

    def scrape(name: str) -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))

    with KVStore.from_config(cfg) as store:
        tier = store.tiers[0]
        assert scrape('kvtier_tier_outage{tier="filesystem",what="writes"}') == 0
        assert scrape('kvtier_corrupt_objects_total{tier="filesystem"}') == 0  # declared before any event
        put = tier.put

        def failing(*args, **kwargs):
            raise TierError("disk gone")

        monkeypatch.setattr(tier, "put", failing)
        tokens = synthetic_tokens(1, T)
        store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
        assert scrape('kvtier_tier_outage{tier="filesystem",what="writes"}') == 1
        assert scrape('kvtier_tier_outage{tier="filesystem",what="reads"}') == 0
        monkeypatch.setattr(tier, "put", put)
        tokens = synthetic_tokens(2, 2 * T)
        store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
        assert scrape('kvtier_tier_outage{tier="filesystem",what="writes"}') == 0
        assert scrape('kvtier_used_bytes{tier="filesystem"}') == tier.used_bytes() > 0
        assert scrape('kvtier_used_bytes{tier="dram"}') == store.dram.used_bytes > 0
