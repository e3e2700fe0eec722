from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.vllm_tiering import Tiering, offloading_config

ROW = 16384  # bytes a row: 4 layers x 256 bytes of KV a token x 16 tokens
SHAPE = {"layers": 4, "kv_bytes_per_token_layer": 256, "tokens_per_block": 16}


def tier_entry(kvtier: dict[str, Any] | str, **options: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry for kvtier's tier, as a vLLM user writes it."""
    return {"type": "KVTierSecondaryTier", "module_path": "kvtier.integrations.vllm_tier", "config": kvtier,
            "model_fingerprint": "test-model", **options}


def kvtier_config(*tiers: dict[str, Any], dram: str = "1MiB", **extra: Any) -> dict[str, Any]:
    return {"dram": {"capacity_bytes": dram, "page_bytes": "16KiB"}, "tiers": list(tiers), **extra}


def disk(path: Path, **options: Any) -> dict[str, Any]:
    return {"type": "filesystem", "name": "disk", "path": str(path), "queue_depth": 4096, **options}


MakeTiering = Callable[..., Tiering]


@pytest.fixture
def make_tiering() -> Iterator[MakeTiering]:
    """Build vLLM tiering managers (``secondary_tiers`` entries, ``offloading_config``'s options); each is shut down
    at teardown."""
    made: list[Tiering] = []

    def make(*entries: dict[str, Any], **kw: Any) -> Tiering:
        options = {**SHAPE, "model": "smollm", "cpu_bytes": 1 << 20, **kw}
        tiering = Tiering(offloading_config(list(entries), **options))
        made.append(tiering)
        return tiering

    yield make
    for tiering in made:
        tiering.close()
