"""Secondary tiers: the interface, the registry and the in-tree backends.

The shared tiers import their client libraries only when a tier of that type is opened.
"""

from kvtier.tiers._mooncake import MooncakeTier
from kvtier.tiers._s3 import S3Tier
from kvtier.tiers.base import TIERS, StoredObject, Tier
from kvtier.tiers.filesystem import FilesystemTier
from kvtier.tiers.redis import RedisTier

__all__ = ["TIERS", "FilesystemTier", "MooncakeTier", "RedisTier", "S3Tier", "StoredObject", "Tier"]
