"""deploy/helm/kvtier: the chart renders with Helm's own engine (helm-python-sdk, Helm 4's Go SDK: no binary, no
cluster) for its default values and each overlay in its ci/, and what it makes passes the checks the Kustomize
overlays pass (test_kubernetes.py, run here on the chart's objects): every object validates offline against
Kubernetes 1.33 (the Prometheus Operator's and KEDA's against the small schemas in conftest.py), the engines'
ports, event endpoints and topics, block size, hash settings, the kvtier config they mount (loaded by kvtier's
loader), scrape targets, resources, probes and budgets agree.

Then what only the chart has: the router's config (loaded by kvtier.router.config) finds each pool through its
Service, with the pool's role and the Service's port names or numbers; the router may watch EndpointSlices (its
ServiceAccount, Role and RoleBinding); only the routers reach the engines' event ports; the dashboards and rules
are deploy/grafana's and deploy/prometheus's own; each pool's ScaledObject scales that pool on metrics the router
exports; and values.schema.json, or the templates' own checks, refuse bad values naming them.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvtier.router.config import RouterConfig
from kvtier.router.metrics import RouterMetrics
from tests.deploy import test_kubernetes as kustomize
from tests.deploy.conftest import DEPLOY, LAST_APPLIED_LIMIT, Rendered, flag, kvtier_config, router_config

helm = pytest.importorskip("helm_python", reason="pip install 'kvtier[test]' (helm-python-sdk)")

CHART = DEPLOY / "helm" / "kvtier"
VALUES = ("default", *sorted(p.stem for p in (CHART / "ci").glob("*.yaml")))
RELEASE, NAMESPACE = "kvtier", "kvtier-test"


def install(values: dict[str, Any]) -> str:
    """The manifest ``helm install --dry-run=client`` makes of ``values`` (over the chart's values.yaml)."""
    with helm.Config(storage_driver="memory", namespace=NAMESPACE) as config:
        release = config.install(str(CHART), RELEASE, values, dry_run="client")
    return str(release["manifest"])


def values_of(name: str) -> dict[str, Any]:
    """The values an overlay gives (Helm merges them over values.yaml itself); none for the defaults."""
    return {} if name == "default" else dict(helm.values_from_yaml((CHART / "ci" / f"{name}.yaml").read_text()))


class Chart(Rendered):
    """The objects the chart makes of one set of values, asked what test_kubernetes.py asks of an overlay."""

    def __init__(self, name: str, values: dict[str, Any]) -> None:
        self.overlay, self.values = f"helm {name}", values
        self.objects = tuple(o for o in yaml.safe_load_all(install(values)) if o)

    def setting(self, *path: str) -> Any:
        """A value as the templates see it: the one given, else values.yaml's."""
        given: Any = self.values
        for key in path:
            given = given.get(key) if isinstance(given, dict) else None
        if given is not None:
            return given
        default = yaml.safe_load((CHART / "values.yaml").read_text())
        for key in path:
            default = default[key]
        return default


@pytest.fixture(scope="module", params=VALUES)
def chart(request: pytest.FixtureRequest) -> Chart:
    return Chart(request.param, values_of(request.param))


# -- the checks the Kustomize overlays pass ------------------------------------------------------------------------

def test_objects_validate_against_their_schemas(chart: Chart) -> None:
    kustomize.test_objects_validate_against_their_schemas(chart)


def test_router_config_matches_the_engines(chart: Chart) -> None:
    """block_size and tokenizer as the engines', the model from the same volume, the listen port the container's."""
    kustomize.test_router_config_matches_the_engines(chart)


def test_engines_hash_blocks_alike(chart: Chart) -> None:
    kustomize.test_engines_hash_blocks_alike(chart)


def test_kvtier_config_loads_where_vllm_reads_it(chart: Chart, tmp_path: Path) -> None:
    kustomize.test_kvtier_config_loads_where_vllm_reads_it(chart, tmp_path)


def test_prefill_and_decode_pools_share_a_tier(chart: Chart, tmp_path: Path) -> None:
    kustomize.test_prefill_and_decode_pools_share_a_tier(chart, tmp_path)


def test_prometheus_scrapes_every_metrics_port(chart: Chart, tmp_path: Path) -> None:
    kustomize.test_prometheus_scrapes_every_metrics_port(chart, tmp_path)


def test_workloads_have_resources_probes_and_budgets(chart: Chart) -> None:
    kustomize.test_workloads_have_resources_probes_and_budgets(chart)


def test_references_resolve(chart: Chart) -> None:
    kustomize.test_references_resolve(chart)


# -- what only the chart has ---------------------------------------------------------------------------------------

def _discovered(chart: Chart) -> RouterConfig:
    config = router_config(chart)
    assert not config.engines, f"{chart.overlay}: the router lists engines; the chart's are found by discovery"
    return config


def test_the_router_finds_every_pool_through_its_service(chart: Chart) -> None:
    """Each pool is one discovery source: its headless Service (which selects its pods only), its pool's role, and
    the ports its engines bind (their arguments, their container ports), by the Service's port names
    (EndpointSlices carry those) or, for DNS, by number."""
    sources = {d.service or (d.name or "").split(".")[0]: d for d in _discovered(chart).discovery}
    pools = []
    for workload, engine in chart.engines():
        wanted = kustomize._pool_ports(chart, workload, engine)  # also: vLLM binds them, the topic names the pod
        service = chart.named("Service", workload["spec"]["serviceName"])
        name, where = service["metadata"]["name"], f"{chart.overlay}: Service {service['metadata']['name']}"
        pools.append(name)
        assert service["spec"].get("clusterIP") == "None", f"{where} is not headless: DNS names no pods"
        selects = [w["metadata"]["name"] for w in chart.selected(service["spec"]["selector"])]
        assert selects == [workload["metadata"]["name"]], f"{where} selects the pods of {selects}"
        assert name in sources, f"{chart.overlay}: no discovery source finds pool {name} ({sorted(sources)})"
        source, ports = sources[name], chart.service_ports(service)
        assert source.role == chart.role(workload), \
            f"{chart.overlay}: discovery gives {name}'s engines role {source.role}, its pods are {chart.role(workload)}"
        found = {"http": source.port, "kv-events": source.kv_events_port, "kv-replay": source.kv_events_replay_port}
        if source.source == "kubernetes":
            assert source.namespace in (None, NAMESPACE), f"{chart.overlay}: discovery watches {source.namespace}"
            for key, port_name in found.items():
                assert isinstance(port_name, str) and ports.get(port_name) == (wanted[key], wanted[key]), \
                    f"{where}: discovery's {key} port is {port_name!r}, the Service's ports are {ports}, the " \
                    f"engines bind {wanted}"
        else:
            assert source.name == f"{name}.{NAMESPACE}.svc.cluster.local", f"{chart.overlay}: DNS name {source.name}"
            assert found == wanted, f"{where}: discovery's ports {found}, the engines bind {wanted}"
            assert all(ports[k] == (v, v) for k, v in wanted.items()), f"{where}: ports {ports}, engines {wanted}"
    assert sorted(sources) == sorted(pools), f"{chart.overlay}: discovery finds {sorted(sources)}, pools {pools}"


def test_the_router_may_watch_endpointslices(chart: Chart) -> None:
    """Discovery through the Kubernetes API: the router's pods run as a ServiceAccount bound to a Role that may
    get, list and watch EndpointSlices; by DNS, they hold no token."""
    workload, _ = chart.router()
    spec = workload["spec"]["template"]["spec"]
    account = chart.named("ServiceAccount", spec["serviceAccountName"])["metadata"]["name"]
    watching = any(d.source == "kubernetes" for d in _discovered(chart).discovery)
    assert spec.get("automountServiceAccountToken") is watching, \
        f"{chart.overlay}: the router's pods mount a token: {spec.get('automountServiceAccountToken')}, " \
        f"discovery through the API: {watching}"
    granted = set()
    for binding in chart.of_kind("RoleBinding"):
        if {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in binding["subjects"]:
            assert binding["roleRef"]["kind"] == "Role", f"{chart.overlay}: {binding['roleRef']}"
            for rule in chart.named("Role", binding["roleRef"]["name"])["rules"]:
                if "discovery.k8s.io" in rule["apiGroups"] and "endpointslices" in rule["resources"]:
                    granted |= set(rule["verbs"])
    assert granted == ({"get", "list", "watch"} if watching else set()), \
        f"{chart.overlay}: the router's ServiceAccount {account} may {sorted(granted)} EndpointSlices"
    for workload, _ in chart.engines():
        assert workload["spec"]["template"]["spec"].get("automountServiceAccountToken") is False, \
            f"{chart.overlay}: {workload['metadata']['name']}'s engines mount an API token they never use"


def test_only_the_routers_reach_the_engines_events(chart: Chart) -> None:
    router, _ = chart.router()
    stranger = {"spec": {"template": {"metadata": {"labels": {"app.kubernetes.io/name": "other"}}}}}
    for workload, _ in chart.engines():
        where = f"{chart.overlay}: {workload['metadata']['name']}"
        for port in ("kv-events", "kv-replay", "http"):
            assert kustomize._admitted(chart, router, workload, port), f"{where}: the router may not reach {port}"
        for port in ("kv-events", "kv-replay"):
            assert not kustomize._admitted(chart, stranger, workload, port), f"{where}: any pod may reach {port}"


def test_tier_secrets_are_files_of_a_secret(chart: Chart, tmp_path: Path) -> None:
    """A tier's ``*_file`` option names a file every engine reads from a mounted Secret, holding what the values
    gave."""
    config, given = kvtier_config(chart, tmp_path), chart.setting("kvtier", "secrets")
    files = [str(v) for t in config.tiers for k, v in t.options.items() if k.endswith("_file")]
    if not files:
        pytest.skip(f"{chart.overlay}: no tier reads a secret file")
    for workload, engine in chart.engines():
        for path in files:
            where = f"{chart.overlay}: {workload['metadata']['name']}: {path}"
            assert chart.file_source(workload, engine, path) == "secret", f"{where} is not on a Secret's volume"
            assert chart.file(workload, engine, path) == given[Path(path).name], f"{where} is not the value given"


def test_dashboards_and_rules_are_deploys_own(chart: Chart) -> None:
    """The chart links (files/) to deploy/grafana and deploy/prometheus, and ships their files unchanged."""
    assert (CHART / "files" / "grafana").resolve() == (DEPLOY / "grafana").resolve()
    assert (CHART / "files" / "kvtier-alerts.yaml").resolve() == (DEPLOY / "prometheus" / "kvtier-alerts.yaml")
    (dashboards,) = [c for c in chart.of_kind("ConfigMap") if c["metadata"].get("labels", {}).get("grafana_dashboard")]
    files = {p.name: p.read_text() for p in sorted((DEPLOY / "grafana").glob("*.json"))}
    assert dashboards["data"] == files, f"{chart.overlay}: the dashboards ConfigMap is not deploy/grafana/*.json"
    size = len(json.dumps(dashboards))
    assert size < LAST_APPLIED_LIMIT, f"{chart.overlay}: the dashboards ConfigMap is {size} bytes"
    (rule,) = chart.of_kind("PrometheusRule")
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "kvtier-alerts.yaml").read_text())
    assert rule["spec"] == alerts, f"{chart.overlay}: the PrometheusRule is not deploy/prometheus/kvtier-alerts.yaml"


def _router_series() -> set[str]:
    """The series names the router exposes (a counter ``x`` as ``x_total``), labelled families included."""
    registry: CollectorRegistry = RouterMetrics().registry
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {f.name + s for f in registry.collect() for s in suffixes.get(f.type, ("",))}


def test_each_pool_scales_on_the_routers_metrics(chart: Chart) -> None:
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in chart.of_kind("ScaledObject")}
    pools = {w["metadata"]["name"]: w for w, _ in chart.engines()}
    if not chart.setting("autoscaling", "enabled"):
        assert not scaled, f"{chart.overlay}: ScaledObjects {sorted(scaled)} with autoscaling off"
        pytest.skip(f"{chart.overlay}: autoscaling is off")
    assert sorted(scaled) == sorted(pools), f"{chart.overlay}: ScaledObjects scale {sorted(scaled)}, pools {pools}"
    series, address = _router_series(), chart.setting("autoscaling", "prometheusAddress")
    for name, scaler in scaled.items():
        spec, where = scaler["spec"], f"{chart.overlay}: ScaledObject {scaler['metadata']['name']}"
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name}, where
        assert "replicas" not in pools[name]["spec"], f"{where}: the StatefulSet sets replicas, which KEDA owns"
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], where
        others = [f"{p}-0" for p in pools if p != name]
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus" and trigger["metadata"]["serverAddress"] == address, where
            query = trigger["metadata"]["query"]
            named = set(re.findall(r"\bkvtier_\w+", query))
            assert named and named <= series, f"{where}: {query} reads {sorted(named - series)}, which the " \
                                              "router does not export"
            # The pool's own engines (the router names an engine after its pod, or by DNS after the Service and
            # the address), no other pool's.
            matchers = set(re.findall(r'engine=~"([^"]+)"', query))
            assert len(matchers) == 1, f"{where}: {query} does not pick the pool's engines"
            (matcher,) = matchers
            mine = (f"{name}-0", f"{name}-12", f"{name}-10-0-0-5", f"{name}-fd00--1")
            assert all(re.fullmatch(matcher, engine) for engine in mine), f"{where}: {matcher} misses one of {mine}"
            assert not any(re.fullmatch(matcher, pod) for pod in others), f"{where}: {matcher} matches {others}"


def test_the_chart_lints_clean() -> None:
    for name in VALUES:
        report = helm.lint(str(CHART), values_of(name) or None, strict=True, kube_version="v1.33.0",
                           namespace=NAMESPACE)
        found = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not found, f"helm {name}: helm lint: {found}"


@pytest.mark.parametrize(("values", "named"), [
    ({"router": {"replicas": 0}}, "/router/replicas"),
    ({"engine": {"blockSize": "x"}}, "/engine/blockSize"),
    ({"replicas": 3}, "additional properties 'replicas'"),
    ({"pools": [{"name": "engine", "role": "middle", "replicas": 1}]}, "/pools/0/role"),
    ({"pools": [{"name": "Engine", "role": "both", "replicas": 1}]}, "/pools/0/name"),
    ({"router": {"discovery": {"source": "consul"}}}, "/router/discovery/source"),
    ({"router": {"config": {"block_size": 16}}}, "/router/config/block_size"),
    ({"autoscaling": {"ttftMissedShare": 2}}, "/autoscaling/ttftMissedShare"),
    ({"engine": {"resources": {"request": {"cpu": "1"}}}}, "/engine/resources"),
    ({"kvtier": {"config": {"chunk_tokens": 100}}}, "kvtier.config.chunk_tokens (100) must be a multiple of "
                                                    "engine.blockSize (128)"),
    ({"model": {"path": "/elsewhere/llm"}}, "model.path (/elsewhere/llm) must lie under model.mountPath"),
    ({"autoscaling": {"enabled": True}, "pools": [{"name": "engine", "role": "both", "replicas": 1,
                                                   "minReplicas": 3, "maxReplicas": 2}]},
     "pools[engine]: maxReplicas (2) is below minReplicas (3)"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_values_are_refused_naming_them(values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm.HelmError) as refused:
        install(values)
    assert named in str(refused.value), str(refused.value)


def test_the_engines_run_what_the_values_say() -> None:
    """A value reaches every place that must agree: the block size in the engines' arguments and the router's
    config, the ports in arguments, containers, Services and discovery (the checks above), the secrets' file."""
    values = {"engine": {"blockSize": 64, "port": 9000, "kvEventsPort": 6000, "kvReplayPort": 6001},
              "kvtier": {"config": {"chunk_tokens": 512}, "secrets": {"token": "s3cret"}},
              "router": {"replicas": 3, "port": 8088, "config": {"policy": "round_robin"}}}
    chart = Chart("custom", values)
    test_the_router_finds_every_pool_through_its_service(chart)
    kustomize.test_router_config_matches_the_engines(chart)
    (workload, engine), config = chart.engines()[0], router_config(chart)
    assert flag(engine["args"], "--block-size") == "64" and config.block_size == 64
    assert (config.port, config.policy, chart.router()[0]["spec"]["replicas"]) == (8088, "round_robin", 3)
    secret = chart.named("Secret", f"{RELEASE}-secrets")
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret"
    assert chart.file(workload, engine, "/etc/kvtier-secrets/token") == "s3cret"
