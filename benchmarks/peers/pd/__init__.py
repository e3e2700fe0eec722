"""Peers for disaggregated prefill/decode: vLLM's own (``NixlConnector``) in :mod:`.nixl`, behind the two-hop proxy
of :mod:`.proxy`. A package, so that ``python -m benchmarks.peers.pd.nixl`` runs from the repository root and a
benchmark in ``benchmarks/`` imports ``peers.pd.nixl``."""
