"""kvtier's cache-aware router: an OpenAI-compatible proxy that sends each request to the engine that can serve
its prompt fastest, from an exact index of the fleet's KV blocks fed by the engines' (and kvtier's) KV events.

Modules: ``config`` (the YAML file), ``events`` (vLLM's KV-event wire format, ordering, replay), ``index``
(blocks by key, engine and place), ``policy`` (predicted TTFT per engine; round-robin; session affinity),
``prompts`` (tokenizing as the engine does), ``reading`` (a request body to a keyed prompt, on a worker or,
where cheaper, the event loop),
``proxy`` (a request from its body to the engine's last byte), ``engines`` (health checks, KV-event subscribers,
calibration), ``app`` (the aiohttp application wiring them, and its listeners), ``metrics``.
"""
