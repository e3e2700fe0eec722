"""kvtier's exception tree.

    KVTierError
    ├── ConfigError   bad configuration: names the field and what is allowed
    ├── SealError     a shard cannot be sealed: its tenant's key is not held (forgotten since it was put)
    ├── NotEncodable  a lossy codec cannot store a shard faithfully (NaN or infinity in its KV)
    ├── QuotaFull     a tier refused a write: the tenant's share is full of shards it may not evict yet
    └── TierError     a secondary tier's I/O failed (the cause is chained with ``from``)
        └── ObjectError   the tier answered, but one stored object is malformed (wrong type, bad fields):
            │             a miss for that object, counted as corrupt and removed; not an outage of the tier
            ├── WrongSize     not the size a read into buffers asked for: malformed, or stored with a codec
            │                 (then read whole, and decoded, or refused)
            └── FrameError    the bytes are not a valid shard for its key (truncated, corrupt, misplaced,
                │             forged): the same (:mod:`kvtier.frame`; also a ValueError)
                ├── UnknownKey    sealed under a key this process does not hold: a miss, left in place and
                │                 counted apart from corruption
                └── RefusedCodec  stored with a codec the reading tier does not accept (lossy where exact KV is
                                  wanted): a miss, left in place, counted apart from corruption
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing, unknown or of the wrong type or range."""


class SealError(KVTierError):
    """A shard cannot be sealed for a tier: its tenant's key is not held here (forgotten since it was put)."""


class NotEncodable(KVTierError):
    """KV a lossy codec cannot store faithfully (NaN or infinity in it, which float8 would turn into finite numbers
    or lose): the write is dropped and counted."""


class QuotaFull(KVTierError):
    """A tier refused to write a shard: its tenant's share holds only shards used too recently to evict (its own
    prompt's), so the prompt keeps its leading chunks. Not a fault of the tier: the write is dropped and counted."""


class TierError(KVTierError):
    """A secondary tier could not complete an operation."""


class PartUnavailable(TierError):
    """One part of a tier failed (a Redis Cluster node, and so its slots): a miss or a dropped write for the keys
    it holds, while the tier's other parts serve. The tier rests that part itself; the store does not rest the
    whole tier for it."""


class ObjectError(TierError):
    """The tier answered, but one stored object is malformed (e.g. a Redis key of the wrong type).

    The store treats it as a miss for that object, counts it as corrupt and removes it; the tier stays in use.
    """


class WrongSize(ObjectError):
    """An object is not the size a read into buffers (``Tier.get_into``) asked for: ``size``, its size in bytes.
    Malformed, or stored with a codec (:mod:`kvtier.codecs`): the store then reads it again at that size (never more
    than a codec it accepts stores the shard in), and decodes it or refuses it by its header."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size
