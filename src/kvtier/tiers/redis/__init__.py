"""The Redis tier: shards in a Redis or Valkey server, or a Redis Cluster, shared by every engine that uses it.

- :mod:`.options`: what the config may say (:class:`RedisOptions`), checked before anything connects.
- :mod:`.fields`: the stored format, a chunk's hash and its shards' segment fields.
- :mod:`.connection`: the client, built on first use, and how a Redis error becomes a :class:`TierError`.
- :mod:`.replies`: the one-segment read straight from the socket into the caller's buffers.
- :mod:`.tier`: :class:`RedisTier`, the tier interface over those, with its tenant shares
  (:mod:`kvtier.quotas.redis`).
"""

from kvtier.tiers.redis.options import RedisOptions
from kvtier.tiers.redis.tier import RedisTier

__all__ = ["RedisOptions", "RedisTier"]
