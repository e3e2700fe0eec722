"""kvtier's tiers inside vLLM's own offloading: ``KVTierSecondaryTier``, a secondary tier of vLLM's
``TieringOffloadingManager`` (the ``OffloadingConnector`` with ``TieringOffloadingSpec``, vLLM 0.32) whose storage is
a kvtier store: its tiers (a bounded filesystem, Redis or Redis Cluster, S3, Mooncake), frames and checksums,
encryption, placement, quotas, TTL and exact codecs. vLLM loads it by ``module_path``::

    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {
                            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 30,
                            "secondary_tiers": [{"type": "KVTierSecondaryTier",
                                                 "module_path": "kvtier.integrations.vllm_tier",
                                                 "config": "/etc/kvtier/kvtier.yaml"}]}}

vLLM's CPU primary tier stays the DRAM every chunk passes through; kvtier's DRAM (``dram:`` in its config) is the
buffer its cascade writes the tiers from, and a cache in front of them. How rows are named and kept apart from
what kvtier's own connector stores: :mod:`._naming`; the tier itself: :mod:`._tier`; its jobs' threads:
:mod:`._jobs`. docs/vllm-native.md has the set-up and what is tested where.
"""

from __future__ import annotations

from kvtier.integrations.vllm_tier._tier import KVTierSecondaryTier

__all__ = ["KVTierSecondaryTier"]
