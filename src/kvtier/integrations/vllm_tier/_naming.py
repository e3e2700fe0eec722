"""What the tier's stored objects are, and what they are named by (scheduler process, at start).

A chunk of vLLM's CPU primary tier is one row of bytes: every worker's pages of that chunk's blocks, in vLLM's own
layout (kvtier does not convert them: a row is only ever loaded back into the same layout). kvtier stores each
row as one shard of bytes (``uint8``), shaped ``[layers, 2, 1, chunk_tokens, width]`` only because a shard's
header carries a shape: :class:`RowShape` factors the row's size so. A row's name is vLLM's ``OffloadKey`` (its
block hash, which hashes the whole prefix, the LoRA adapter, multimodal inputs and the cache salt, and its KV
group), keyed under a :class:`~kvtier.keys.Namespace` that holds everything else that changes the row's bytes:

- the model and the engine settings that change KV from the same weights, as kvtier's own connector names them
  (:mod:`kvtier.integrations.vllm._namespace`: the model's files, or its hub snapshot at the revision vLLM
  loaded; the KV cache dtype, quantization, the resolved Hugging Face config with ``hf_overrides``, RoPE scaling
  and the rest). vLLM 0.32 passes a tier its ``OffloadingConfig`` only; the engine's ``VllmConfig`` (of the same
  model) is read from the vLLM call that builds the tier (:func:`engine_config`). A tier built outside an engine
  (no such call) names the model by ``model_fingerprint``, else by a fingerprint of the model's directory, and
  nothing else;
- a digest of the row's layout: tokens per block hash, blocks per chunk, the KV cache groups (their block sizes
  and layer names), bytes per block over all workers and per row, the parallel sizes (unless vLLM says the bytes
  are the same under any of them), the replicated layout, and the canonical format's id (its version and layout
  family) or the KV cache layout.

Rows stored through vLLM's offloading and chunks stored by kvtier's own connector never share a name (another
``settings``, another key function, another payload shape): the two are kept apart, never confused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

from kvtier.errors import ConfigError
from kvtier.integrations.vllm._namespace import engine_settings, model_fingerprint
from kvtier.keys import Namespace, fingerprint_model

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

SETTINGS_PREFIX = "vllm-offloading:"  # a namespace of rows in vLLM's layout (kvtier's connector: "blake2b:")
_U16 = 65535  # the largest layer count and width a shard header holds
_FRAMES = 32  # callers searched for the engine's config
log = logging.getLogger("kvtier.integrations.vllm_tier")


@dataclasses.dataclass(frozen=True)
class RowShape:
    """One row of ``row_bytes`` as a shard ``[layers, 2, 1, tokens, width]`` of bytes."""

    tokens: int
    layers: int
    width: int

    @property
    def row_bytes(self) -> int:
        return self.layers * 2 * self.tokens * self.width

    @classmethod
    def of(cls, row_bytes: int, tokens: int, field: str) -> RowShape:
        """The shape of a row of ``row_bytes`` holding ``tokens`` tokens: the fewest layers whose width fits a
        header; a :class:`ConfigError` naming ``field`` when there is none."""
        if tokens < 1 or row_bytes < 1 or row_bytes % (2 * tokens):
            raise ConfigError(f"{field}: a chunk of {tokens} tokens in a row of {row_bytes} bytes cannot be stored "
                              f"(the row must split into K and V halves of whole tokens)")
        per = row_bytes // (2 * tokens)
        for layers in range(1, _U16 + 1):
            if per % layers == 0 and per // layers <= _U16:
                return cls(tokens, layers, per // layers)
        raise ConfigError(f"{field}: a row of {row_bytes} bytes has no shape kvtier's shard header can hold")


def chunk_tokens(config: OffloadingConfig) -> int:
    """Tokens one row holds: the first KV cache group's block size times the blocks of a chunk."""
    return config.groups[0].tokens_per_block * config.cache.blocks_per_chunk


def engine_config(model: str) -> VllmConfig | None:
    """The config of the engine building this tier (serving ``model``, the ``OffloadingConfig``'s model name): the
    innermost vLLM call holding a ``vllm_config`` of that model (vLLM's ``OffloadingConnector`` scheduler builds the
    manager, and each tier, with it in hand), else vLLM's current config if it is of that model; None where there is
    neither (a tier built outside an engine, or by a vLLM that builds it otherwise: logged)."""
    frame = inspect.currentframe()
    try:
        for _ in range(_FRAMES):
            if frame is None:
                break
            found = frame.f_locals.get("vllm_config")
            if isinstance(found, VllmConfig) and _model_of(found) == model:
                return found
            frame = frame.f_back
    finally:
        del frame  # (a frame kept in a local would keep every caller's locals alive)
    current = get_current_vllm_config_or_none()
    if current is not None and _model_of(current) == model:
        return current
    log.warning("kvtier tier: no vLLM engine config of model %r builds this tier; its rows are named by the model "
                "alone (no engine settings: quantization, hf_overrides, RoPE scaling)", model)
    return None


def _model_of(config: VllmConfig) -> str | None:
    return None if config.model_config is None else config.model_config.model


def layout_settings(config: OffloadingConfig, row_bytes: int, engine: str | None = None) -> str:
    """The digest of everything in ``config`` that changes a row's bytes for the same model and name, and of
    ``engine`` (the engine settings' digest, when known)."""
    parallel = config.parallel
    agnostic = parallel.is_parallelism_agnostic or config.replicated_layout
    copies = 1 if config.replicated_layout else parallel.world_size
    fields: dict[str, object] = {
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "kv_bytes_per_block": config.worker_kv_bytes_per_block * copies,  # every worker's: the same under any TP
        "row_bytes": row_bytes,
        "parallel": None if agnostic else [parallel.tp_size, parallel.pp_size, parallel.pcp_size,
                                           parallel.dcp_size, parallel.world_size],
        "replicated_layout": config.replicated_layout,
        "canonical": config.canonical_layout,
        "layout": canonical_format_id(config.kv_cache_layout) if config.canonical_layout and config.kv_cache_layout
        else ["direct", config.kv_cache_layout],
        "engine": engine,
    }
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return SETTINGS_PREFIX + hashlib.blake2b(blob, digest_size=16).hexdigest()


def model_of(name: str, override: object, field: str) -> str:
    """``override`` when given, else a fingerprint of the model directory ``name`` (a tier built outside an
    engine); a :class:`ConfigError` naming ``field`` otherwise."""
    if override is not None:
        if not isinstance(override, str) or not override:
            raise ConfigError(f"{field}: expected a non-empty string, got {override!r}")
        return override
    if not Path(name).is_dir():
        raise ConfigError(f"{field}: model {name!r} is not a local directory, and this tier was built outside a "
                          "vLLM engine, so kvtier cannot fingerprint the model; set model_fingerprint in the tier's "
                          "entry to a string that changes whenever the model's weights, config or quantization do")
    try:
        return fingerprint_model(name)
    except ValueError as exc:
        raise ConfigError(f"{field}: model {name!r}: {exc}") from exc


def namespace(config: OffloadingConfig, row_bytes: int, override: object, where: str,
              engine: VllmConfig | None = None) -> Namespace:
    """The namespace of an engine's rows (``engine``: its config, when known; ``override``: the entry's
    ``model_fingerprint``; ``where`` names the entry in errors)."""
    if engine is None:
        return Namespace(model=model_of(config.model.name, override, f"{where}.model_fingerprint"),
                         dtype=config.model.dtype, settings=layout_settings(config, row_bytes))
    return Namespace(model=model_fingerprint(engine, override, where), dtype=config.model.dtype,
                     settings=layout_settings(config, row_bytes, engine_settings(engine)))
