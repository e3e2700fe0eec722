"""What the connector's two sides send each other, through vLLM, once per engine step (plain data, no behaviour).

- scheduler -> workers: :class:`KVTierMetadata`, the step's plan of :class:`Transfer` s (loads and saves) and the
  blocks to report failed;
- workers -> scheduler: :class:`KVTierWorkerMetadata`, what each rank's DRAM came to hold or lost and what the
  cascade wrote into each secondary tier (:class:`Event` s), and the step each rank ran.

vLLM pickles both between its processes (the API server's engine core and its workers), so both sides must
import them from here, and they carry only values.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.keys import Namespace

DRAM = "dram"  # an Event's place for the rank's DRAM; any other place is a secondary tier's name


@dataclasses.dataclass
class Transfer:
    """Move ``tokens[offset:]`` (whole chunks, then perhaps a tail) between the store and ``block_ids``, the
    blocks of the tokens from the start: a load fills ``block_ids[offset // block_size:]``, which may end inside
    the last chunk."""

    request_id: str
    namespace: Namespace
    tokens: list[int]
    block_ids: list[int]
    offset: int
    # A load that may wait on a server (some chunk is held only across a network): the worker runs it on a
    # thread of its own and reports it finished later (vLLM's asynchronous load), so the step does not wait.
    asynchronous: bool = False
    trace: dict[str, str] | None = None  # the request's W3C trace headers: the worker's span joins its trace
    # A P/D prefill's save: a decode engine waits for it, so the cascade keeps it within a budget of its own
    # (never dropped for a full queue) and writes it before ordinary saves
    handoff: bool = False


@dataclasses.dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's plan. ``invalid``: blocks promised to vLLM as loaded that no load fills (the scheduler side
    failed while planning them); workers report them as load errors, so vLLM recomputes them."""

    loads: list[Transfer] = dataclasses.field(default_factory=list)
    saves: list[Transfer] = dataclasses.field(default_factory=list)
    invalid: list[int] = dataclasses.field(default_factory=list)
    # Asynchronous loads promised to vLLM that no load fills (planning failed): request -> its blocks. Workers
    # report each finished at once, its blocks failed (vLLM waits for the finish, else forever).
    abandoned: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    step: int = 0  # this metadata's number: workers report the last they ran (KVTierWorkerMetadata.steps)
    idle: bool = False  # the step runs no model (e.g. every request waits for an asynchronous load)
    # Requests that ended with vLLM keeping their blocks for a save (P/D prefills): every worker reports them
    # finished (sending, through get_finished) once it ran this step's saves
    released: list[str] = dataclasses.field(default_factory=list)


class Event(NamedTuple):
    """A chunk's shard of one rank's heads that came to be held in ``place`` (``held``), or no longer is. A
    secondary tier's shards are reported once, when written (a tier's own evictions are not seen)."""

    namespace: str  # the namespace's id
    chunk: str  # the chunk key, in hex
    rank: int  # tensor-parallel rank
    place: str  # DRAM or a secondary tier's name
    held: bool


@dataclasses.dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's changes to the workers' DRAM, in order per rank, and the step each rank ran (its loads done,
    their failures reported with this output)."""

    events: list[Event] = dataclasses.field(default_factory=list)
    steps: dict[int, int] = dataclasses.field(default_factory=dict)  # tensor-parallel rank -> step

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata), f"cannot aggregate {type(other).__name__}"
        return KVTierWorkerMetadata(self.events + other.events, {**self.steps, **other.steps})
