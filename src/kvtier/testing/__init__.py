"""Test helpers shipped with kvtier: deterministic KV data and the tier conformance suite.

Out-of-tree tiers reuse them: subclass :class:`kvtier.testing.tiers.TierConformance` in a pytest module.
"""

from kvtier.testing.data import synthetic_kv, synthetic_tokens

__all__ = ["synthetic_kv", "synthetic_tokens"]
