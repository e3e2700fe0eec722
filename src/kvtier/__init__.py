"""kvtier: LLM KV caches in tiers outside the inference engine (DRAM, local disk, shared stores)."""

import importlib.metadata

from kvtier.config import StoreConfig, load_config
from kvtier.errors import ConfigError, KVTierError, ObjectError, TierError
from kvtier.eviction import POLICIES, EvictionPolicy
from kvtier.keys import HeadRange, InputSpan, Namespace, ShardKey, chunk_keys, fingerprint_model, rank_heads
from kvtier.store import KVStore
from kvtier.tiers import TIERS, FilesystemTier, MooncakeTier, RedisTier, S3Tier, StoredObject, Tier

try:  # the installed distribution's: pyproject.toml's [project] version is the one place it is written
    __version__ = importlib.metadata.version("kvtier")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "POLICIES",
    "TIERS",
    "ConfigError",
    "EvictionPolicy",
    "FilesystemTier",
    "HeadRange",
    "InputSpan",
    "KVStore",
    "KVTierError",
    "MooncakeTier",
    "Namespace",
    "ObjectError",
    "RedisTier",
    "S3Tier",
    "ShardKey",
    "StoreConfig",
    "StoredObject",
    "Tier",
    "TierError",
    "chunk_keys",
    "fingerprint_model",
    "load_config",
    "rank_heads",
]
