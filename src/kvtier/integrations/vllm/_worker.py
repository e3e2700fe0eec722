"""The vLLM connector's worker side: moves bytes between the engine's paged KV cache and the store.

Loads from DRAM and local tiers are in the step: where a core is spare (a CPU engine computing on one thread),
``start_load_kv`` hands them to a loader thread, which plans them and copies them into the blocks layer by layer
while the forward pass runs, and each layer's attention waits in ``wait_for_layer_load`` for that layer's copies
only; elsewhere they run in ``start_load_kv``, before the forward pass. A load that may wait on a server (the
scheduler marks it asynchronous) runs on a load thread while the steps go on, and is reported finished through
``get_finished``, with its failed blocks among that step's load errors. Saves run in
``wait_for_save``, after the forward pass, straight from the paged blocks into DRAM (the store cascades to
secondary tiers in the background).
Each load or save that fails is contained on its own: a failed load becomes load errors (vLLM recomputes those
blocks), a failed save is dropped; both are counted. Layouts are converted by
:mod:`kvtier.integrations.layouts`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from kvtier import tracing
from kvtier.errors import ConfigError
from kvtier.health import FirstOfKind
from kvtier.integrations.copies import LayerCopies, spare_cores
from kvtier.integrations.layouts import Layout, Scatter, gather_chunks, kv_shape
from kvtier.integrations.vllm._dram_index import DramReport
from kvtier.integrations.vllm._shared import ConnectorMetrics
from kvtier.integrations.vllm._wire import KVTierMetadata, KVTierWorkerMetadata, Transfer
from kvtier.keys import rank_heads
from kvtier.store import KVStore, Loaded
from kvtier.threads import IDLE_WAIT_SECONDS, DaemonPool

log = logging.getLogger("kvtier.integrations.vllm")

TensorParallel = Callable[[], tuple[int, int]]  # -> (rank, size)
LOAD_THREADS = 2  # asynchronous loads in flight at once; the rest wait in order (none is ever dropped)


def _copy_layer(dsts: list[torch.Tensor], srcs: list[torch.Tensor], rest: list[Scatter], layer: int,
                copies: LayerCopies) -> None:
    """One layer's copies: the strided ones in one call a thread (over the loader and ``copies``' helpers), then
    any that need a conversion first."""
    if dsts:  # (torch refuses an empty list: every load of the step failed to plan)
        copies.run(lambda part: torch._foreach_copy_(dsts[part], srcs[part]), len(dsts))
    for scatter in rest:
        scatter.layers(slice(layer, layer + 1))


@dataclasses.dataclass
class _Planned:
    """One in-step load planned on the loader thread."""

    load: Transfer
    end: int  # the first token it fills no block for
    loaded: Loaded | None  # what the store found (None: planning failed)
    scatters: list[Scatter]  # its copies
    from_chunk: int = 0  # the first token of its first chunk


@dataclasses.dataclass(frozen=True)
class _Layered:
    """A step's in-step loads, copied layer by layer on the loader thread while the forward pass runs."""

    ready: list[threading.Event]  # layer i's copies have ended (set for every layer once the job ends, however)
    failed: Future[set[int]]  # the blocks the loads did not fill
    promised: set[int]  # every block they were to fill (failed, if the job itself failed)


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
        self._loader: DaemonPool | None = None  # copies in-step loads layer by layer, where a core is spare
        self._layer_of: dict[str, int] = {}  # vLLM's layer name -> its cache's index
        self._layered: _Layered | None = None  # this step's in-step loads, on the loader thread
        self._layer_helpers = LayerCopies(0)  # split each layer's copies beside the loader, where cores allow
        self._logged_names = FirstOfKind()
        # request -> (its blocks, its load's outcome: the blocks it failed), until reported finished
        self._async: dict[str, tuple[set[int], Future[set[int]]]] = {}
        self._step = 0  # the last metadata's step whose loads ran here
        self._idle = False  # that step runs no model

    def register(self, kv_caches: dict[str, torch.Tensor], tp: TensorParallel) -> None:
        def layer_index(name: str) -> tuple[int, str]:
            digits = [int(p) for p in name.split(".") if p.isdigit()]
            return (digits[0] if digits else 0, name)

        names = sorted(kv_caches, key=layer_index)
        self._caches = [kv_caches[name] for name in names]
        self._layer_of = {name: i for i, name in enumerate(names)}
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
            self._loader = DaemonPool("kvtier-layers", 1)
            # The loader takes one spare core; each layer's copies are split with the others, if any (unmeasured:
            # on 2 cores there are none, and one thread's copies keep ahead of the forward pass there).
            self._layer_helpers = LayerCopies(self._copies.helpers - 1)
            log.info("kvtier: loads copy layer by layer beside the forward pass; saves copy on %d more thread(s) "
                     "beside the engine's", self._copies.helpers)
        # Checked once here: a mismatch would otherwise fail every save and load, each contained and counted.
        rank, size = tp()
        if size > 1:  # each rank's process serves its own metrics
            self._store.metrics.process_labels["tp_rank"] = str(rank)
        self._report = DramReport(self._store, self._kv_heads, tier_writes=self._report_tier_writes)
        heads, want = kv_shape(self._caches, self._layout, 0)[2], rank_heads(self._kv_heads, rank, size).count
        if heads != want:
            raise ConfigError(f"KVTierConnector: rank {rank} of {size} holds {heads} KV heads, but a model with "
                              f"{self._kv_heads} KV heads gives each rank {want}; unsupported attention layout")

    def close(self) -> None:
        """At the engine's shutdown: wait for a step's loads still copying (their pins are released then), and let
        every thread of this worker end once its work is done."""
        try:
            self._join_layers()
        finally:
            for pool in (self._loader, self._background):
                if pool is not None:
                    pool.close()
            self._copies.close()
            self._layer_helpers.close()

    # -- loads -----------------------------------------------------------------------------------------------
    def load(self, meta: KVTierMetadata, tp: TensorParallel) -> None:
        self._join_layers()  # the last step's (joined at its save already, unless vLLM skipped it)
        self._step = meta.step
        self._idle = meta.idle
        self._failed = set(meta.invalid)
        if meta.loads:
            try:
                rank, size = tp()
            except Exception as exc:  # noqa: BLE001 contained: counted, logged once
                self.fail(meta, exc)
                return
            in_step: list[Transfer] = []
            for load in meta.loads:
                if load.asynchronous:
                    self._async[load.request_id] = (self._promised(load), self._background.submit(
                        functools.partial(self._failed_blocks, load, rank, size, background=True)))
                else:
                    in_step.append(load)
            if in_step and not self._start_layers(in_step, rank, size):
                for load in in_step:
                    self._failed |= self._failed_blocks(load, rank, size, background=False)
        self._abandon(meta)
        self._load_errors |= self._failed

    # -- in-step loads, layer by layer beside the forward pass -----------------------------------------------
    @property
    def by_layers(self) -> bool:
        return self._loader is not None

    def _start_layers(self, loads: list[Transfer], rank: int, size: int) -> bool:
        """Hand the step's in-step loads to the loader thread; False (the caller loads them here) where there is
        none, or it could not take them."""
        if self._loader is None:
            return False
        ready = [threading.Event() for _ in self._caches]
        promised = set().union(*(self._promised(load) for load in loads))
        try:
            failed = self._loader.submit(functools.partial(self._by_layers, loads, rank, size, ready))
        except Exception as exc:  # noqa: BLE001 contained: counted, logged once; loaded here instead
            self._metrics.error("start_load_kv", exc)
            return False
        self._layered = _Layered(ready, failed, promised)
        return True

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once the step's in-step loads have copied the layer ``layer_name`` (every layer, for a name the
        caches were not registered under)."""
        layered = self._layered
        if layered is None:
            return
        try:
            layer = self._layer_of.get(layer_name)
            if layer is None and self._logged_names.first("layer", layer_name):
                log.warning("kvtier: vLLM waits for layer %r, which holds no registered KV cache; it waits for "
                            "every layer's load", layer_name)
            for event in layered.ready if layer is None else [layered.ready[layer]]:
                event.wait()
        except BaseException:  # the layer may be read half copied: every block the loads fill is recomputed
            self._failed |= layered.promised
            self._load_errors |= layered.promised
            raise

    def _join_layers(self) -> None:
        """Wait for the step's in-step loads to end; the blocks they did not fill join its failures."""
        layered, self._layered = self._layered, None
        if layered is None:
            return
        try:
            failed = layered.failed.result()
        except Exception as exc:  # noqa: BLE001 _by_layers never raises; this is the wait itself failing
            self._metrics.error("start_load_kv", exc)
            failed = layered.promised
        except BaseException:  # interrupted: the job may still write its blocks, which vLLM must recompute
            self._failed |= layered.promised
            self._load_errors |= layered.promised
            raise
        self._failed |= failed
        self._load_errors |= failed

    def _by_layers(self, loads: list[Transfer], rank: int, size: int, ready: list[threading.Event]) -> set[int]:
        """On the loader thread: plan every load (pinning what it reads), then copy them layer by layer, marking
        each layer ready once its copies have ended; the blocks not filled. Never raises, and leaves every layer
        marked ready however it ends (the forward pass waits on them)."""
        start = time.perf_counter()
        failed: set[int] = set()
        planned: list[_Planned] = []
        copied = False
        try:
            with contextlib.ExitStack() as held:
                for load in loads:
                    span = held.enter_context(tracing.span(
                        "kvtier.connector.load", tracing.context_of(load.trace), request_id=load.request_id,
                        tokens=len(load.block_ids) * self._bs - load.offset, asynchronous=False, by_layers=True))
                    try:
                        plan = self._open(held, load, rank, size)
                    except Exception as exc:  # noqa: BLE001 contained: counted, logged once
                        self._metrics.error("start_load_kv", exc, load.request_id)
                        plan = _Planned(load, load.offset, None, [])
                    lost = set(load.block_ids[plan.end // self._bs:])
                    failed |= lost
                    if span is not None:
                        span.set_attribute("failed_blocks", len(lost))
                    planned.append(plan)
                with torch.inference_mode():  # vLLM's caches are written in place only in it (per thread)
                    copies = self._layer_copies([s for plan in planned for s in plan.scatters])
                    for layer, (copy, event) in enumerate(zip(copies, ready, strict=True)):
                        for plan in planned:  # shards on a local disk: this layer read now, beside the forward pass
                            if plan.loaded is not None:
                                plan.loaded.read_layer(layer)
                        copy()
                        event.set()
                for plan in planned:  # a shard that failed its checksum: its blocks were copied, vLLM recomputes them
                    verified = plan.loaded.verified() if plan.loaded is not None else 0
                    if plan.loaded is not None and verified < plan.loaded.tokens:
                        # (the tier's guard logged why; the blocks from that chunk on are recomputed)
                        good = max(min(plan.from_chunk + verified, plan.end), plan.load.offset)
                        failed |= set(plan.load.block_ids[good // self._bs:])
                        plan.end = good
                copied = True
        except Exception as exc:  # noqa: BLE001 contained: counted, logged once; unless copied, all recomputed
            self._metrics.error("start_load_kv", exc, loads[0].request_id)
            if not copied:
                planned = [_Planned(load, load.offset, None, []) for load in loads]
                failed = set().union(*(self._promised(load) for load in loads))
        finally:
            for event in ready:
                event.set()
        seconds = time.perf_counter() - start
        for plan in planned:
            self._metrics.loaded_tokens.inc(plan.end - plan.load.offset)
            self._metrics.load_failed_blocks.inc(len(plan.load.block_ids) - plan.end // self._bs)
            self._metrics.load_seconds.observe(seconds)
        return failed

    def _layer_copies(self, scatters: list[Scatter]) -> list[Callable[[], None]]:
        """Each layer's copies for all ``scatters``, as one call a layer. Their views are made first, before any
        is copied: the engine's thread, waiting for the first layer meanwhile, then shares the GIL with one call a
        layer on this thread (a Python step per copy, each taking the GIL back from the forward pass, slowed it
        more than the copies themselves)."""
        calls: list[Callable[[], None]] = []
        for layer in range(len(self._caches)):
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            rest: list[Scatter] = []
            for scatter in scatters:
                pairs = scatter.pairs(layer)
                if pairs is None:
                    rest.append(scatter)
                else:
                    dsts += pairs[0]
                    srcs += pairs[1]
            calls.append(functools.partial(_copy_layer, dsts, srcs, rest, layer, self._layer_helpers))
        return calls

    def _open(self, held: contextlib.ExitStack, load: Transfer, rank: int, size: int) -> _Planned:
        """Plan one in-step load, pinning what it reads until ``held`` closes (shards on a local disk are opened,
        read later a layer at a time): where its copies end, and them."""
        from_chunk = load.offset // self._chunk * self._chunk
        _, _, _, _, head_dim = kv_shape(self._caches, self._layout, 0)
        loaded = held.enter_context(self._store.loading(
            load.namespace, load.tokens, layers=len(self._caches), head_dim=head_dim, dtype=self._caches[0].dtype,
            tp_rank=rank, tp_size=size, offset=from_chunk, kv_heads=self._kv_heads, device=self._caches[0].device,
            local_only=True, tail=True, by_layers=True))
        scatters = [self._scatter(load, from_chunk, first, kv) for first, kv in loaded.views]
        return _Planned(load, self._loaded_to(load, from_chunk + loaded.tokens), loaded, scatters, from_chunk)

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
                end = self._load(load, rank, size, background=background)
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
        self._join_layers()  # a load already handed to the loader thread writes its blocks: waited for first
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

    def _load(self, load: Transfer, rank: int, size: int, *, background: bool = False) -> int:
        """Copy the stored chunks straight from the store's DRAM (or a tier's read buffer) into the blocks; returns
        the first token not loaded (``len(load.block_ids) * block_size`` when all were): the chunks before a missing
        one load. In the step: DRAM and local tiers only. In the background (from a server): streamed."""
        from_chunk = load.offset // self._chunk * self._chunk

        def sink(first: int, kv: torch.Tensor) -> None:
            self._copies.run(self._scatter(load, from_chunk, first, kv).layers, len(self._caches))

        _, _, _, _, head_dim = kv_shape(self._caches, self._layout, 0)
        loaded = from_chunk + self._store.load(
            load.namespace, load.tokens, sink, layers=len(self._caches), head_dim=head_dim,
            dtype=self._caches[0].dtype, tp_rank=rank, tp_size=size, offset=from_chunk, kv_heads=self._kv_heads,
            device=self._caches[0].device, local_only=not background, tail=True, streamed=background)
        return self._loaded_to(load, loaded)

    def _scatter(self, load: Transfer, from_chunk: int, first: int, kv: torch.Tensor) -> Scatter:
        """The copies of ``kv`` (chunks from chunk ``first``, counted from the token ``from_chunk``) into the load's
        blocks: those after the engine's own hit and before the load's end."""
        t, bs = self._chunk, self._bs
        start = from_chunk + first * t  # the first token of these chunks
        skip = max(load.offset - start, 0)  # computed by the engine already (its own prefix-cache hit)
        end = min(start + kv.shape[0] * t, len(load.block_ids) * bs)  # the hit may end inside the last chunk
        return Scatter(kv, self._caches, load.block_ids[(start + skip) // bs:end // bs], self._layout, skip)

    def _loaded_to(self, load: Transfer, loaded: int) -> int:
        """The first token a load filled no block for, having read up to the token ``loaded``."""
        stop = len(load.block_ids) * self._bs
        end = max(min(loaded, stop), load.offset)
        if end < stop:
            log.warning("kvtier: request %s: KV for %d of %d tokens vanished before loading; vLLM recomputes them",
                        load.request_id, stop - end, stop - load.offset)
        return end

    def take_load_errors(self) -> set[int]:
        self._join_layers()
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
        self._join_layers()  # its failures first: no save stores KV computed over blocks it did not fill
        failed, self._failed = self._failed, set()
        rank, size = tp() if meta.saves else (0, 1)
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
        first = save.offset if save.handoff else start  # a handoff's held chunks go to the tiers again (writes.py)
        if first >= len(save.tokens):
            return 0
        per = self._chunk // self._bs
        blocks = save.block_ids[first // self._bs:]

        def source(first: int, dst: torch.Tensor) -> None:  # straight from the paged blocks into DRAM pages
            ids = blocks[first * per:(first + dst.shape[0]) * per]
            self._copies.run(lambda s: gather_chunks(self._caches[s], ids, self._layout, dst[:, s]),
                             len(self._caches))

        layers, _, _, _, head_dim = kv_shape(self._caches, self._layout, 0)
        stored_to = self._store.put_from(save.namespace, save.tokens, source, layers=layers, head_dim=head_dim,
                                         dtype=self._caches[0].dtype, tp_rank=rank, tp_size=size, offset=first,
                                         kv_heads=self._kv_heads, device=self._caches[0].device, tail=True,
                                         handoff=save.handoff)
        return max(stored_to - start, 0)
