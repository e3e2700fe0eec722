"""What names the tier's rows: a row's shard shape, and a namespace that changes with everything that changes a
row's bytes (and with nothing else), refusing to guess a model it cannot fingerprint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm_tier._naming import RowShape, chunk_tokens, layout_settings, model_of, namespace
from kvtier.testing.vllm_tiering import offloading_config


def test_a_row_is_shaped_into_a_shard_header() -> None:
    assert RowShape.of(368640, 16, "f") == RowShape(tokens=16, layers=1, width=11520)  # SmolLM2, 16 tokens
    big = RowShape.of(80 * 2 * 8 * 128 * 2 * 128, 128, "f")  # a 70B model's 128-token chunk
    assert big.row_bytes == 80 * 2 * 8 * 128 * 2 * 128 and big.width <= 65535 and big.layers == 4
    with pytest.raises(ConfigError, match="must split into K and V halves"):
        RowShape.of(1000, 16, "secondary_tiers[x]")
    with pytest.raises(ConfigError, match="no shape"):
        RowShape.of(2 * 65537 * 65537, 1, "secondary_tiers[x]")  # a prime width, over a header's field


def test_every_field_that_changes_a_rows_bytes_changes_the_namespace() -> None:
    base = offloading_config([], model="m")
    row = 16384
    variants = [
        offloading_config([], model="m", tokens_per_block=32),
        offloading_config([], model="m", layers=31),
        offloading_config([], model="m", kv_bytes_per_token_layer=512),
        offloading_config([], model="m", layout="LBHNC"),
        dataclasses.replace(base, cache=dataclasses.replace(base.cache, blocks_per_chunk=2)),
        dataclasses.replace(base, canonical_layout=True),  # vLLM's canonical format's id (version, family)
        dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, tp_size=2, world_size=2,
                                                                is_parallelism_agnostic=False)),
    ]
    settings = {layout_settings(c, row) for c in variants}
    assert len(settings) == len(variants) and layout_settings(base, row) not in settings
    assert layout_settings(base, row) != layout_settings(base, 2 * row)
    # Not the engine's id or rank, nor the TP degree where vLLM says the bytes are the same under any: every engine
    # of a fleet names its rows alike.
    tp2 = dataclasses.replace(base, worker_kv_bytes_per_block=base.worker_kv_bytes_per_block // 2,
                              parallel=dataclasses.replace(base.parallel, tp_size=2, world_size=2))
    assert layout_settings(tp2, row) == layout_settings(base, row)
    same = dataclasses.replace(base, engine_id="another", parallel=dataclasses.replace(base.parallel, rank=1))
    assert layout_settings(same, row) == layout_settings(base, row)
    assert chunk_tokens(variants[4]) == 32
    assert layout_settings(base, row) != layout_settings(base, row, engine="blake2b:" + "0" * 32)
    ns = namespace(base, row, "fingerprint", "f")
    assert (ns.model, ns.dtype) == ("fingerprint", "bfloat16") and ns.settings.startswith("vllm-offloading:")


def test_the_model_is_fingerprinted_or_named_never_guessed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    fingerprint = model_of(str(tmp_path), None, "f")
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert model_of(str(tmp_path), None, "f") != fingerprint
    assert model_of("org/model", "commit-abc", "f") == "commit-abc"
    with pytest.raises(ConfigError, match=r"^x\.model_fingerprint: model 'org/model' is not a local directory"):
        model_of("org/model", None, "x.model_fingerprint")
    with pytest.raises(ConfigError, match="expected a non-empty string"):
        model_of("org/model", "", "f")


def test_the_engines_config_is_read_from_the_vllm_call_that_builds_the_tier(model_dir: Path) -> None:
    """The innermost ``vllm_config`` of this model among the callers, else vLLM's current config of this model;
    never another model's."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from kvtier.integrations.vllm_tier._naming import engine_config

    name = str(model_dir)

    def build_tier() -> VllmConfig | None:
        return engine_config(name)

    def connector_scheduler(vllm_config: object) -> VllmConfig | None:  # vLLM's builder holds it as a local
        return build_tier()

    ours = VllmConfig(model_config=ModelConfig(model=name, skip_tokenizer_init=True))
    other = VllmConfig()  # another model (vLLM's default)
    assert connector_scheduler("not a config") is None and build_tier() is None
    assert connector_scheduler(ours) is ours
    assert connector_scheduler(other) is None  # another engine's config: not taken

    def outer(vllm_config: object) -> VllmConfig | None:
        return connector_scheduler(ours)

    assert outer(other) is ours  # the innermost of this model
    with set_current_vllm_config(other):
        assert connector_scheduler(ours) is ours and build_tier() is None  # the current one is another model's
    with set_current_vllm_config(ours):
        assert build_tier() is ours
