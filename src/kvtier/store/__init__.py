"""The tiered store: :class:`KVStore` (the facade users and integrations call) over its parts, one module each
(see :mod:`kvtier.store.kvstore`)."""

from kvtier.store.kvstore import KVStore, Loaded, open_tiers
from kvtier.store.prefetch import READ_AHEAD
from kvtier.store.writes import Tokens

__all__ = ["READ_AHEAD", "KVStore", "Loaded", "Tokens", "open_tiers"]
