"""kvtier's KV events, in vLLM's own format, published by vLLM with the engine's (scheduler process).

When vLLM runs with ``--kv-events-config``, every consumer of its events (kvtier's router, llm-d, Dynamo) also
learns where kvtier holds a prefix: ``BlockStored`` / ``BlockRemoved`` with ``medium`` "CPU" for kvtier's DRAM
and "STORAGE" for a secondary tier, ``locality`` "LOCAL" for this engine's DRAM and local disk and "REMOTE" for a
shared tier (every engine can load it), ``ownership`` ``kvtier:<tier>``. The blocks are named as the engine names
them (vLLM's block hashes of the same tokens, with their token ids and extra keys), at the engine's block size.

The scheduler side registers the blocks of each chunk it saves or loads; the workers report what their DRAM came
to hold or lost and what the cascade wrote into each tier (:mod:`._dram_index`); a chunk counts once every
tensor-parallel rank reports it. A tier's own evictions are not seen, so a shared tier is never announced as
having lost a chunk: a consumer that routes there on a stale entry gets a miss, which the engine recomputes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.integrations.vllm._dram_index import DramChange
from kvtier.integrations.vllm._wire import DRAM, KVTierWorkerMetadata
from kvtier.keys import Namespace, chunk_keys
from kvtier.recent import RecentMap

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvtier.tiers.base import Tier

_CHUNKS_KEPT = 16384  # chunks whose blocks are remembered for their events (about 1 KB each at 256 tokens)


@dataclasses.dataclass(frozen=True)
class _Blocks:
    hashes: list[Any]  # vLLM's external block hashes of the chunk's blocks
    parent: Any  # the hash of the block before the chunk; None for the first
    tokens: np.ndarray
    lora_name: str | None
    lora_id: int | None
    extra_keys: list[tuple[Any, ...] | None] | None


class KVEvents:
    def __init__(self, tiers: Sequence[Tier], tp_size: int, block_size: int, chunk_tokens: int,
                 names: Callable[[Namespace], Namespace]) -> None:
        """``names``: the store's naming (:meth:`KVStore.named`), so that chunks are named as the workers report
        them (keyed names with encryption). kvtier's names never leave the process: events carry vLLM's hashes."""
        self._names = names
        self._locality = {t.name: "LOCAL" if t.local else "REMOTE" for t in tiers}
        self._tp = tp_size
        self._bs = block_size
        self._chunk = chunk_tokens
        self._blocks: RecentMap[tuple[str, str], _Blocks] = RecentMap(_CHUNKS_KEPT)  # recently saved or loaded
        # Announced as held in DRAM: kept until announced removed (the DRAM's capacity bounds it), or consumers
        # would credit a chunk the DRAM dropped for good.
        self._in_dram: dict[tuple[str, str], list[Any]] = {}
        # (namespace, chunk, tier) -> ranks that reported the write; bounded like _blocks (a rank that never
        # reports its shard leaves an entry behind)
        self._landed: RecentMap[tuple[str, str, str], set[int]] = RecentMap(_CHUNKS_KEPT)
        self._events: list[KVCacheEvent] = []
        self.unnamed = 0  # reports of chunks whose blocks were no longer remembered (no event)

    def register(self, request: Request, namespace: Namespace, tokens: Sequence[int]) -> None:
        """Remember the blocks of ``tokens``' whole chunks and tail (a save or a load of ``request`` names them)."""
        if getattr(request, "mm_features", None):
            return  # multimodal blocks carry extra keys that kvtier does not name: announce none
        hashes = request.block_hashes
        per_chunk = self._chunk // self._bs
        n_blocks = min(len(tokens) // self._bs, len(hashes))
        if n_blocks * self._bs < len(tokens):  # blocks without hashes yet: the whole chunks before them
            n_blocks = n_blocks // per_chunk * per_chunk
        if n_blocks == 0:
            return
        lora = request.lora_request.name if request.lora_request is not None else None
        lora_id = request.lora_request.adapter_id if request.lora_request is not None else None
        salt = request.cache_salt or None
        ids = np.asarray(tokens[:n_blocks * self._bs], dtype=np.int64)
        namespace = self._names(namespace)
        for i, key in enumerate(chunk_keys(namespace, ids, self._chunk, tail=True)):
            name = (namespace.id, key.hex())
            if self._blocks.touch(name):
                continue
            first = i * per_chunk
            count = min(per_chunk, n_blocks - first)  # fewer in a tail
            extra: list[tuple[Any, ...] | None] | None = None
            if lora or salt:
                extra = [tuple([lora] if lora else []) + ((salt,) if salt and first + j == 0 else ()) or None
                         for j in range(count)]
            self._blocks[name] = _Blocks(
                hashes=[maybe_convert_block_hash(h) for h in hashes[first:first + count]],
                parent=maybe_convert_block_hash(hashes[first - 1]) if first else None,
                tokens=ids[i * self._chunk:i * self._chunk + count * self._bs].astype(np.int32), lora_name=lora,
                lora_id=lora_id, extra_keys=extra)

    def apply(self, dram: Sequence[DramChange], report: object) -> None:
        """Events for a step's reports: ``dram`` as :meth:`WorkerDram.apply` returned it (chunks every rank now
        holds, or no longer all hold), and the tier writes in ``report``."""
        for namespace, chunk, held in dram:
            if not held:
                hashes = self._in_dram.pop((namespace, chunk), None)
                if hashes is not None:
                    self._events.append(BlockRemoved(block_hashes=hashes, medium="CPU", group_idx=0,
                                                     locality="LOCAL", ownership=f"kvtier:{DRAM}"))
                continue
            blocks = self._named(namespace, chunk)
            if blocks is not None and (namespace, chunk) not in self._in_dram:
                self._in_dram[(namespace, chunk)] = blocks.hashes
                self._events.append(self._stored(blocks, "CPU", "LOCAL", DRAM))
        if not isinstance(report, KVTierWorkerMetadata):
            return
        for namespace, chunk, rank, place, _ in report.events:
            if place == DRAM or place not in self._locality:
                continue
            landed = (namespace, chunk, place)
            ranks = self._landed.get(landed)
            if ranks is None:
                ranks = self._landed[landed] = set()
            ranks.add(rank)
            if len(ranks) < self._tp:
                continue
            del self._landed[landed]
            blocks = self._named(namespace, chunk)
            if blocks is not None:
                self._events.append(self._stored(blocks, "STORAGE", self._locality[place], place))

    def _named(self, namespace: str, chunk: str) -> _Blocks | None:
        blocks = self._blocks.get((namespace, chunk))
        if blocks is None:
            self.unnamed += 1
        return blocks

    def _stored(self, blocks: _Blocks, medium: str, locality: str, tier: str) -> BlockStored:
        return BlockStored(block_hashes=blocks.hashes, parent_block_hash=blocks.parent,
                           token_ids=blocks.tokens.tolist(), block_size=self._bs, lora_id=blocks.lora_id,
                           medium=medium, lora_name=blocks.lora_name, extra_keys=blocks.extra_keys, group_idx=0,
                           locality=locality, ownership=f"kvtier:{tier}")

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
