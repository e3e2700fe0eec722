"""vLLM OpenAI API servers with KV events, and the router in front of them, as processes on loopback: for the
router's end-to-end tests and its benchmark. Every process runs in a session of its own and is stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.fleet.process import Process
from kvtier.fleet.run import engine_env, vllm_command
from kvtier.testing.servers import free_port

BLOCK_SIZE = 128
# What the tests' vLLM engines compute in where bfloat16 KV is not what a test is about (routing, handoffs,
# metrics, processes): float32. A CPU without bfloat16 instructions (an AMD EPYC with AVX2 only, as CI may be)
# computes bfloat16 matrix products ~40x slower than float32 (1.2 against 51 GFLOP/s on one core); and where
# bfloat16 has rounded a prompt's first computation and a computation over its cached prefix to different tokens
# on some CPUs, float32's rounding stays far below the gap between these prompts' top logits. The tests of the
# exactness of bfloat16 KV (tests/integrations/vllm/test_connector_engine.py) and the benchmarks keep bfloat16.
TEST_DTYPE = "float32"


class Engine(Process):
    """One vLLM API server pinned to one core, publishing KV events on ipc:// sockets under ``work``."""

    def __init__(self, name: str, model: Path, work: Path, *, cpu: int, dtype: str, blocks: int = 48,
                 max_model_len: int = 4096, kv_transfer: dict | None = None, extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"ipc://{work}/{name}.pub"
        self.replay = f"ipc://{work}/{name}.rep"
        argv = vllm_command(model, "smol", host="127.0.0.1", port=self.port, block_size=BLOCK_SIZE,
                            max_model_len=max_model_len, events=self.events, replay=self.replay, topic=f"kv@{name}",
                            kv_transfer=kv_transfer,
                            extra=["--enforce-eager", "--dtype", dtype, "--max-num-batched-tokens",
                                   str(max_model_len), "--num-gpu-blocks-override", str(blocks),
                                   "--gpu-memory-utilization", "0.3", *extra])
        env = engine_env(str(cpu), {"VLLM_CPU_KVCACHE_SPACE": "1"})
        super().__init__(name, argv, work / f"{name}.log", env, self.url + "/health")

    def router_entry(self) -> dict:
        return {"name": self.name, "url": self.url, "kv_events": self.events, "kv_events_replay": self.replay}


def kvtier_transfer(store: dict, **extra: object) -> dict:
    """vLLM's ``--kv-transfer-config`` for kvtier's connector over the store config ``store``, with ``extra`` in
    its ``kv_connector_extra_config`` (a failed load is recomputed)."""
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": store, **extra}}


def start_healthy(engines: Sequence[Engine]) -> None:
    """Start every engine, then wait for each to answer its health check (they start side by side)."""
    for engine in engines:
        engine.start()
    for engine in engines:
        engine.wait_healthy()


class RouterProcess(Process):
    def __init__(self, config: dict, work: Path, name: str = "router") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = work / f"{name}.yaml"
        self._write(config)
        argv = [sys.executable, "-m", "kvtier.cli", "router", "--config", str(self.config_path), "--log-level",
                os.environ.get("KVTIER_ROUTER_LOG_LEVEL", "INFO")]
        super().__init__(name, argv, work / f"{name}.log", dict(os.environ), self.url + "/health")

    def _write(self, config: dict) -> None:
        """The config file, replaced whole (a reload never reads half of it)."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**config, "listen": f"127.0.0.1:{self.port}"}))
        tmp.replace(self.config_path)

    def reconfigure(self, config: dict) -> None:
        """Write ``config`` as the router's config file and signal it (SIGHUP) to read its engines again."""
        self._write(config)
        self.send(signal.SIGHUP)
