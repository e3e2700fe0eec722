"""vLLM OpenAI API servers with KV events, and the router in front of them, as processes on loopback: for the
router's end-to-end tests and its benchmark. Every process runs in a session of its own and is stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvtier.testing.servers import free_port

BLOCK_SIZE = 128


class Process:
    """A server process started in a session of its own, with its log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str], health_url: str) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = env
        self.health_url = health_url
        self.proc: subprocess.Popen | None = None

    def start(self) -> Process:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); its log ends:\n"
                                   + self.log.read_text()[-3000:])
            try:
                urllib.request.urlopen(self.health_url, timeout=2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not answer {self.health_url} within {timeout:.0f} s")
                time.sleep(0.5)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process's whole group and wait for it to go."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class Engine(Process):
    """One vLLM API server pinned to one core, publishing KV events on ipc:// sockets under ``work``."""

    def __init__(self, name: str, model: Path, work: Path, *, cpu: int, blocks: int = 48,
                 max_model_len: int = 4096, kv_transfer: dict | None = None, extra: list[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"ipc://{work}/{name}.pub"
        self.replay = f"ipc://{work}/{name}.rep"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events,
                  "replay_endpoint": self.replay, "topic": f"kv@{name}"}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
                "--max-num-batched-tokens", str(max_model_len), "--num-gpu-blocks-override", str(blocks),
                "--block-size", str(BLOCK_SIZE), "--gpu-memory-utilization", "0.3",
                "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events), *extra]
        if kv_transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer)]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(VLLM_CPU_OMP_THREADS_BIND=str(cpu), VLLM_CPU_KVCACHE_SPACE="1", PYTHONHASHSEED="0",
                   VLLM_SERVER_DEV_MODE="1")
        super().__init__(name, argv, work / f"{name}.log", env, self.url + "/health")

    def router_entry(self) -> dict:
        return {"name": self.name, "url": self.url, "kv_events": self.events, "kv_events_replay": self.replay}


class RouterProcess(Process):
    def __init__(self, config: dict, work: Path, name: str = "router") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = work / f"{name}.yaml"
        path.write_text(json.dumps({**config, "listen": f"127.0.0.1:{self.port}"}))
        argv = [sys.executable, "-m", "kvtier.cli", "router", "--config", str(path), "--log-level",
                os.environ.get("KVTIER_ROUTER_LOG_LEVEL", "INFO")]
        super().__init__(name, argv, work / f"{name}.log", dict(os.environ), self.url + "/health")
