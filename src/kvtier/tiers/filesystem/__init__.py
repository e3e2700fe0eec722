"""The filesystem tier: one file per shard under a root directory, crash-safe and re-indexed on start.

- :mod:`.options`: what the config may say (:class:`FilesystemOptions`).
- :mod:`.layout`: where each shard's file lies, and which directories and files the tier trusts.
- :mod:`.writes`: a file written whole under a unique temp name (fsync'd if asked), then renamed into place.
- :mod:`.reads`: a file read into the caller's buffers; one that is not a shard's is a miss, removed.
- :mod:`.index`: what the directory holds, least recently used first, and the tenant shares counted over it.
- :mod:`.walk`: the directory walked on start, for chunks other processes wrote, and for a share's recount.
- :mod:`.tier`: :class:`FilesystemTier`, the tier interface over those, and what to evict.
"""

from kvtier.tiers.filesystem.options import FilesystemOptions
from kvtier.tiers.filesystem.tier import FilesystemTier

__all__ = ["FilesystemOptions", "FilesystemTier"]
