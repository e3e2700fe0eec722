"""The vLLM connector's scheduler side: decides what each engine step loads and saves (no bytes move here).

Per request it looks up the whole chunks beyond vLLM's own prefix-cache hit (and a tail: the prompt's whole
blocks after its last whole chunk, see :func:`kvtier.keys.tail_keys`), plans a load into the blocks vLLM
allocated for them, and plans one save of the prompt's whole chunks and tail once the step that computes the
last of them runs. The plans reach the workers as :class:`KVTierMetadata` (:mod:`._wire`); what a worker reports
back (blocks whose load failed) re-plans a save. Which chunks a save really writes is the worker's call
(``store.held``), since only it sees the DRAM its loads filled. Lookups also count the chunks the workers report
their DRAM holds (:mod:`._dram_index`): in vLLM's API server that DRAM is in other processes. A request that
is one side of a disaggregated prefill/decode handoff (:mod:`._pd`) is a prefill whose save is a handoff and
whose end tells the router what it stored, or a decode whose lookup waits for that KV to be visible.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from kvtier import tracing
from kvtier.integrations.vllm._dram_index import WorkerDram
from kvtier.integrations.vllm._events import KVEvents
from kvtier.integrations.vllm._lookups import Lookups
from kvtier.integrations.vllm._namespace import Namespaces, Skip
from kvtier.integrations.vllm._pd import Handoffs
from kvtier.integrations.vllm._shared import ConnectorMetrics
from kvtier.integrations.vllm._wire import KVTierMetadata, KVTierWorkerMetadata, Transfer
from kvtier.keys import Namespace
from kvtier.store import KVStore
from kvtier.threads import IDLE_WAIT_SECONDS

RELEASE_STEPS = 64  # steps a P/D prefill's blocks are kept for a save put off, at most

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclasses.dataclass(frozen=True)
class _Hit:
    """A lookup's promise, kept until vLLM allocates the request's blocks."""

    computed: int  # vLLM's own prefix-cache hit: the load starts there
    tokens: list[int]
    stored: int  # the tokens the store holds (whole chunks, then perhaps a tail): the load names those chunks
    asynchronous: bool


@dataclasses.dataclass
class _Tracked:
    """A running request, as the scheduler side follows it."""

    namespace: Namespace
    tokens: list[int]
    block_ids: list[int]
    saved: bool = False
    deferred: bool = False  # its save was due, and put off over blocks a worker had not reported loading


class SchedulerSide:
    """Lookups and plans. Each hook raises what it cannot handle; the connector contains it."""

    def __init__(self, store: KVStore, namespaces: Namespaces, metrics: ConnectorMetrics, *, block_size: int,
                 kv_heads: int, workers: int, tp_size: int, lookup_timeout: float, events: bool = False,
                 tails: bool = True, pd_wait_max: float = 10.0) -> None:
        self._store = store
        # kvtier's KV events, published with the engine's when vLLM publishes events
        self._events = KVEvents(store.tiers, tp_size, block_size, store.chunk_tokens,
                                store.named) if events else None
        self._requests: dict[str, Request] = {}  # looked up and not finished: their block hashes name events
        self._worker_dram = WorkerDram(tp_size)  # what the workers' DRAM holds, as they report it
        self._lookups = Lookups(store, kv_heads, self._worker_dram.holds, lookup_timeout, metrics.async_lookups,
                                block_size if tails else None)
        self._names = namespaces
        self._metrics = metrics
        self._chunk = store.chunk_tokens
        self._bs = block_size
        # What a request's KV is stored and looked up as: whole blocks (the last chunk may be a tail), else chunks.
        self._unit = block_size if tails else store.chunk_tokens
        self._handoffs = Handoffs(store, metrics.pd, unit=self._unit, tails=tails, wait_max=pd_wait_max)
        self._saved: dict[str, tuple[Namespace, list[int]]] = {}  # P/D prefills: what their save covers
        # P/D prefills that ended before their save could be planned (their blocks kept for it) -> the step then
        self._releasing: dict[str, int] = {}
        self._kv_heads = kv_heads
        # A save must not store KV computed over blocks whose load failed, for any request over those blocks
        # (vLLM's prefix-cache sharers included). A worker knows its own failures of the step it runs, not
        # another rank's, nor (once the step is over) the failures of a step the scheduler has not heard yet: vLLM's
        # asynchronous scheduling plans a step before the last one's output arrives. So a save over blocks loaded
        # in a step the workers have not all reported waits (with several workers, even in that same step).
        self._workers = workers  # tensor-parallel ranks: each reports its steps
        self._step = 0  # numbers each metadata; workers echo the last they ran
        self._unheard: dict[int, int] = {}  # block loaded in a step not yet reported by every worker -> the step
        self._namespaces: dict[str, Namespace] = {}
        self._hits: dict[str, _Hit] = {}  # request -> what its lookup promised
        self._loads: dict[str, Transfer] = {}  # planned at allocation, sent with the next metadata
        self._invalid: list[int] = []
        self._abandoned: dict[str, list[int]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._traces: dict[str, dict[str, str]] = {}  # request -> its trace headers (only while tracing)

    # -- lookups ---------------------------------------------------------------------------------------------
    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """:meth:`_lookup` in a span of the request's trace, counted by outcome once answered."""
        trace = None
        headers = getattr(request, "trace_headers", None) if tracing.enabled() else None
        if headers:
            trace = self._traces[request.request_id] = {
                k: v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
        with tracing.span("kvtier.connector.lookup", tracing.context_of(trace), request_id=request.request_id,
                          prompt_tokens=request.num_prompt_tokens, engine_hit_tokens=num_computed_tokens) as span:
            found, asynchronous = self._lookup(request, num_computed_tokens)
            outcome = "pending" if found is None else "hit" if found > 0 else "miss"
            if found is not None:
                self._metrics.lookups.labels(outcome).inc()
            if span is not None:
                span.set_attributes({"outcome": outcome, "hit_tokens": found or 0, "asynchronous": asynchronous})
        return found, asynchronous

    def _lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond the engine's own hit that the store holds, or None while a lookup in a tier across a
        network is under way (vLLM asks again); and whether their load runs asynchronously (it may wait on a
        server). The store holds whole chunks and tails; a hit ends at the last whole block before the prompt's
        last token (which the engine computes, to sample from), inside a chunk if need be: as far as vLLM's own hit
        goes."""
        rid = request.request_id
        if self._handoffs.paused(rid):
            return None, False  # a decode waiting for its prefill's KV, between two lookups
        self._hits.pop(rid, None)
        try:
            ns = self._names.for_request(request)
        except Skip as skip:
            self._namespaces.pop(rid, None)
            self._metrics.skip(skip.reason, str(skip), rid)
            self._handoffs.begin(request, None, [])  # a prefill answers that it stored nothing
            return 0, False
        self._namespaces[rid] = ns
        if self._events is not None:
            self._requests[rid] = request
        tokens = list(request.all_token_ids)
        cap = (len(tokens) - 1) // self._bs * self._bs
        whole = len(tokens) // self._unit * self._unit
        self._handoffs.begin(request, ns, tokens)
        if min(cap, whole) <= num_computed_tokens or getattr(request, "skip_reading_prefix_cache", False):
            self._handoffs.waiting(rid, cap, cap)  # nothing to load: a decode's wait for its KV ends here
            return 0, False  # (vLLM would drop a hit for a request that may not read cached prefixes anyway)
        held = self._lookups.held(rid, ns, tokens[:whole])
        if held is None:
            return None, False
        if self._handoffs.waiting(rid, held.tokens, cap):
            self._lookups.forget(rid)  # the next lookup asks the tiers again
            return None, False
        end = min(held.tokens, cap)
        if end <= num_computed_tokens:
            return 0, False
        # Loads from DRAM and local tiers run in the step (no step's delay added to a fast hit); a load that may
        # wait on a server runs beside the steps, so a stalled server delays only the requests that need it.
        remote = end > held.local  # some chunk the hit needs is held only across a network
        self._hits[rid] = _Hit(num_computed_tokens, tokens, held.tokens, remote)
        return end - num_computed_tokens, remote

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of the tokens promised by :meth:`lookup` into the blocks vLLM just allocated."""
        self._lookups.forget(request.request_id)  # allocated: the next lookup of this request is a new one
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        hit = self._hits[rid]  # kept until the load is planned: invalidate() needs it if planning fails
        end = hit.computed + num_external_tokens
        # For a request resumed after preemption the tokens include its output so far. The chunks named are
        # those the store holds up to the hit's end (whole, or the tail found); the blocks listed end where the
        # hit does.
        block_ids = list(blocks.get_block_ids()[0][:end // self._bs])
        chunks_end = min(-(-end // self._chunk) * self._chunk, hit.stored)
        self._loads[rid] = Transfer(rid, self._namespaces[rid], hit.tokens[:chunks_end], block_ids, hit.computed,
                                    hit.asynchronous, self._traces.get(rid))
        del self._hits[rid]
        self._announce(request, self._namespaces[rid], hit.tokens[:chunks_end])

    def invalidate(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """After a failed :meth:`after_alloc`: have the workers report the promised blocks as failed, so vLLM
        recomputes them. Without the engine's own hit (lost with the failure) that is every block from the
        first: more than needed, but nothing promised stays unfilled. vLLM waits for an asynchronous load to be
        reported finished: the workers report this one at once, every block failed."""
        self._loads.pop(request.request_id, None)
        hit = self._hits.pop(request.request_id, None)
        computed = 0 if hit is None else hit.computed
        ids = blocks.get_block_ids()[0]
        failed = ids[computed // self._bs:(computed + num_external_tokens) // self._bs] or ids
        if hit is not None and hit.asynchronous:
            self._abandoned[request.request_id] = list(failed)
        else:
            self._invalid.extend(failed)

    # -- plans -----------------------------------------------------------------------------------------------
    def take_loads(self) -> KVTierMetadata:
        """A step's metadata with the loads planned since the last one: vLLM already counts their tokens as
        computed, so they go out whatever happens to the rest of the plan."""
        self._step += 1
        meta = KVTierMetadata(loads=list(self._loads.values()), invalid=self._invalid, abandoned=self._abandoned,
                              step=self._step)
        for load in meta.loads:
            if not load.asynchronous:  # vLLM shares an asynchronous load's blocks only once it is reported
                self._unheard.update(dict.fromkeys(load.block_ids[load.offset // self._bs:], self._step))
        self._loads, self._invalid, self._abandoned = {}, [], {}
        return meta

    def plan_saves(self, meta: KVTierMetadata, scheduler_output: SchedulerOutput) -> None:
        """Follow the scheduled requests' blocks and add the saves this step completes; a request whose
        tracking fails is dropped (it is neither saved nor followed further), the others go on."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            try:
                ns = self._namespaces.get(new.req_id)
                self._hits.pop(new.req_id, None)
                if ns is None or new.prompt_token_ids is None:
                    continue  # skipped at lookup: neither load nor save
                self._tracked[new.req_id] = _Tracked(ns, list(new.prompt_token_ids), list(new.block_ids[0]))
                self._plan_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
            except Exception as exc:  # noqa: BLE001 contained per request: counted, logged once
                self._tracked.pop(new.req_id, None)
                self._metrics.error("build_connector_meta", exc, new.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            try:
                tracked = self._tracked.get(rid)
                if tracked is None:
                    continue
                new_blocks = cached.new_block_ids[i]
                if rid in cached.resumed_req_ids:  # preempted and back: its blocks were all replaced
                    tracked.block_ids = list(new_blocks[0]) if new_blocks else []
                    self._hits.pop(rid, None)
                elif new_blocks:
                    tracked.block_ids.extend(new_blocks[0])
                self._plan_save(meta, rid, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
            except Exception as exc:  # noqa: BLE001 contained per request: counted, logged once
                self._tracked.pop(rid, None)
                self._metrics.error("build_connector_meta", exc, rid)
        self._release(meta)

    def _release(self, meta: KVTierMetadata) -> None:
        """Plan the saves of P/D prefills that ended first; after :data:`RELEASE_STEPS` steps without, or on a
        failure, a save of nothing: every worker reports the request finished, and vLLM frees its blocks."""
        for rid, since in list(self._releasing.items()):
            tracked = self._tracked.get(rid)
            try:
                if tracked is not None and not tracked.saved:
                    self._plan_save(meta, rid, len(tracked.tokens))
                done = tracked is None or tracked.saved
            except Exception as exc:  # noqa: BLE001 contained per request: counted, logged once
                self._metrics.error("build_connector_meta", exc, rid)
                done = False
                since = -RELEASE_STEPS
            if done or self._step - since >= RELEASE_STEPS:
                meta.released.append(rid)
                del self._releasing[rid]
                self.finished(rid)

    def _plan_save(self, meta: KVTierMetadata, rid: str, computed_after_step: int) -> None:
        tracked = self._tracked[rid]
        upto = len(tracked.tokens) // self._unit * self._unit  # the prompt's whole chunks (and tail)
        if tracked.saved or upto == 0 or computed_after_step < upto:
            return
        if self._unheard and self._over_unheard(tracked.block_ids[:upto // self._bs], meta.step):
            tracked.deferred = True
            return  # computed over blocks whose load some worker has not reported yet: planned again next step
        tracked.saved = True
        handoff = self._handoffs.is_prefill(rid)
        if handoff:
            self._saved[rid] = (tracked.namespace, tracked.tokens[:upto])
        # From the start: the worker skips what the store holds (store.held), which after a failed load
        # excludes the chunks that failed, so they are saved once recomputed.
        meta.saves.append(Transfer(rid, tracked.namespace, tracked.tokens[:upto],
                                   tracked.block_ids[:upto // self._bs], 0, trace=self._traces.get(rid),
                                   handoff=handoff))
        request = self._requests.get(rid)
        if request is not None:
            self._announce(request, tracked.namespace, tracked.tokens[:upto])

    def _announce(self, request: Request, namespace: Namespace, tokens: list[int]) -> None:
        """Name the blocks of a planned save or load for kvtier's KV events. Only after the plan, and contained:
        a failure here costs an announcement, never the save or the load."""
        if self._events is None:
            return
        try:
            self._events.register(request, namespace, tokens)
        except Exception as exc:  # noqa: BLE001 contained per request: counted, logged once
            self._metrics.error("take_events", exc, request.request_id)

    def _over_unheard(self, blocks: list[int], step: int) -> bool:
        """Whether ``blocks`` hold a load not yet reported by every worker, that a save in ``step`` cannot trust.
        A lone worker skips saves over its own failures of the step it runs; several cannot see each other's."""
        last = step if self._workers > 1 else step - 1
        return any(self._unheard.get(block, last + 1) <= last for block in blocks)

    def connector_output(self, output: KVConnectorOutput) -> None:
        """Learn what the workers' DRAM now holds. Blocks whose load failed are recomputed: save the requests
        holding them again once they are."""
        report = output.kv_connector_worker_meta
        changed = self._worker_dram.apply(report)
        if self._events is not None:
            self._events.apply(changed, report)
        invalid = output.invalid_block_ids
        if invalid:
            for tracked in self._tracked.values():
                if tracked.saved and not invalid.isdisjoint(tracked.block_ids):
                    tracked.saved = False
        if self._unheard and isinstance(report, KVTierWorkerMetadata) and \
                report.steps.keys() == set(range(self._workers)):
            heard = min(report.steps.values())  # every worker ran (and reported the failures of) steps up to it
            self._unheard = {block: step for block, step in self._unheard.items() if step > heard}

    def take_events(self) -> list[KVCacheEvent]:
        return self._events.take() if self._events is not None else []

    def finished(self, request_id: str) -> tuple[bool, dict[str, Any] | None]:
        """Forget a finished request: whether vLLM keeps its blocks for a save still to come, and for a P/D
        prefill, what it stored (vLLM returns it in the answer). A prefill whose save was put off (over blocks
        some worker has not reported loading) keeps its blocks until the save is planned and every worker has
        run it (:meth:`plan_saves`, reported through ``get_finished``): a decode engine waits for that KV."""
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.deferred and not tracked.saved and self._handoffs.is_prefill(request_id):
            upto = len(tracked.tokens) // self._unit * self._unit
            answer = self._handoffs.answer(request_id, (tracked.namespace, tracked.tokens[:upto]))
            self._handoffs.finished(request_id)
            self._releasing[request_id] = self._step
            return True, answer
        try:
            return False, self._handoffs.answer(request_id, self._saved.get(request_id))
        finally:
            for table in (self._tracked, self._namespaces, self._hits, self._loads, self._requests, self._traces,
                          self._saved):
                table.pop(request_id, None)
            self._lookups.forget(request_id)
            self._handoffs.finished(request_id)

    def idle(self) -> None:
        """The step just planned runs no model (e.g. every request waits for a lookup): vLLM would plan the next
        at once, holding the GIL the lookup threads need; give them a moment instead. With nothing else to do
        but decode requests waiting for their prefill's KV, sleep until the first of them asks again (as long, at
        most, as the wait for a lookup: a request arriving meanwhile waits no longer than it did)."""
        poll = self._handoffs.next_poll()
        if poll is not None and not self._lookups.running:
            time.sleep(min(max(0.0, poll - time.monotonic()), IDLE_WAIT_SECONDS))
            return
        self._lookups.wait(IDLE_WAIT_SECONDS)

    def close(self) -> None:
        self._lookups.close()

    def forget_lookup(self, request_id: str) -> None:
        """After a failed :meth:`lookup`: promise nothing for the request."""
        self._hits.pop(request_id, None)
        self._lookups.forget(request_id)
