"""Secondary tiers: the interface, the registry and the in-tree backends."""

from kvtier.tiers._filesystem import FilesystemTier
from kvtier.tiers.base import TIERS, StoredObject, Tier

__all__ = ["TIERS", "FilesystemTier", "StoredObject", "Tier"]
