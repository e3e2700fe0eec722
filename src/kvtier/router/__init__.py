"""kvtier's cache-aware router: an OpenAI-compatible proxy that sends each request to the engine that can serve
its prompt fastest, from an exact index of the fleet's KV blocks fed by the engines' (and kvtier's) KV events.

Modules: ``config`` (the YAML file), ``events`` (vLLM's KV-event wire format, ordering, replay), ``index``
(blocks by key, engine and place), ``policy`` (predicted TTFT per engine; round-robin; session affinity),
``prompts`` (tokenizing as the engine does), ``app`` (the aiohttp proxy, health checks, calibration),
``metrics``.
"""
