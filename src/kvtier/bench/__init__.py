"""``kvtier bench``: TTFT of repeated long prefixes on vLLM (CPU) with SmolLM2-135M, with and without kvtier."""
