"""kvtier's exception tree.

    KVTierError
    ├── ConfigError   bad configuration: names the field and what is allowed
    └── TierError     a secondary tier's I/O failed (the cause is chained with ``from``)
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing, unknown or of the wrong type or range."""


class TierError(KVTierError):
    """A secondary tier could not complete an operation."""
