"""What the tier's stored objects are, and what they are named by (scheduler process, at start).

A chunk of vLLM's CPU primary tier is one row of bytes: every worker's pages of that chunk's blocks, in vLLM's own
layout (kvtier does not convert them: a row is only ever loaded back into the same layout). kvtier stores each
row as one shard of bytes (``uint8``), shaped ``[layers, 2, 1, chunk_tokens, width]`` only because a shard's
header carries a shape: :class:`RowShape` factors the row's size so. A row's name is vLLM's ``OffloadKey`` (its
block hash, which hashes the whole prefix, the LoRA adapter, multimodal inputs and the cache salt, and its KV
group), keyed under a :class:`~kvtier.keys.Namespace` that holds everything else that changes the row's bytes:

- the model: a fingerprint of its directory's config and weights, or ``model_fingerprint`` from the tier's entry
  (required for a hub id: the tier is not told which revision vLLM loaded, and a guess could serve another
  model's KV);
- the KV cache dtype, and a digest (``settings``) of the row's layout: tokens per block hash, blocks per chunk,
  the KV cache groups (their block sizes and layer names), bytes per block and per row, the parallel sizes
  (collapsed where vLLM says the bytes are the same under any of them), the replicated and canonical layouts and
  the KV cache layout.

Rows stored through vLLM's offloading and chunks stored by kvtier's own connector never share a name (another
``settings``, another key function, another payload shape): the two are kept apart, never confused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.keys import Namespace, fingerprint_model

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

SETTINGS_PREFIX = "vllm-offloading:"  # a namespace of rows in vLLM's layout (kvtier's connector: "blake2b:")
_U16 = 65535  # the largest layer count and width a shard header holds


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


def layout_settings(config: OffloadingConfig, row_bytes: int) -> str:
    """The digest of everything in ``config`` that changes a row's bytes for the same model and name."""
    parallel = config.parallel
    agnostic = parallel.is_parallelism_agnostic or config.replicated_layout
    fields: dict[str, object] = {
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "row_bytes": row_bytes,
        "parallel": None if agnostic else [parallel.tp_size, parallel.pp_size, parallel.pcp_size,
                                           parallel.dcp_size, parallel.world_size],
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
    }
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return SETTINGS_PREFIX + hashlib.blake2b(blob, digest_size=16).hexdigest()


def model_of(name: str, override: object, field: str) -> str:
    """``override`` when given, else a fingerprint of the model directory ``name``; a :class:`ConfigError` naming
    ``field`` otherwise."""
    if override is not None:
        if not isinstance(override, str) or not override:
            raise ConfigError(f"{field}: expected a non-empty string, got {override!r}")
        return override
    if not Path(name).is_dir():
        raise ConfigError(f"{field}: model {name!r} is not a local directory, so kvtier cannot fingerprint its "
                          "weights (vLLM does not tell a tier which revision it loaded); set model_fingerprint in "
                          "the tier's entry to a string that changes whenever the model's weights, config or "
                          "quantization do (e.g. the commit hash)")
    try:
        return fingerprint_model(name)
    except ValueError as exc:
        raise ConfigError(f"{field}: model {name!r}: {exc}") from exc


def namespace(config: OffloadingConfig, row_bytes: int, model: str) -> Namespace:
    """The namespace of this engine's rows."""
    return Namespace(model=model, dtype=config.model.dtype, settings=layout_settings(config, row_bytes))
