"""The deployment ``kvtier simulate`` times a trace against: one engine and, optionally, kvtier's tiers.

A YAML or JSON mapping; unknown keys, wrong types and bad values are a :class:`DeploymentError` naming the field::

    engine:
      kv_tokens: 5120               # the engine's KV space (its prefix cache lives there too)
      max_num_batched_tokens: 2048  # the scheduler's token budget per step (prefills are chunked to it)
      max_num_seqs: 256             # requests running at once
      prefix_caching: true
    kvtier:                         # omit (or null) for the engine alone
      dram_bytes: 2GiB
      policy: prefix_lru
      page_bytes: 1MiB              # the pool's page (a chunk takes whole pages)
      tiers:                        # in lookup order; each name must be a tier of the calibration
        - name: filesystem
          capacity_bytes: null      # null: unbounded
    time_scale: 1.0                 # trace time is divided by this (2.0 replays twice as fast)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvtier.config import parse_size
from kvtier.errors import ConfigError, KVTierError
from kvtier.eviction import POLICIES


class DeploymentError(KVTierError, ValueError):
    """A deployment description is malformed: the message names the field."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    kv_tokens: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    prefix_caching: bool = True


@dataclasses.dataclass(frozen=True)
class TierSpec:
    name: str
    capacity_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class KVTierSpec:
    dram_bytes: int
    policy: str = "prefix_lru"
    tiers: tuple[TierSpec, ...] = ()
    page_bytes: int = 2**20


@dataclasses.dataclass(frozen=True)
class Deployment:
    engine: EngineSpec
    kvtier: KVTierSpec | None = None
    time_scale: float = 1.0

    def without_kvtier(self) -> Deployment:
        return dataclasses.replace(self, kvtier=None)


def load_deployment(source: str | Path | Mapping[str, Any]) -> Deployment:
    """Parse a deployment from a mapping or a YAML/JSON file."""
    if isinstance(source, Mapping):
        raw: Any = source
    else:
        try:
            raw = yaml.safe_load(Path(source).read_text())
        except OSError as exc:
            raise DeploymentError(f"{source}: cannot read the deployment: {exc.strerror or exc}") from exc
        except yaml.YAMLError as exc:
            raise DeploymentError(f"{source}: not YAML: {exc}") from None
    top = _mapping(raw, "deployment", ("engine", "kvtier", "time_scale"))
    engine = _mapping(top.get("engine"), "engine", ("kv_tokens", "max_num_batched_tokens", "max_num_seqs",
                                                    "prefix_caching"))
    spec = EngineSpec(
        kv_tokens=_int(engine, "kv_tokens", "engine", required=True),
        max_num_batched_tokens=_int(engine, "max_num_batched_tokens", "engine", default=2048),
        max_num_seqs=_int(engine, "max_num_seqs", "engine", default=256),
        prefix_caching=_bool(engine, "prefix_caching", "engine", default=True))
    kv = None
    if top.get("kvtier") is not None:
        section = _mapping(top["kvtier"], "kvtier", ("dram_bytes", "policy", "tiers", "page_bytes"))
        policy = section.get("policy", "prefix_lru")
        if not isinstance(policy, str) or policy not in POLICIES.names():
            raise DeploymentError(f"kvtier.policy: unknown policy {policy!r}; known: {', '.join(POLICIES.names())}")
        tiers = section.get("tiers", []) or []
        if not isinstance(tiers, list):
            raise DeploymentError(f"kvtier.tiers: expected a list, got {type(tiers).__name__}")
        specs = []
        for i, tier in enumerate(tiers):
            field = f"kvtier.tiers[{i}]"
            entry = _mapping(tier, field, ("name", "capacity_bytes"))
            if not isinstance(entry.get("name"), str) or not entry["name"]:
                raise DeploymentError(f"{field}.name: expected the name of a calibrated tier")
            specs.append(TierSpec(entry["name"], _bytes(entry, "capacity_bytes", field, required=False)))
        if len({t.name for t in specs}) != len(specs):
            raise DeploymentError("kvtier.tiers: names must differ")
        page = _bytes(section, "page_bytes", "kvtier", required=False) or 2**20
        if page < 4096:
            raise DeploymentError(f"kvtier.page_bytes: must be at least 4096, got {page}")
        kv = KVTierSpec(_bytes(section, "dram_bytes", "kvtier", required=True), policy, tuple(specs),  # type: ignore[arg-type]
                        page)
    scale = top.get("time_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise DeploymentError(f"time_scale: expected a number > 0, got {scale!r}")
    return Deployment(spec, kv, float(scale))


def _mapping(value: Any, field: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise DeploymentError(f"{field}: expected a mapping, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            raise DeploymentError(f"{field}.{key}: unknown key; allowed: {', '.join(allowed)}")
    return value


def _int(section: Mapping[str, Any], key: str, field: str, required: bool = False, default: int = 0) -> int:
    if key not in section:
        if required:
            raise DeploymentError(f"{field}.{key}: missing")
        return default
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeploymentError(f"{field}.{key}: expected an integer >= 1, got {value!r}")
    return value


def _bool(section: Mapping[str, Any], key: str, field: str, default: bool) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise DeploymentError(f"{field}.{key}: expected true or false, got {value!r}")
    return value


def _bytes(section: Mapping[str, Any], key: str, field: str, required: bool) -> int | None:
    value = section.get(key)
    if value is None:
        if required:
            raise DeploymentError(f"{field}.{key}: missing")
        return None
    try:
        out = parse_size(value, f"{field}.{key}")
    except ConfigError as exc:
        raise DeploymentError(str(exc)) from None
    if out < 1:
        raise DeploymentError(f"{field}.{key}: must be positive, got {value!r}")
    return out
