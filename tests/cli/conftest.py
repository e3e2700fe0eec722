"""What the CLI's tests share: a filesystem-tier store config with seven shards in two namespaces."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvtier import KVStore, Namespace
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.conftest import NS, store_config

T = 16
OTHER = Namespace(model="other-model", dtype="bfloat16")


def put_three_prompts(store: KVStore) -> None:
    """Six shards in namespace NS: three prompts of two chunks."""
    for i in range(3):
        tokens = synthetic_tokens(i, 2 * T)
        store.put(NS, tokens, synthetic_kv(tokens))


@pytest.fixture
def config(tmp_path: Path) -> Path:
    cfg = store_config(tmp_path / "fs")
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with KVStore.from_config(cfg) as store:
        put_three_prompts(store)
        tokens = synthetic_tokens(99, T)
        store.put(OTHER, tokens, synthetic_kv(tokens))
    return path
