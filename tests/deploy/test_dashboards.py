"""deploy/grafana/*.json: Grafana dashboards that parse, choose their Prometheus through the ``datasource``
variable, and query only metric names that kvtier's registries and vLLM's source define.

kvtier's names come from the metric classes themselves (a store with a secondary tier, the vLLM connector's
metrics on it, the router's); vLLM's from the metric definitions in its ``v1/metrics`` source, with the
suffixes prometheus_client adds when it exposes them (a counter ``x`` as ``x_total``, a histogram as
``x_bucket``, ``x_sum``, ``x_count``). A renamed metric then fails here, not on a blank panel.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvtier import KVStore
from kvtier.integrations.vllm._shared import ConnectorMetrics
from kvtier.metrics import StoreMetrics
from kvtier.router.metrics import RouterMetrics

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DASHBOARDS = ("kvtier-tiers", "kvtier-connector", "kvtier-router", "vllm-engines")
DATASOURCE = "${datasource}"
NAME = re.compile(r"\b(?:kvtier_\w+|vllm:\w+)")
# What prometheus_client appends to a family's name when it exposes its samples.
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}


def _load(name: str) -> dict[str, Any]:
    return json.loads((GRAFANA / f"{name}.json").read_text())


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, query) of every panel target and query variable."""
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['id']} {target.get('refId', '')}", target.get("expr", "")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query


def _exprs(dashboard: dict[str, Any]) -> Iterator[str]:
    return (expr for _, expr in _queries(dashboard))


def _is_datasource_variable(ds: object) -> bool:
    return ds == DATASOURCE or (isinstance(ds, dict) and ds.get("uid") == DATASOURCE)


def _exposed(registry: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


@pytest.fixture(scope="module")
def kvtier_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    # A store with a secondary tier registers the per-tier families (tier events among them); the connector
    # registers its counters on that store's registry, as in an engine.
    path = tmp_path_factory.mktemp("fs")
    store = KVStore.from_config({"chunk_tokens": 16, "dram": {"capacity_bytes": "4MiB", "page_bytes": "16KiB"},
                                 "tiers": [{"type": "filesystem", "path": str(path)}]})
    try:
        ConnectorMetrics(store)
        names = _exposed(store.metrics.registry)
    finally:
        store.close()
    return names | _exposed(StoreMetrics().registry) | _exposed(RouterMetrics().registry)


@pytest.fixture(scope="module")
def vllm_names() -> set[str]:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed: its metric names cannot be checked")
    names: set[str] = set()
    for source in (Path(spec.submodule_search_locations[0]) / "v1" / "metrics").glob("*.py"):
        text = source.read_text()
        # self._counter_cls(name="vllm:...") and the like: the kind says which suffixes the samples get
        typed = {name: kind.lower() for kind, name in
                 re.findall(r"(counter|gauge|histogram)(?:_cls)?\(\s*name=\"(vllm:\w+)\"", text, re.I)}
        for name in re.findall(r"\"(vllm:\w+)\"", text):
            kind = typed.get(name)
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base + suffix for suffix in SUFFIXES[kind]} if kind else {name}
    assert "vllm:num_requests_running" in names, "no vLLM metric definitions found: has the source moved?"
    return names


@pytest.mark.parametrize("name", DASHBOARDS)
def test_dashboard_shape(name: str) -> None:
    dashboard = _load(name)
    assert dashboard["uid"] == name
    assert dashboard["schemaVersion"] == 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert _is_datasource_variable(variable["datasource"]), variable["name"]
    panels = list(_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert any(panel["type"] == "row" for panel in panels)
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert _is_datasource_variable(panel.get("datasource")), panel["title"]
        targets = panel.get("targets", [])
        assert any(target.get("expr", "").strip() for target in targets), f"{panel['title']}: no query"
        for target in targets:
            assert _is_datasource_variable(target.get("datasource", DATASOURCE)), panel["title"]


@pytest.mark.parametrize("name", DASHBOARDS)
def test_metric_names_exist(name: str, kvtier_names: set[str], vllm_names: set[str]) -> None:
    known = kvtier_names | vllm_names
    unknown = sorted({metric for expr in _exprs(_load(name)) for metric in NAME.findall(expr)} - known)
    assert not unknown, f"{name} queries metrics no registry or vLLM source defines: {unknown}"


@pytest.mark.parametrize("name", DASHBOARDS)
def test_rates_are_over_counters(name: str) -> None:
    """rate() and increase() only over counters and histogram buckets; a gauge's rate means nothing."""
    for expr in _exprs(_load(name)):
        for function, metric in re.findall(r"\b(rate|increase)\(\s*([\w:]+)", expr):
            assert metric.endswith(("_total", "_bucket")), f"{function}({metric}) in {name}"


def test_queries_parse(tmp_path: Path) -> None:
    """Every query, its variables filled in, is PromQL that promtool accepts (as a recording rule's expression)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (Debian package `prometheus`): the queries are not parsed")
    rules = []
    for name in DASHBOARDS:
        for where, expr in _queries(_load(name)):
            if expr.startswith("label_values("):
                continue  # Grafana's own function, not PromQL
            expr = expr.replace("$__rate_interval", "5m")
            # the rule's name says where the query is, for promtool's error message
            rules.append({"record": re.sub(r"\W", "_", f"{name}: {where}"),
                          "expr": re.sub(r"\$\{?\w+\}?", ".*", expr)})
    rules_file = tmp_path / "dashboard-queries.rules.json"  # promtool reads YAML, of which JSON is a subset
    rules_file.write_text(json.dumps({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
