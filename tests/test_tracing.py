"""kvtier's spans with the OpenTelemetry SDK's in-memory exporter: a cascade write joins the trace of the put that
queued it (on another thread), a tier read nests under the load that asked for it, outcomes are recorded, and with
tracing off nothing is made."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier import tracing
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.conftest import NS

sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

T = 16


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)


def test_a_tier_write_joins_the_put_and_a_tier_read_the_load(make_store, spans: InMemorySpanExporter,
                                                             tmp_path: Path) -> None:
    store = make_store()
    tokens = synthetic_tokens(3, 2 * T)
    kv = synthetic_kv(tokens)
    with tracing.span("request.save") as save:
        store.put(NS, tokens, kv)
    store.flush()
    by_name = {}
    for s in spans.get_finished_spans():
        by_name.setdefault(s.name, []).append(s)
    writes = by_name["kvtier.tier.write"]
    assert len(writes) == 2 and {w.attributes["outcome"] for w in writes} == {"written"}
    assert all(w.parent.span_id == save.get_span_context().span_id for w in writes)  # across the writer thread
    assert all(w.context.trace_id == save.get_span_context().trace_id for w in writes)

    spans.clear()
    store.drop_dram()
    with tracing.span("request.load") as load:
        got = store.get(NS, tokens)
    assert got is not None and torch.equal(got, kv)
    reads = [s for s in spans.get_finished_spans() if s.name == "kvtier.tier.read"]
    assert [r.attributes["outcome"] for r in reads] == ["hit", "hit"]
    assert {r.attributes["tier"] for r in reads} == {"filesystem"}
    assert all(r.parent.span_id == load.get_span_context().span_id for r in reads)

    # a corrupt object is a miss, and its span says why
    for path in (tmp_path / "fs").rglob("*.kv"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    store.drop_dram()
    spans.clear()
    assert store.get(NS, tokens) is None
    assert [s.attributes["outcome"] for s in spans.get_finished_spans()  # noqa: RUF015 the first read's, as asserted
            if s.name == "kvtier.tier.read"][0] == "corrupt"


def test_the_router_continues_a_w3c_trace_and_passes_it_on(spans: InMemorySpanExporter) -> None:
    incoming = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    with tracing.span("kvtier.router.request", tracing.context_of(incoming)), \
            tracing.span("kvtier.router.upstream") as upstream:
        sent = tracing.headers()
    assert sent["traceparent"].split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert sent["traceparent"].split("-")[2] == format(upstream.get_span_context().span_id, "016x")
    root = next(s for s in spans.get_finished_spans() if s.name == "kvtier.router.request")
    assert root.parent.span_id == 0x00F067AA0BA902B7


def test_off_nothing_is_made(make_store, spans: InMemorySpanExporter) -> None:
    tracing.use_provider(None)
    assert not tracing.enabled()
    with tracing.span("x", a=1) as s:
        assert s is None
    assert tracing.headers() == {} and tracing.current() is None
    assert tracing.context_of({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}) is None
    job = lambda: 1  # noqa: E731
    assert tracing.carried(job) is job
    store = make_store()
    tokens = synthetic_tokens(4, 2 * T)
    store.put(NS, tokens, synthetic_kv(tokens))
    store.flush()
    store.drop_dram()
    assert store.get(NS, tokens) is not None
    assert spans.get_finished_spans() == ()  # the provider that was on before saw nothing


def test_a_read_ahead_on_a_pool_thread_stays_in_the_loads_trace(make_store, spans: InMemorySpanExporter) -> None:
    """Tiers that read ahead (S3; Mooncake's batches) run their reads on the store's pool threads: the spans still
    nest under the load that started them."""
    store = make_store()
    tier = store.tiers[0]
    tier.read_ahead = True  # as a network tier's: reads of later chunks start while the first is checked
    tokens = synthetic_tokens(5, 6 * T)
    kv = synthetic_kv(tokens)
    store.put(NS, tokens, kv)
    store.flush()
    store.drop_dram()
    spans.clear()
    with tracing.span("request.load") as load:
        got = store.get(NS, tokens)
    assert got is not None and torch.equal(got, kv)
    reads = [s for s in spans.get_finished_spans() if s.name == "kvtier.tier.read"]
    assert len(reads) == 6
    assert all(r.context.trace_id == load.get_span_context().trace_id for r in reads)
