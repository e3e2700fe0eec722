"""deploy/helm/kvtier: the chart renders with Helm's own engine (helm-python-sdk, Helm 4's Go SDK: no binary, no
cluster) for its default values and each overlay in its ci/, and what it makes passes the checks the Kustomize
overlays pass (test_kubernetes.py, run here on the chart's objects): every object validates offline against
Kubernetes 1.33 (the Prometheus Operator's and KEDA's against the small schemas in conftest.py), the engines'
ports, event endpoints and topics, block size, hash settings, the kvtier config they mount (loaded by kvtier's
loader), scrape targets, resources, probes and budgets agree.

Then what only the chart has: the router's config (loaded by kvtier.router.config) finds each pool through its
Service (ready pods only), with the pool's role and the Service's port names or numbers; the router may watch
EndpointSlices (its ServiceAccount, Role and RoleBinding); only the routers reach the engines' event ports, and
networkPolicy.apiFrom's peers their API; the dashboards and rules are deploy/grafana's and deploy/prometheus's own,
and a copy of the chart without them is refused; each pool's ScaledObject scales that pool on metrics this
release's routers export for its engines only (the router's own names for them, matched as PromQL matches); and
values.schema.json, or the templates' own checks, refuse bad values naming them.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvtier.router.config import RouterConfig
from kvtier.router.sources import engine_name
from kvtier.router.metrics import RouterMetrics
from tests.deploy import test_kubernetes as kustomize
from tests.deploy.conftest import DEPLOY, LAST_APPLIED_LIMIT, Rendered, flag, kvtier_config, router_config

helm = pytest.importorskip("helm_python", reason="pip install 'kvtier[test]' (helm-python-sdk)")

CHART = DEPLOY / "helm" / "kvtier"
VALUES = ("default", *sorted(p.stem for p in (CHART / "ci").glob("*.yaml")))
RELEASE, NAMESPACE = "kvtier", "kvtier-test"


def install(values: dict[str, Any], chart: Path = CHART) -> str:
    """The manifest ``helm install --dry-run=client`` makes of ``values`` (over the chart's values.yaml)."""
    with helm.Config(storage_driver="memory", namespace=NAMESPACE) as config:
        release = config.install(str(chart), RELEASE, values, dry_run="client")
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
        # (else the EndpointSlices mark every pod ready, a terminating one too, and DNS names pods not ready)
        assert not service["spec"].get("publishNotReadyAddresses"), f"{where} publishes pods that are not ready"
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


_ADDRESSES = ("10.0.0.5", "255.255.255.255", "fd00::1", "::1", "fd00::", "::ffff:10.0.0.5", "2001:db8:1:2:3:4:5:6",
              "fd00:1234:5678:9abc:def0:1234:5678:9abc")


def _engine_names(service: str, source: str) -> set[str]:
    """Names the router gives the engines of the pool behind ``service``: its pods' through the Kubernetes API (a
    StatefulSet's, SERVICE-ORDINAL), else ``engine_name`` of the Service's name and each address as DNS gives it."""
    if source == "kubernetes":
        return {f"{service}-{ordinal}" for ordinal in (0, 1, 9, 10, 12, 100)}
    return {engine_name(service, str(ipaddress.ip_address(a))) for a in _ADDRESSES}


def _selectors(query: str) -> list[dict[str, tuple[str, str]]]:
    """Each series selector of a PromQL ``query``: label -> (operator, value)."""
    return [{label: (op, value) for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', body)}
            for body in re.findall(r'\b\w+\{((?:[^"}]|"[^"]*")*)\}', query)]


def test_each_pool_scales_on_the_routers_metrics(chart: Chart) -> None:
    """Each pool's ScaledObject scales its StatefulSet on the series of this release's routers (the namespace, job
    and Service Prometheus gives the targets of the routers' ServiceMonitor) for that pool's engines only: its
    ``engine`` regex, anchored as PromQL anchors it, takes every name the router may give the pool's engines
    and none another pool's."""
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in chart.of_kind("ScaledObject")}
    pools = {w["metadata"]["name"]: w for w, _ in chart.engines()}
    if not chart.setting("autoscaling", "enabled"):
        assert not scaled, f"{chart.overlay}: ScaledObjects {sorted(scaled)} with autoscaling off"
        pytest.skip(f"{chart.overlay}: autoscaling is off")
    assert sorted(scaled) == sorted(pools), f"{chart.overlay}: ScaledObjects scale {sorted(scaled)}, pools {pools}"
    router, _ = chart.router()
    (service,) = [s for s in chart.of_kind("Service") if router in chart.selected(s["spec"]["selector"])]
    (monitor,) = [m for m in chart.of_kind("ServiceMonitor")
                  if m["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()]
    (endpoint,) = monitor["spec"]["endpoints"]
    job = {r["targetLabel"]: r for r in endpoint["relabelings"]}["job"]["replacement"]
    targets = {"namespace": ("=", NAMESPACE), "job": ("=", job), "service": ("=", service["metadata"]["name"])}
    source = chart.setting("router", "discovery", "source")
    names = {pool: _engine_names(pool, source) for pool in pools}
    series, address = _router_series(), chart.setting("autoscaling", "prometheusAddress")
    for name, scaler in scaled.items():
        spec, where = scaler["spec"], f"{chart.overlay}: ScaledObject {scaler['metadata']['name']}"
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name}, where
        assert "replicas" not in pools[name]["spec"], f"{where}: the StatefulSet sets replicas, which KEDA owns"
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], where
        others = set().union(*(names[p] for p in pools if p != name))
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus" and trigger["metadata"]["serverAddress"] == address, where
            query = trigger["metadata"]["query"]
            named = set(re.findall(r"\bkvtier_\w+", query))
            assert named and named <= series, f"{where}: {query} reads {sorted(named - series)}, which the " \
                                              "router does not export"
            selectors = _selectors(query)
            assert selectors, f"{where}: {query} selects no series"
            for selector in selectors:
                assert selector.items() >= targets.items(), \
                    f"{where}: {query} selects {selector}, not only the series of the routers' targets {targets}"
                operator, matcher = selector.get("engine", ("", ""))
                assert operator == "=~", f"{where}: {query} does not pick the pool's engines"
                missed = sorted(e for e in names[name] if not re.fullmatch(matcher, e))
                assert not missed, f"{where}: {matcher} misses the pool's engines {missed}"
                taken = sorted(e for e in others if re.fullmatch(matcher, e))
                assert not taken, f"{where}: {matcher} takes other pools' engines {taken}"


@pytest.mark.parametrize(("source", "names"), [
    ("kubernetes", ["p", "p-b", "p-1", "p-1-0", "p-10"]),
    ("dns", ["p", "p-x", "q", "q-x-1"]),
])
def test_pools_whose_names_share_a_prefix_scale_apart(source: str, names: list[str]) -> None:
    """Pool ``p``'s queries take none of pool ``p-b``'s engines (b is a hex digit, 1 an ordinal)."""
    values = {"pools": [{"name": n, "role": "both", "replicas": 1} for n in names],
              "router": {"discovery": {"source": source}}, "autoscaling": {"enabled": True}}
    chart = Chart(f"pools {source}", values)
    kustomize.test_objects_validate_against_their_schemas(chart)
    test_each_pool_scales_on_the_routers_metrics(chart)


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
    ({"fullnameOverride": "r" * 36, "pools": [{"name": "engine-prefill-1", "role": "both", "replicas": 1}]},
     f"pools[engine-prefill-1]: the pool's StatefulSet {'r' * 36}-engine-prefill-1 is 53 characters, over "
     "Kubernetes' 52"),
    ({"pools": [{"name": "engine", "role": "both", "replicas": 1}, {"name": "engine", "role": "both", "replicas": 1}]},
     "pools: the name engine is given to two pools"),
    ({"pools": [{"name": "a", "role": "prefill", "replicas": 1}, {"name": "b", "role": "prefill", "replicas": 1}]},
     "pools: every pool has role prefill"),
    ({"engine": {"kvEventsPort": 8000}}, "engine.port and engine.kvEventsPort are both 8000"),
    ({"engine": {"kvReplayPort": 5557}}, "engine.kvEventsPort and engine.kvReplayPort are both 5557"),
    ({"engine": {"port": 9401}}, "engine.port and kvtier.config.metrics_port + 1 are both 9401"),
    ({"router": {"config": {"admin_listen": "0.0.0.0:9090"}}},
     "router.config.admin_listen (0.0.0.0:9090): the chart does not support a second listener"),
    ({"autoscaling": {"enabled": True}, "monitoring": {"serviceMonitors": {"enabled": False}}},
     "autoscaling.enabled needs monitoring.serviceMonitors.enabled"),
    ({"autoscaling": {"enabled": True}, "router": {"discovery": {"source": "dns"}},
      "pools": [{"name": "p", "role": "both", "replicas": 1}, {"name": "p-b", "role": "both", "replicas": 1}]},
     "pools[p-b]: with autoscaling and router.discovery.source dns, its engines' names (kvtier-p-b-ADDRESS) can be "
     "pool p's"),
    ({"autoscaling": {"enabled": True}, "router": {"discovery": {"source": "dns"}}, "fullnameOverride": "r" * 18},
     f"pools[engine]: with autoscaling and router.discovery.source dns, the Service {'r' * 18}-engine must be at "
     "most 24 characters (it is 25)"),
    ({"networkPolicy": {"apiFrom": [{"podSelectors": {}}]}}, "/networkPolicy/apiFrom/0"),
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


def test_the_longest_names_render() -> None:
    """A pool's StatefulSet of 52 characters is the longest that gets pods; the chart makes it."""
    chart = Chart("long", {"fullnameOverride": "r" * 35,
                           "pools": [{"name": "engine-prefill-1", "role": "both", "replicas": 1}]})
    assert [len(w["metadata"]["name"]) for w, _ in chart.engines()] == [52]


def test_dashboards_and_rules_are_refused_when_their_files_are_not_there(tmp_path: Path) -> None:
    """A copy of the chart whose files/ lost its links (no deploy/ beside it, or a tool that drops links), or holds
    empty files, is refused naming the file, not rendered with an empty PrometheusRule or no dashboards."""
    copy = tmp_path / "kvtier"
    shutil.copytree(CHART, copy, symlinks=True)
    for link in (copy / "files").iterdir():
        assert link.is_symlink(), f"{link} is not a link to deploy/"
        link.unlink()
    rules_off = {"monitoring": {"prometheusRule": {"enabled": False}}}
    for values, named in (({}, "files/kvtier-alerts.yaml"), (rules_off, "files/grafana/*.json")):
        with pytest.raises(helm.HelmError) as refused:
            install(values, copy)
        assert f"{named} is missing or empty: the chart's files/ links to deploy/grafana and deploy/prometheus" \
            in str(refused.value), str(refused.value)
    install({"monitoring": {"prometheusRule": {"enabled": False}, "dashboards": {"enabled": False}}}, copy)
    (copy / "files" / "grafana").mkdir()
    (copy / "files" / "grafana" / "kvtier.json").write_text("\n")
    (copy / "files" / "kvtier-alerts.yaml").write_text((DEPLOY / "prometheus" / "kvtier-alerts.yaml").read_text())
    with pytest.raises(helm.HelmError, match=re.escape("files/grafana/kvtier.json is missing or empty")):
        install({}, copy)


def test_the_engines_api_admits_the_routers_and_api_from() -> None:
    """networkPolicy.apiFrom: the routers and its peers reach the engines' API port, other pods do not; kvtier's
    metrics ports stay open (Prometheus). Without it, as by default, any pod reaches the API."""
    gateway = {"spec": {"template": {"metadata": {"labels": {"app": "gateway"}}}}}
    stranger = {"spec": {"template": {"metadata": {"labels": {"app.kubernetes.io/name": "other"}}}}}
    peer = {"podSelector": {"matchLabels": {"app": "gateway"}}}
    restricted = Chart("api-from", {"networkPolicy": {"apiFrom": [peer]}})
    kustomize.test_objects_validate_against_their_schemas(restricted)
    test_only_the_routers_reach_the_engines_events(restricted)
    router, _ = restricted.router()
    for workload, _ in restricted.engines():
        where = f"{restricted.overlay}: {workload['metadata']['name']}"
        assert kustomize._admitted(restricted, gateway, workload, "http"), f"{where}: apiFrom's peer may not reach http"
        assert kustomize._admitted(restricted, router, workload, "http"), f"{where}: the router may not reach http"
        assert not kustomize._admitted(restricted, stranger, workload, "http"), f"{where}: any pod may reach http"
        assert kustomize._admitted(restricted, stranger, workload, "kvtier-metrics"), \
            f"{where}: Prometheus may not reach kvtier's metrics"
    open_ = Chart("default", {})
    for workload, _ in open_.engines():
        assert kustomize._admitted(open_, stranger, workload, "http"), \
            f"{open_.overlay}: {workload['metadata']['name']}: the API is closed without apiFrom"
