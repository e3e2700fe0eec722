"""Start a fleet on one host (Redis, vLLM API servers with kvtier, the router, Prometheus), show its status, and
stop everything it started by PID: on Ctrl-C / SIGTERM, or from another shell with ``kvtier fleet down``.

The processes and their start times are recorded in ``<work_dir>/fleet.json``, so ``down`` signals only the
processes this fleet started, never a later process that reused a PID.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import TextIO

import yaml

from kvtier.errors import ConfigError
from kvtier.fleet.config import FleetConfig, check_work_dir
from kvtier.fleet.process import Process, start_time, stop_all, stop_recorded
from kvtier.metrics import sample_sum

STATE = "fleet.json"


def vllm_command(model: Path, served_name: str, *, host: str, port: int, block_size: int, max_model_len: int,
                 events: str, replay: str, topic: str, kv_transfer: dict | None,
                 extra: tuple[str, ...] | list[str] = (), otlp_traces_endpoint: str | None = None) -> list[str]:
    """The command line of one vLLM OpenAI API server publishing KV events (and with kvtier, if ``kv_transfer``)."""
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                     "replay_endpoint": replay, "topic": topic}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", served_name, "--host", host, "--port", str(port),
            "--block-size", str(block_size), "--max-model-len", str(max_model_len),
            "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events_config)]
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer)]
    if otlp_traces_endpoint is not None:
        argv += ["--otlp-traces-endpoint", otlp_traces_endpoint]
    return argv + list(extra)


def kvtier_transfer(store: dict | str) -> dict:
    """vLLM's ``--kv-transfer-config`` for kvtier with the store config ``store`` (a mapping or a file path)."""
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"config": store}}


def engine_env(cpus: str, extra: dict[str, str] | None = None, traces: bool = False) -> dict[str, str]:
    """An engine's environment: its cores, a fixed hash seed (the router hashes blocks as vLLM does), and OTLP
    over HTTP when traced (vLLM's default is gRPC)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(VLLM_CPU_OMP_THREADS_BIND=cpus, PYTHONHASHSEED="0")
    if traces:
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    env.update(extra or {})
    return env


class Fleet:
    """The processes of one fleet config, in start order."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        c = config
        work = c.work_dir
        # Only the router, the engines' APIs and Prometheus listen on ``host``; Redis, the KV events and kvtier's
        # metrics stay on loopback (everything that uses them runs on this host).
        local = "127.0.0.1"
        reach = self.reach = c.reach
        self.processes: list[Process] = []
        if c.redis is not None:
            argv = ["redis-server", "--port", str(c.ports.redis), "--bind", local, "--save", "", "--appendonly",
                    "no", "--dir", str(work), "--maxmemory", str(c.redis.maxmemory_bytes),
                    "--maxmemory-policy", "allkeys-lru"]
            self.processes.append(Process("redis", argv, work / "redis.log", dict(os.environ),
                                          _redis_ping(local, c.ports.redis)))
        self.engines: list[Process] = []
        for i in range(c.engines):  # engines of every role run alike: only the router's config gives them roles
            name = c.engine_name(i)
            events, replay = c.events_ports(i)
            argv = vllm_command(c.model, c.served_model_name, host=c.host, port=c.engine_port(i),
                                block_size=c.block_size, max_model_len=c.max_model_len,
                                events=f"tcp://{local}:{events}", replay=f"tcp://{local}:{replay}",
                                topic=f"kv@{name}", kv_transfer=kvtier_transfer(str(self._store_file(i))),
                                extra=c.engine_args, otlp_traces_endpoint=c.otlp_traces_endpoint)
            engine = Process(name, argv, work / f"{name}.log",
                             engine_env(c.cpus[i], c.engine_env, bool(c.otlp_traces_endpoint)),
                             f"http://{reach}:{c.engine_port(i)}/health")
            self.engines.append(engine)
        self.processes += self.engines
        self.router_config = c.router_config()
        self.router = Process("router", [sys.executable, "-m", "kvtier.cli", "router", "--config",
                                         str(work / "router.yaml")], work / "router.log", dict(os.environ),
                              f"http://{reach}:{c.ports.router}/health")
        self.processes.append(self.router)
        if c.prometheus is not None:
            argv = ["prometheus", f"--config.file={work / 'prometheus.yml'}",
                    f"--storage.tsdb.path={work / 'prometheus-data'}",
                    f"--storage.tsdb.retention.time={c.prometheus.retention}",
                    f"--web.listen-address={c.host}:{c.ports.prometheus}"]
            self.processes.append(Process("prometheus", argv, work / "prometheus.log", dict(os.environ),
                                          f"http://{reach}:{c.ports.prometheus}/-/ready"))

    # -- configs -------------------------------------------------------------------------------------------------
    def _store_file(self, i: int) -> Path:
        return self.config.work_dir / f"kvtier-{self.config.engine_name(i)}.yaml"

    def write_configs(self) -> None:
        """The generated configs, readable by this user only: a store config may hold a tier's credentials (a
        file, not vLLM's command line, which any local user can read and vLLM logs)."""
        c = self.config
        c.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for i in range(c.engines):
            store = {**c.kvtier, "metrics_port": c.metrics_ports(i)[0]}
            if c.otlp_traces_endpoint:
                store["otlp_traces_endpoint"] = c.otlp_traces_endpoint
            write_private(self._store_file(i), yaml.safe_dump(store, sort_keys=False))
        write_private(c.work_dir / "router.yaml", yaml.safe_dump(self.router_config, sort_keys=False))
        if c.prometheus is not None:
            write_private(c.work_dir / "prometheus.yml", yaml.safe_dump(self.prometheus_config(), sort_keys=False))

    def prometheus_config(self) -> dict:
        """Scrape jobs the dashboards and alerts read: ``vllm`` (each engine's own metrics), ``kvtier`` (each
        engine's two kvtier processes) and ``kvtier-router``; engine-side targets carry ``server`` = the engine."""
        c = self.config
        assert c.prometheus is not None
        interval = f"{c.prometheus.scrape_interval_s:g}s"
        vllm = [{"targets": [f"{self.reach}:{c.engine_port(i)}"], "labels": {"server": c.engine_name(i)}}
                for i in range(c.engines)]
        kvtier = [{"targets": [f"127.0.0.1:{p}" for p in c.metrics_ports(i)], "labels": {"server": c.engine_name(i)}}
                  for i in range(c.engines)]
        config: dict = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": "vllm", "static_configs": vllm},
                {"job_name": "kvtier", "static_configs": kvtier},
                {"job_name": "kvtier-router", "static_configs": [{"targets": [f"{self.reach}:{c.ports.router}"]}]},
            ]}
        rules = alert_rules()
        if rules is not None:
            config["rule_files"] = [str(rules)]
        return config

    # -- running -------------------------------------------------------------------------------------------------
    def up(self, out: TextIO, interval_s: float, stop: threading.Event) -> int:
        """Start everything, wait for each health check, then print the status table every ``interval_s`` until
        ``stop`` is set; stop everything started, in reverse order. 0, or 1 if something failed to start."""
        self.write_configs()
        if self.config.prometheus is not None and alert_rules() is None:
            print("fleet: warning: kvtier's alert rules (deploy/prometheus/kvtier-alerts.yaml) are not in this "
                  "installation; Prometheus runs without them", file=out, flush=True)
        try:
            for group in self._groups():
                for proc in group:
                    proc.start()
                    print(f"fleet: started {proc.name} (pid {proc.pid}, log {proc.log})", file=out, flush=True)
                    self._record()
                for proc in group:
                    proc.wait_healthy(self.config.health_timeout_s, stop)
                    print(f"fleet: {proc.name} is healthy", file=out, flush=True)
            c = self.config
            print(f"fleet: ready. Router: http://{self.reach}:{c.ports.router}/v1"
                  + (f"; Prometheus: http://{self.reach}:{c.ports.prometheus}" if c.prometheus else ""),
                  file=out, flush=True)
            while not stop.wait(interval_s):
                print(self.status_table(), file=out, flush=True)
            return 0
        except RuntimeError as exc:
            print(f"fleet: {exc}", file=out, flush=True)
            return 130 if stop.is_set() else 1
        finally:
            print("fleet: stopping", file=out, flush=True)
            for group in reversed(self._groups()):  # each group at once: the router before the engines it uses
                stop_all(group)
            (self.config.work_dir / STATE).unlink(missing_ok=True)
            print("fleet: stopped", file=out, flush=True)

    def _groups(self) -> list[list[Process]]:
        """Start order: Redis before the engines (their tier), the engines together, the router after them."""
        groups = [[p for p in self.processes if p.name == "redis"], self.engines, [self.router],
                  [p for p in self.processes if p.name == "prometheus"]]
        return [g for g in groups if g]

    def _record(self) -> None:
        state = {"up": {"pid": os.getpid(), "started": start_time(os.getpid())},
                 "processes": {p.name: {"pid": p.pid, "started": start_time(p.pid)} for p in self.processes
                               if p.pid is not None}}
        path = self.config.work_dir / STATE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(path)

    def status_table(self) -> str:
        """Engine, port, state, requests finished and prompt tokens found cached (vLLM's own count: its prefix
        cache and kvtier together), from each engine's own metrics."""
        rows = [("name", "port", "state", "requests", "hit ratio")]
        for i, proc in enumerate(self.engines):
            port = self.config.engine_port(i)
            state = _state(proc)
            requests = ratio = "-"
            if state == "healthy":
                text = _get(f"http://{self.reach}:{port}/metrics")
                if text is not None:
                    done = sample_sum(text, "vllm:request_success_total")
                    prompt = sample_sum(text, "vllm:prompt_tokens_total")
                    cached = sample_sum(text, "vllm:prompt_tokens_cached_total")
                    requests = f"{done:.0f}"
                    ratio = f"{cached / prompt:.2f}" if prompt else "-"
            rows.append((proc.name, str(port), state, requests, ratio))
        others = [p for p in self.processes if p not in self.engines]
        rows.extend((proc.name, _port_of(self.config, proc.name), _state(proc), "", "") for proc in others)
        widths = [max(len(r[k]) for r in rows) for k in range(5)]
        stamp = time.strftime("%H:%M:%S")
        return "\n".join([f"-- {stamp}"] + ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
                                            for r in rows])


def down(config: FleetConfig, out: TextIO) -> int:
    """Stop the fleet that ``kvtier fleet up`` started with this config (by the PIDs it recorded)."""
    path = config.work_dir / STATE
    check_work_dir(config.work_dir)
    if path.exists() and os.lstat(path).st_uid != os.geteuid():  # PIDs another user wrote are not ours to signal
        raise ConfigError(f"work_dir: {path} is not owned by uid {os.geteuid()}; not signalling its PIDs")
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        print(f"fleet: no fleet is running from {config.work_dir} (no {STATE})", file=out)
        return 0
    except (OSError, ValueError) as exc:
        print(f"fleet: cannot read {path}: {exc}", file=out)
        return 1
    up = state.get("up", {})
    if isinstance(up.get("pid"), int) and start_time(up["pid"]) == up.get("started"):
        os.kill(up["pid"], signal.SIGTERM)  # it stops its processes in order, then exits
        deadline = time.monotonic() + 180
        while start_time(up["pid"]) == up.get("started") and time.monotonic() < deadline:
            time.sleep(0.2)
    for name, proc in reversed(list(state.get("processes", {}).items())):
        if isinstance(proc.get("pid"), int) and stop_recorded(proc["pid"], proc.get("started")):
            print(f"fleet: stopped {name} (pid {proc['pid']})", file=out)
    path.unlink(missing_ok=True)
    print("fleet: down", file=out)
    return 0


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def alert_rules() -> Path | None:
    """kvtier's alert rules, where this checkout has them (deploy/ is not part of an installed package)."""
    path = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "kvtier-alerts.yaml"
    return path if path.is_file() else None


def _redis_ping(host: str, port: int):
    import socket

    def check() -> bool:
        try:
            with socket.create_connection((host, port), timeout=2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    return check


def _state(proc: Process) -> str:
    if proc.proc is None:
        return "not started"
    if proc.proc.poll() is not None:
        return f"exited ({proc.proc.returncode})"
    return "healthy" if proc.healthy() else "unhealthy"


def _port_of(config: FleetConfig, name: str) -> str:
    return str({"redis": config.ports.redis, "router": config.ports.router,
                "prometheus": config.ports.prometheus}.get(name, ""))


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.read().decode(errors="replace")
    except OSError:
        return None
