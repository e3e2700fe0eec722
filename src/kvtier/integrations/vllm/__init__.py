"""vLLM integration: ``KVTierConnector``, a KV connector (``KVConnectorBase_V1``) backed by a :class:`KVStore`.

Load it with::

    kv_transfer_config={"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"config": <mapping or YAML path>}}

vLLM makes one instance per role (:mod:`._connector`). The scheduler instance decides (lookups, what to load and
save: :mod:`._scheduler`), sending its plan to the workers as :class:`KVTierMetadata`; worker instances move
bytes between the engine's paged KV cache and the store (:mod:`._worker`) and report what their DRAM holds back
to the scheduler (:mod:`._dram_index`). What the two sides send each other is in :mod:`._wire`. Lookups never
wait on a network (:mod:`._lookups`). Namespaces hold everything that changes the KV of the same token ids
(:mod:`._namespace`). kvtier's KV events are published with the engine's (:mod:`._events`). Connector instances
in one process share a store and metrics (:mod:`._shared`).

The modules are private; what this package exports is the public surface.
"""

from __future__ import annotations

from kvtier.integrations.vllm._connector import KVTierConnector
from kvtier.integrations.vllm._shared import shared_store
from kvtier.integrations.vllm._wire import KVTierMetadata, Transfer

__all__ = ["KVTierConnector", "KVTierMetadata", "Transfer", "shared_store"]
