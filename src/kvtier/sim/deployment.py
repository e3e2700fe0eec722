"""The deployment ``kvtier simulate`` times a trace against: one engine and, optionally, kvtier's tiers.

A YAML or JSON mapping; unknown keys, wrong types and bad values are a :class:`DeploymentError` naming the field::

    engine:
      kv_tokens: 5120               # the engine's KV space (its prefix cache lives there too)
      max_num_batched_tokens: 2048  # the scheduler's token budget per step (prefills are chunked to it)
      max_num_seqs: 256             # requests running at once
      prefix_caching: true
      block_size: 128               # vLLM's block (--block-size); one block is vLLM's null block, never used
    kvtier:                         # omit (or null) for the engine alone
      dram_bytes: 2GiB
      policy: prefix_lru
      page_bytes: 1MiB              # the pool's page (a chunk takes whole pages)
      store_after: 1                # admission.store_after: a block is stored at its Nth put (1-16)
      tiers:                        # in lookup order; each name must be a tier of the calibration
        - name: filesystem
          capacity_bytes: null      # null: unbounded (stored bytes: with a codec it holds more chunks)
          codec: none               # none, lossless, fp8 or k16v8 (kvtier.codecs; costed as
                                    # kvtier.sim.codec_model says, from the calibration's measurements)
    time_scale: 1.0                 # trace time is divided by this (2.0 replays twice as fast)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.codecs import CODECS
from kvtier.config import FieldReader
from kvtier.errors import KVTierError
from kvtier.eviction import POLICIES


class DeploymentError(KVTierError, ValueError):
    """A deployment description is malformed: the message names the field."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    kv_tokens: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    prefix_caching: bool = True
    block_size: int = 128  # vLLM's block; one block of the KV space is vLLM's null block, never handed out


@dataclasses.dataclass(frozen=True)
class TierCapacity:
    """A calibrated tier, by name, the bytes it holds (None: unbounded) and the codec it stores chunks in."""

    name: str
    capacity_bytes: int | None = None
    codec: str = "none"


@dataclasses.dataclass(frozen=True)
class KVTierSpec:
    dram_bytes: int
    policy: str = "prefix_lru"
    tiers: tuple[TierCapacity, ...] = ()
    page_bytes: int = 2**20
    store_after: int = 1  # admission.store_after: a block is stored at its Nth put


@dataclasses.dataclass(frozen=True)
class Deployment:
    engine: EngineSpec
    kvtier: KVTierSpec | None = None
    time_scale: float = 1.0

    def without_kvtier(self) -> Deployment:
        return dataclasses.replace(self, kvtier=None)


def load_deployment(source: str | Path | Mapping[str, Any]) -> Deployment:
    """Parse a deployment from a mapping or a YAML/JSON file."""
    raw = _FIELDS.load(source, "deployment")
    top = _FIELDS.mapping(raw, "deployment", ("engine", "kvtier", "time_scale"))
    engine = _FIELDS.mapping(top.get("engine"), "engine", ENGINE_KEYS)
    spec = engine_spec(engine, "engine")
    kv = None
    if top.get("kvtier") is not None:
        section = _FIELDS.mapping(top["kvtier"], "kvtier", ("dram_bytes", "policy", "tiers", "page_bytes",
                                                               "store_after"))
        policy = section.get("policy", "prefix_lru")
        if not isinstance(policy, str) or policy not in POLICIES.names():
            raise DeploymentError(f"kvtier.policy: unknown policy {policy!r}; known: {', '.join(POLICIES.names())}")
        specs = tier_specs(section.get("tiers", []) or [], "kvtier.tiers")
        page = _FIELDS.size(section, "page_bytes", "kvtier", required=False) or 2**20
        if page < 4096:
            raise DeploymentError(f"kvtier.page_bytes: must be at least 4096, got {page}")
        store_after = _FIELDS.int(section, "store_after", "kvtier", default=1, maximum=16)
        kv = KVTierSpec(_FIELDS.size(section, "dram_bytes", "kvtier", required=True), policy,
                        specs, page, store_after)
    scale = _FIELDS.number(top, "time_scale", "deployment", default=1.0, positive=True)
    return Deployment(spec, kv, scale)


ENGINE_KEYS = ("kv_tokens", "max_num_batched_tokens", "max_num_seqs", "prefix_caching", "block_size")


def engine_spec(engine: Mapping[str, Any], field: str, fields: FieldReader | None = None) -> EngineSpec:
    """An ``engine`` section (``field`` names it in errors, raised through ``fields``)."""
    f = fields or _FIELDS
    return EngineSpec(
        kv_tokens=f.int(engine, "kv_tokens", field, required=True),
        max_num_batched_tokens=f.int(engine, "max_num_batched_tokens", field, default=2048),
        max_num_seqs=f.int(engine, "max_num_seqs", field, default=256),
        prefix_caching=f.bool(engine, "prefix_caching", field, default=True),
        block_size=f.int(engine, "block_size", field, default=128, maximum=4096))


def tier_specs(tiers: Any, field: str, fields: FieldReader | None = None) -> tuple[TierCapacity, ...]:
    """A list of ``{name, capacity_bytes, codec}``: tiers of the calibration, in lookup order."""
    f = fields or _FIELDS
    if not isinstance(tiers, list):
        raise f.error(f"{field}: expected a list, got {type(tiers).__name__}")
    specs = []
    for i, tier in enumerate(tiers):
        entry = f.mapping(tier, f"{field}[{i}]", ("name", "capacity_bytes", "codec"))
        if not isinstance(entry.get("name"), str) or not entry["name"]:
            raise f.error(f"{field}[{i}].name: expected the name of a calibrated tier")
        codec = entry.get("codec", "none")
        if not isinstance(codec, str) or codec not in CODECS:
            raise f.error(f"{field}[{i}].codec: unknown codec {codec!r}; known: {', '.join(sorted(CODECS))}")
        specs.append(TierCapacity(entry["name"], f.size(entry, "capacity_bytes", f"{field}[{i}]", required=False),
                                  codec))
    if len({t.name for t in specs}) != len(specs):
        raise f.error(f"{field}: names must differ")
    return tuple(specs)


_FIELDS = FieldReader(DeploymentError)
