"""The vLLM connector's worker side: moves bytes between the engine's paged KV cache and the store.

Loads from DRAM and local tiers run in ``start_load_kv``, before the forward pass; a load that may wait on a
server (the scheduler marks it asynchronous) runs on a load thread while the steps go on, and is reported
finished through ``get_finished``, with its failed blocks among that step's load errors. Saves run in
``wait_for_save``, after the forward pass, straight from the paged blocks into DRAM (the store cascades to
secondary tiers in the background).
Each load or save that fails is contained on its own: a failed load becomes load errors (vLLM recomputes those
blocks), a failed save is dropped; both are counted. Layouts are converted by
:mod:`kvtier.integrations.layouts`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from kvtier import tracing
from kvtier.errors import ConfigError
from kvtier.integrations.copies import LayerCopies, spare_cores
from kvtier.integrations.layouts import Layout, gather_chunks, kv_shape, scatter_chunks
from kvtier.integrations.vllm._dram_index import DramReport
from kvtier.integrations.vllm._shared import ConnectorMetrics
from kvtier.integrations.vllm._wire import KVTierMetadata, KVTierWorkerMetadata, Transfer
from kvtier.keys import rank_heads
from kvtier.store import KVStore
from kvtier.threads import IDLE_WAIT_SECONDS, DaemonPool

log = logging.getLogger("kvtier.integrations.vllm")

TensorParallel = Callable[[], tuple[int, int]]  # -> (rank, size)
LOAD_THREADS = 2  # asynchronous loads in flight at once; the rest wait in order (none is ever dropped)


class WorkerSide:
    """The engine's KV caches, and the loads and saves of each step."""

    def __init__(self, store: KVStore, metrics: ConnectorMetrics, *, block_size: int, kv_heads: int,
                 report_tier_writes: bool = False) -> None:
        self._store = store
        self._report_tier_writes = report_tier_writes  # for kvtier's KV events: only when vLLM publishes them
        self._metrics = metrics
        self._chunk = store.chunk_tokens
        self._bs = block_size
        self._kv_heads = kv_heads  # the model's, so replicated heads are stored by their real index
        self._caches: list[torch.Tensor] = []
        self._layout: Layout = "cpu"
        self._load_errors: set[int] = set()  # reported to vLLM, then cleared
        self._failed: set[int] = set()  # this step's failed blocks: saves over them would store wrong KV
        self._report: DramReport | None = None  # from registration on: a worker role exists in this process
        self._background = DaemonPool("kvtier-load", LOAD_THREADS)
        self._copies = LayerCopies(0)  # split over the spare cores once the caches are known (register)
        # request -> (its blocks, its load's outcome: the blocks it failed), until reported finished
        self._async: dict[str, tuple[set[int], Future[set[int]]]] = {}
        self._step = 0  # the last metadata's step whose loads ran here
        self._idle = False  # that step runs no model

    def register(self, kv_caches: dict[str, torch.Tensor], tp: TensorParallel) -> None:
        def layer_index(name: str) -> tuple[int, str]:
            digits = [int(p) for p in name.split(".") if p.isdigit()]
            return (digits[0] if digits else 0, name)

        self._caches = [kv_caches[name] for name in sorted(kv_caches, key=layer_index)]
        first = self._caches[0]
        if first.dim() == 4:
            self._layout = "cpu"
        elif first.dim() == 5 and first.shape[0] == 2:
            self._layout = "flash"
        else:
            raise ValueError(f"KVTierConnector: unsupported KV cache layout {tuple(first.shape)}; supported: "
                             "[blocks, kv_heads, block_size, 2*head_dim] (CPU) and "
                             "[2, blocks, block_size, kv_heads, head_dim] (flash attention)")
        self._copies = LayerCopies(spare_cores() if first.device.type == "cpu" else 0)
        if self._copies.helpers:
            log.info("kvtier: loads and saves copy on %d more thread(s) beside the engine's", self._copies.helpers)
        # Checked once here: a mismatch would otherwise fail every save and load, each contained and counted.
        rank, size = tp()
        if size > 1:  # each rank's process serves its own metrics
            self._store.metrics.process_labels["tp_rank"] = str(rank)
        self._report = DramReport(self._store, self._kv_heads, tier_writes=self._report_tier_writes)
        heads, want = kv_shape(self._caches, self._layout, 0)[2], rank_heads(self._kv_heads, rank, size).count
        if heads != want:
            raise ConfigError(f"KVTierConnector: rank {rank} of {size} holds {heads} KV heads, but a model with "
                              f"{self._kv_heads} KV heads gives each rank {want}; unsupported attention layout")

    # -- loads -----------------------------------------------------------------------------------------------
    def load(self, meta: KVTierMetadata, tp: TensorParallel) -> None:
        self._step = meta.step
        self._idle = meta.idle
        self._failed = set(meta.invalid)
        if meta.loads:
            try:
                rank, size = tp()
            except Exception as exc:  # noqa: BLE001 contained: counted, logged once
                self.fail(meta, exc)
                return
            for load in meta.loads:
                if load.asynchronous:
                    self._async[load.request_id] = (self._promised(load), self._background.submit(
                        functools.partial(self._failed_blocks, load, rank, size, background=True)))
                else:
                    self._failed |= self._failed_blocks(load, rank, size, background=False)
        self._abandon(meta)
        self._load_errors |= self._failed

    def _promised(self, load: Transfer) -> set[int]:
        return set(load.block_ids[load.offset // self._bs:])

    def _abandon(self, meta: KVTierMetadata) -> None:
        """Asynchronous loads that will not run: reported finished at the next chance, every block failed."""
        for rid, blocks in meta.abandoned.items():
            if rid not in self._async:
                failed: Future[set[int]] = Future()
                failed.set_result(set(blocks))
                self._async[rid] = (set(blocks), failed)

    def _failed_blocks(self, load: Transfer, rank: int, size: int, *, background: bool) -> set[int]:
        """Run one load; the blocks it did not fill (vLLM recomputes them). Never raises.

        A load in the step (``background`` False) reads DRAM and local tiers only: its lookup found every chunk
        there, and one evicted since is recomputed rather than read from a server the step would wait on."""
        start = time.perf_counter()
        with tracing.span("kvtier.connector.load", tracing.context_of(load.trace), request_id=load.request_id,
                          tokens=len(load.block_ids) * self._bs - load.offset, asynchronous=background) as span:
            try:
                end = self._load(load, rank, size, local_only=not background)
                if background and self._caches[0].is_cuda:  # reported finished only once the copies have landed
                    torch.cuda.current_stream(self._caches[0].device).synchronize()
                failed = set(load.block_ids[end // self._bs:])
                self._metrics.loaded_tokens.inc(end - load.offset)
            except Exception as exc:  # noqa: BLE001 contained: counted, logged once
                self._metrics.error("start_load_kv", exc, load.request_id)
                failed = self._promised(load)
            self._metrics.load_failed_blocks.inc(len(failed))
            self._metrics.load_seconds.observe(time.perf_counter() - start)
            if span is not None:
                span.set_attribute("failed_blocks", len(failed))
        return failed

    def finished_loads(self, finished_requests: set[str]) -> set[str]:
        """Requests whose asynchronous loads ended since the last call; their failed blocks join the load errors
        reported with them (vLLM wants them no later than the finish). Loads of ``finished_requests`` (aborted)
        that have not started are cancelled: reported finished at once."""
        for rid in finished_requests & self._async.keys():
            self._async[rid][1].cancel()
        if self._idle and self._async:  # nothing else to do this step: let the load threads have the GIL
            wait([future for _, future in self._async.values()], IDLE_WAIT_SECONDS, FIRST_COMPLETED)
        done = {rid for rid, (_, future) in self._async.items() if future.done()}
        for rid in done:
            blocks, future = self._async.pop(rid)
            try:
                self._load_errors |= future.result()
            except BaseException:  # noqa: BLE001 cancelled (its request was aborted); _failed_blocks itself never raises
                self._load_errors |= blocks
        return done

    def fail(self, meta: KVTierMetadata, exc: BaseException) -> None:
        """Report every block this step should have loaded as failed."""
        self._metrics.error("start_load_kv", exc)
        self._failed = set(meta.invalid)
        self._step = meta.step  # its loads are all reported failed: this step is reported all the same
        for load in meta.loads:
            if load.request_id in self._async:
                continue  # on a load thread already: it reports itself
            if load.asynchronous:  # vLLM waits for it to be reported finished, failed or not
                failed: Future[set[int]] = Future()
                failed.set_result(self._promised(load))
                self._async[load.request_id] = (self._promised(load), failed)
            else:
                self._failed |= self._promised(load)
        self._abandon(meta)
        self._load_errors |= self._failed

    def _load(self, load: Transfer, rank: int, size: int, *, local_only: bool = False) -> int:
        """Copy the stored chunks straight from the store's DRAM (or a tier's read buffer) into the blocks; returns
        the first token not loaded (``len(load.block_ids) * block_size`` when all were): the chunks before a missing
        one load."""
        t, bs = self._chunk, self._bs
        from_chunk = load.offset // t * t
        stop = len(load.block_ids) * bs  # the hit may end inside the last chunk

        def sink(first: int, kv: torch.Tensor) -> None:
            start = from_chunk + first * t  # the first token of these chunks
            skip = max(load.offset - start, 0)  # computed by the engine already (its own prefix-cache hit)
            end = min(start + kv.shape[0] * t, stop)
            ids = load.block_ids[(start + skip) // bs:end // bs]
            self._copies.run(lambda s: scatter_chunks(kv[:, s], self._caches[s], ids, self._layout, skip),
                             len(self._caches))

        _, _, _, _, head_dim = kv_shape(self._caches, self._layout, 0)
        loaded = from_chunk + self._store.load(
            load.namespace, load.tokens, sink, layers=len(self._caches), head_dim=head_dim,
            dtype=self._caches[0].dtype, tp_rank=rank, tp_size=size, offset=from_chunk, kv_heads=self._kv_heads,
            device=self._caches[0].device, local_only=local_only, tail=True)
        end = max(min(loaded, stop), load.offset)
        if end < stop:
            log.warning("kvtier: request %s: KV for %d of %d tokens vanished before loading; vLLM recomputes them",
                        load.request_id, stop - end, stop - load.offset)
        return end

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- what the scheduler learns of this worker's DRAM ------------------------------------------------------
    def dram_report(self, tp: TensorParallel) -> KVTierWorkerMetadata | None:
        if self._report is None:
            return None
        rank, size = tp()
        return self._report.take(rank, size, self._step)

    # -- saves -----------------------------------------------------------------------------------------------
    def save(self, meta: KVTierMetadata, tp: TensorParallel) -> None:
        failed, self._failed = self._failed, set()
        if not meta.saves:
            return
        rank, size = tp()
        for save in meta.saves:
            if not failed.isdisjoint(save.block_ids):
                continue  # computed over blocks that failed to load; saved once vLLM has recomputed them
            with tracing.span("kvtier.connector.save", tracing.context_of(save.trace), request_id=save.request_id,
                              tokens=len(save.tokens)) as span:
                try:
                    saved = self._save(save, rank, size)
                except Exception as exc:  # noqa: BLE001 contained: counted, logged once
                    self._metrics.error("wait_for_save", exc, save.request_id)
                    continue
                self._metrics.saved_tokens.inc(saved)
                if span is not None:
                    span.set_attribute("saved_tokens", saved)

    def _save(self, save: Transfer, rank: int, size: int) -> int:
        """Put what the store does not hold of the save; the number of tokens put."""
        # Gather only what the store does not hold: after vLLM's own prefix-cache hit, or a load, that is
        # often nothing, and a put of held chunks would only copy them again.
        held = self._store.held(save.namespace, save.tokens, tp_rank=rank, tp_size=size, kv_heads=self._kv_heads,
                                tail=True)
        start = max(save.offset, held)
        if start >= len(save.tokens):
            return 0
        per = self._chunk // self._bs
        blocks = save.block_ids[start // self._bs:]

        def source(first: int, dst: torch.Tensor) -> None:  # straight from the paged blocks into DRAM pages
            ids = blocks[first * per:(first + dst.shape[0]) * per]
            self._copies.run(lambda s: gather_chunks(self._caches[s], ids, self._layout, dst[:, s]),
                             len(self._caches))

        layers, _, _, _, head_dim = kv_shape(self._caches, self._layout, 0)
        stored_to = self._store.put_from(save.namespace, save.tokens, source, layers=layers, head_dim=head_dim,
                                         dtype=self._caches[0].dtype, tp_rank=rank, tp_size=size, offset=start,
                                         kv_heads=self._kv_heads, device=self._caches[0].device, tail=True)
        return max(stored_to - start, 0)
