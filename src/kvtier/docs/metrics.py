"""docs/reference/metrics.md: every Prometheus metric kvtier exports, read from the registries that define them:
the store's (:class:`kvtier.metrics.StoreMetrics`, with the events each tier counts), the vLLM connector's
(:class:`~kvtier.integrations.vllm._shared.ConnectorMetrics`, on the store's registry) and the router's
(:class:`kvtier.router.metrics.RouterMetrics`).

Each is made as the code makes it, into a registry of its own, and collected: a family's name, type and help are
prometheus_client's public fields; its label names it keeps only in ``_labelnames`` (of the metric object, or of a
collector's family), read here in one place.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from kvtier.docs import _markdown as md
from kvtier.metrics import StoreMetrics
from kvtier.router.metrics import RouterMetrics

_SUFFIX = {"counter": "_total"}  # what the exposition adds to a family's name


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric family as a scrape shows it."""

    name: str  # as exposed: kvtier_hit_chunks_total
    type: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str


@dataclasses.dataclass(frozen=True)
class Group:
    title: str
    intro: str
    metrics: tuple[Metric, ...]


def _families(registry: CollectorRegistry, owners: Iterable[object]) -> Iterator[Metric]:
    """The families of ``registry``; label names from the metric objects that ``owners`` hold as attributes, or
    from a collector's own family."""
    labels = {}
    for owner in owners:
        for value in vars(owner).values():
            if isinstance(value, MetricWrapperBase):
                labels[next(iter(value.describe())).name] = tuple(getattr(value, "_labelnames", ()))
    for family in registry.collect():
        names = labels.get(family.name, tuple(getattr(family, "_labelnames", ())))
        yield Metric(family.name + _SUFFIX.get(family.type, ""), family.type, names, family.documentation)


def groups() -> list[Group]:
    store = StoreMetrics()
    store.watch_tiers([])
    # the connector registers on its store's registry; a registry of its own here keeps its families apart
    from kvtier.integrations.vllm._shared import ConnectorMetrics

    owner = types.SimpleNamespace(metrics=types.SimpleNamespace(registry=CollectorRegistry(auto_describe=True)))
    connector = ConnectorMetrics(typing.cast(typing.Any, owner))
    router = RouterMetrics()
    return [
        Group("The store", "Each store's own registry (`store.metrics.registry`), served on `metrics_port`. `tier` "
              "is `dram` or a secondary tier's name.", tuple(_families(store.registry, [store]))),
        Group("The vLLM connector", "On its store's registry, beside the store's.",
              tuple(_families(owner.metrics.registry, [connector]))),
        Group("The router", "Served by `kvtier router` at `/metrics` (on `admin_listen` when the config gives one).",
              tuple(_families(router.registry, [router]))),
    ]


def render() -> str:
    parts = []
    for group in groups():
        rows = [[md.code(m.name), m.type, ", ".join(md.code(label) for label in m.labels), md.text(m.help)]
                for m in group.metrics]
        parts.append(f"## {group.title}\n\n{md.text(group.intro)}\n\n"
                     + md.table(["Metric", "Type", "Labels", "Description"], rows))
    intro = """
Every metric kvtier exports, with its type, labels and help text. Series of fixed label sets (each tier's, each
hook's, each reason's) exist at 0 from the start; levels (used bytes, queue depth) are read at each scrape. Served
over HTTP, every sample of a process that runs the vLLM connector also carries `role` (`scheduler`, `worker`, or
`engine` for both roles in one process) and, for tensor-parallel workers, `tp_rank`. A histogram is exposed as its
`_bucket`, `_sum` and `_count` series.
"""
    return md.page("Metrics reference", intro, parts)
