"""The timing layer: a trace replayed against one vLLM-like engine, with or without kvtier, on a calibration.

A step-by-step copy of what matters in vLLM v1's scheduler, in blocks of the trace's size:

- every step has a token budget (``max_num_batched_tokens``); running requests go first (one token each when
  decoding, the next chunk of their prompt when prefilling), then waiting ones in arrival order, up to
  ``max_num_seqs`` running;
- the engine's KV space is a pool of blocks; a finished prompt's whole blocks stay in it as its prefix cache
  (shared by reference; a finished request's blocks are released tail first, and the least recently
  released is evicted first, so a prompt loses its tail before its head, as in vLLM); a request that finds no
  free block preempts the latest running request, whose blocks are freed and which later computes its prompt
  and output again;
- with kvtier, a request admitted for the first time (or again after a preemption) loads the blocks after the
  engine's own hit that DRAM or a tier holds (in that order), in the step it is scheduled: serially, as on
  CPU; when its prefill completes its whole blocks are put in DRAM (a copy in that step) and cascaded to every
  tier in the background (the tiers' caches see them at once; on a GPU that takes no step time, but an engine
  computing on the CPU loses the writes' time, as they run on its cores: the next step takes it). With
  ``store_after`` N (kvtier's ``admission.store_after``) a put stores only its leading blocks seen in N puts,
  this one included (kvtier's own :class:`~kvtier.store.admission.Admission`, at its default memory). A block read
  from a tier is promoted into DRAM. Neither the engine nor kvtier hits a prompt's last token;
- a tier with a codec holds more, smaller chunks, decodes what it loads and encodes what it stores on the writer
  threads (:mod:`kvtier.sim.codec_model`).

A step lasts ``a + sum(b*n + c*n*(n + 2*m))`` over its prefill chunks (``n`` tokens after ``m`` computed ones)
plus ``d1`` per decoding request, or ``d0 + d1*decoding`` without a prefill, plus its loads and DRAM copies,
all from :mod:`kvtier.sim.calibrate`'s fits.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvtier.config import AdmissionConfig
from kvtier.sim import codec_model
from kvtier.sim.cache import BlockCache
from kvtier.sim.codec_model import CodecCost
from kvtier.sim.deployment import Deployment
from kvtier.sim.trace import Trace
from kvtier.store.admission import Admission


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """The calibration's fits, as the timing layer uses them: what a step's prefill chunks and decodes cost, and
    its loads and copies per tier (not :class:`kvtier.router.config.Costs`, the router's cost model)."""

    a: float
    b: float
    c: float
    d0: float
    d1: float
    kv_bytes_per_token: int
    load: dict[str, tuple[float, float]]  # tier name ("dram" too) -> (latency s, bytes/s)
    dram_store_bytes_per_s: float
    store: dict[str, float] = dataclasses.field(default_factory=dict)  # secondary tier -> write bytes/s
    shared_cpu: bool = False  # the engine computes on the CPU: background tier writes take its cores' time
    codecs: dict[str, CodecCost] = dataclasses.field(default_factory=lambda: {"none": codec_model.NONE})

    @classmethod
    def from_calibration(cls, cal: dict[str, Any]) -> StepCosts:
        tiers = cal["tiers"]
        dram = tiers.get("dram", {})
        store = (dram.get("streams") or [{}])[0].get("store_bytes_per_s") or dram.get("bandwidth_bytes_per_s", 1e10)
        return cls(a=cal["prefill"]["fit"]["a"], b=cal["prefill"]["fit"]["b"], c=cal["prefill"]["fit"]["c"],
                   d0=cal["decode"]["fit"]["intercept"], d1=cal["decode"]["fit"]["slope"],
                   kv_bytes_per_token=int(cal["model"]["kv_bytes_per_token"]),
                   load={n: (t["latency_s"], t["bandwidth_bytes_per_s"]) for n, t in tiers.items()},
                   dram_store_bytes_per_s=float(store),
                   store={n: float(t["streams"][0]["store_bytes_per_s"]) for n, t in tiers.items()
                          if n != "dram" and t.get("streams") and t["streams"][0].get("store_bytes_per_s", 0) > 0},
                   shared_cpu=cal["fingerprint"].get("accelerator") is None,
                   codecs=codec_model.from_calibration(cal))

    def chunk(self, new: int, done: int) -> float:
        """A prefill chunk of ``new`` tokens after ``done`` computed ones, without the step's fixed cost."""
        return self.b * new + self.c * new * (new + 2 * done)


@dataclasses.dataclass
class _Request:
    index: int
    arrival: float
    blocks: tuple[int, ...]  # whole blocks
    prompt: int
    output: int
    computed: int = 0  # tokens whose KV the engine holds (hits and loads included)
    generated: int = 0
    shared: list[int] = dataclasses.field(default_factory=list)  # prefix-cache blocks it references
    private: int = 0  # blocks of its own
    registered: bool = False
    admitted: bool = False
    engine_hit: int = 0  # tokens, at its first admission
    loaded: dict[str, int] = dataclasses.field(default_factory=dict)  # tokens per tier, every admission
    ttft: float | None = None
    finish: float | None = None
    preemptions: int = 0

    @property
    def target(self) -> int:
        """Tokens to compute before the next output token: the prompt, and what it had generated before a
        preemption."""
        return self.prompt + max(self.generated - 1, 0) if self.generated else self.prompt


class _Pool:
    """The engine's KV blocks: private blocks of running requests, and cached prompt blocks with references."""

    def __init__(self, blocks: int, prefix_caching: bool) -> None:
        self.total = blocks
        self.caching = prefix_caching
        self.refs: OrderedDict[int, int] = OrderedDict()  # cached block -> references; unreferenced first
        self.private = 0

    @property
    def free(self) -> int:
        return self.total - len(self.refs) - self.private

    def allocate(self, count: int) -> bool:
        while self.free < count:
            victim = next((b for b, r in self.refs.items() if r == 0), None)
            if victim is None:
                return False
            del self.refs[victim]
        self.private += count
        return True

    def hit(self, blocks: tuple[int, ...], limit: int) -> int:
        run = 0
        while self.caching and run < min(len(blocks), limit) and blocks[run] in self.refs:
            run += 1
        return run

    def take(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] = self.refs.get(b, 0) + 1
            self.refs.move_to_end(b)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.refs.move_to_end(b)  # evicted after the unreferenced blocks released before it


_NEVER = (float("inf"), float("inf"))


def simulate(trace: Trace, deployment: Deployment, costs: StepCosts, shared: str | None = None,
             elsewhere: Mapping[int, tuple[float, float]] | None = None, store_log: dict[int, float] | None = None
             ) -> dict[str, Any]:
    """Replay ``trace``; returns per-request rows and aggregates.

    ``shared`` names a tier the engine shares with others: besides what this engine wrote to it, it holds each
    block of ``elsewhere`` during its ``(from, until)`` seconds (written by another engine, then evicted).
    ``store_log``, when given, gets the time each block this engine wrote to the shared tier was written
    (the end of the step that stored it, plus the write at the tier's calibrated store bandwidth).
    """
    return _Replay(trace, deployment, costs, shared, elsewhere, store_log).run()


def codings(deployment: Deployment, costs: StepCosts) -> dict[str, CodecCost]:
    """The codec cost of each of the deployment's secondary tiers, by name; a ValueError naming the field when a
    tier or its codec is not in the calibration (:class:`~kvtier.sim.codec_model.UnmeasuredCodec`)."""
    kv = deployment.kvtier
    if kv is None:
        return {}
    for name in ["dram", *(t.name for t in kv.tiers)]:
        if name not in costs.load:
            raise ValueError(f"kvtier.tiers: {name!r} is not a tier of the calibration "
                             f"(calibrated: {', '.join(costs.load)})")
    return {t.name: codec_model.cost_of(costs.codecs, t.codec, f"kvtier.tiers[{i}].codec")
            for i, t in enumerate(kv.tiers)}


def _caches(deployment: Deployment, chunk_bytes: int, coding: dict[str, CodecCost]
            ) -> tuple[BlockCache | None, list[tuple[str, BlockCache]] | None]:
    """kvtier's DRAM and its secondary tiers' caches, in lookup order (None, None: no kvtier)."""
    kv = deployment.kvtier
    if kv is None:
        return None, None
    pages = -(-chunk_bytes // kv.page_bytes)  # the pool hands out whole pages
    dram = BlockCache(kv.policy, max(1, (kv.dram_bytes // kv.page_bytes) // pages))
    tiers = [(t.name, BlockCache("lru", codec_model.blocks_held(t.capacity_bytes, chunk_bytes, coding[t.name])))
             for t in kv.tiers]
    return dram, tiers


class _Replay:
    """One replay: the engine's pool and queues, kvtier's caches, the clock and the counters. :meth:`run` steps
    it: each step plans (:meth:`_plan`: the running requests, then the waiting ones it admits, with their
    loads), is timed and stores what finished its prefill (:meth:`_step`), then advances every planned request."""

    def __init__(self, trace: Trace, deployment: Deployment, costs: StepCosts, shared: str | None,
                 elsewhere: Mapping[int, tuple[float, float]] | None, store_log: dict[int, float] | None) -> None:
        self.costs, self.shared, self.elsewhere, self.store_log = costs, shared, elsewhere, store_log
        self.bt = bt = trace.block_tokens
        self.engine = engine = deployment.engine
        # vLLM's KV space less its null block, in the trace's blocks (rounded up: a trace block may be several of
        # vLLM's, and a request vLLM fits must fit here)
        self.pool = _Pool(-(-max(0, engine.kv_tokens - engine.block_size) // bt), engine.prefix_caching)
        self.chunk_bytes = costs.kv_bytes_per_token * bt
        self.coding = codings(deployment, costs)  # secondary tier -> its codec's cost
        self.dram, self.tiers = _caches(deployment, self.chunk_bytes, self.coding)
        # kvtier's own admission, over block ids in place of chunk keys
        self.admission = Admission(AdmissionConfig(deployment.kvtier.store_after if deployment.kvtier else 1))
        # A request whose prompt and output the whole KV space cannot hold is refused, as vLLM refuses a prompt
        # beyond max_model_len; it is counted, not timed.
        fits = [(i, r) for i, r in enumerate(trace.requests)
                if -(-(r.input_length + max(r.output_length, 1)) // bt) <= self.pool.total]
        if not fits:
            raise ValueError(f"engine.kv_tokens: {engine.kv_tokens} tokens hold no request of the trace whole")
        self.refused = len(trace.requests) - len(fits)
        self.reqs = [_Request(i, r.timestamp_ms / 1000 / deployment.time_scale, r.blocks[:r.whole], r.input_length,
                              max(r.output_length, 1)) for i, r in fits]  # numbered by their place in the trace
        self._arrivals = iter(self.reqs)
        self.upcoming = next(self._arrivals, None)
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.now = 0.0
        self.stored_bytes: dict[str, int] = {}
        self.loaded_bytes: dict[str, int] = {}
        self.preemptions = 0
        self.steps = 0
        self.prefilled = 0  # tokens computed by prefill chunks (recomputation after preemptions included)
        self.owed = self.background = 0.0  # seconds of tier writes the engine's cores owe (CPU engine only)
        self.encode_s = self.decode_s = 0.0  # the codecs' work: writer threads' CPU, and in loads
        self.load_s = 0.0  # this step's loads
        self.preempted_now = False  # as vLLM: a step that preempted admits no waiting request

    def run(self) -> dict[str, Any]:
        while self.upcoming is not None or self.waiting or self.running:
            while self.upcoming is not None and self.upcoming.arrival <= self.now:
                self.waiting.append(self.upcoming)
                self.upcoming = next(self._arrivals, None)
            if not self.waiting and not self.running:
                assert self.upcoming is not None  # the loop's condition
                self.now = self.upcoming.arrival
                continue
            plan = self._plan()
            if not plan:  # nothing running and the next waiting request does not fit yet: it never will by waiting
                assert not self.running and self.upcoming is not None, \
                    "a fitting request could not be scheduled on an idle engine"
                self.now = self.upcoming.arrival
                continue
            self._step(plan)
        out = _summary(self.reqs, self.now, self.preemptions, self.steps, self.stored_bytes, self.loaded_bytes,
                       self.costs, self.bt)
        out["refused"] = self.refused
        out["prefilled_tokens"] = self.prefilled
        out["encode_cpu_s"], out["decode_s"] = self.encode_s, self.decode_s
        return out

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.bt)

    # -- planning a step ---------------------------------------------------------------------------------------
    def _plan(self) -> list[tuple[_Request, int]]:
        """This step's requests, each with its tokens: the running ones first, then the waiting ones it admits
        (their loads add up in :attr:`load_s`)."""
        self.load_s = 0.0
        self.preempted_now = False
        plan: list[tuple[_Request, int]] = []
        budget = self._continue_running(plan, self.engine.max_num_batched_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.engine.max_num_seqs and not self.preempted_now:
            r = self.waiting[0]
            n = self._admit(r, budget)
            if n is None:
                break
            plan.append((r, n))
            budget -= n
        return plan

    def _continue_running(self, plan: list[tuple[_Request, int]], budget: int) -> int:
        """The running requests' next tokens into ``plan``, preempting the latest for blocks; the budget left."""
        for r in self.running:  # (a preemption removes from the list iterated: as vLLM's loop over its queue)
            if r not in self.running or budget == 0:
                continue
            n = min(r.target - r.computed, budget) if r.computed < r.target else 1
            need = self._blocks(r.computed + n) - len(r.shared) - r.private
            while need > 0 and not self.pool.allocate(need):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    break
            if r not in self.running:
                continue
            r.private += max(need, 0)
            plan.append((r, n))
            budget -= n
        return budget

    def _preempt(self, victim: _Request) -> None:
        self.preempted_now = True
        self.running.remove(victim)
        self.pool.release(victim.shared[::-1])
        self.pool.private -= victim.private
        victim.shared, victim.private, victim.computed, victim.registered = [], 0, 0, False
        victim.admitted = False
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.insert(0, victim)

    def _admit(self, r: _Request, budget: int) -> int | None:
        """Admit the first waiting request ``r`` with its engine hit and kvtier's loads; its tokens this step, or
        None when its blocks do not fit (it stays waiting)."""
        bt = self.bt
        limit = (r.target - 1) // bt  # the last token is always computed
        hit = self.pool.hit(r.blocks, limit)
        sources = self._sources(r, hit, limit)
        done = (hit + len(sources)) * bt
        n = min(r.target - done, budget)
        need = self._blocks(done + n) - hit
        self.pool.take(list(r.blocks[:hit]))  # the hit blocks are held first: allocating cannot evict them
        if not self.pool.allocate(need):
            self.pool.release(list(r.blocks[:hit])[::-1])
            return None
        self.waiting.pop(0)
        r.shared, r.private, r.computed = list(r.blocks[:hit]), need, done
        if not r.admitted and r.preemptions == 0:
            r.engine_hit = hit * bt
        r.admitted = True
        self._load(r, sources, hit)
        self.running.append(r)
        return n

    def _sources(self, r: _Request, hit: int, limit: int) -> list[tuple[str, int]]:
        """Where kvtier loads ``r``'s blocks from, past the engine's ``hit``: its lookup counts the chunks it holds
        from the first one."""
        sources: list[tuple[str, int]] = []
        if self.dram is None or self.tiers is None:
            return sources
        for j in range(min(len(r.blocks), limit)):
            block = r.blocks[j]
            where = "dram" if block in self.dram.resident else next(
                (name for name, cache in self.tiers if block in cache.resident or self._elsewhere(name, block)), None)
            if where is None:
                break
            if j >= hit:
                sources.append((where, block))
        return sources

    def _elsewhere(self, name: str, block: int) -> bool:
        """Whether another engine's write of ``block`` is in the shared tier ``name`` now."""
        if name != self.shared or self.elsewhere is None:
            return False
        held = self.elsewhere.get(block, _NEVER)
        return held[0] <= self.now < held[1]

    def _load(self, r: _Request, sources: list[tuple[str, int]], hit: int) -> None:
        """Time and count ``r``'s loads, a tier's blocks at a time; the loaded blocks are touched, and those read
        from a tier promoted into DRAM."""
        per_tier: dict[str, list[int]] = {}
        for where, block in sources:
            per_tier.setdefault(where, []).append(block)
        for where, blocks in per_tier.items():
            latency, bandwidth = self.costs.load[where]
            codec = self.coding.get(where, codec_model.NONE)  # DRAM holds chunks as they are
            size = len(blocks) * codec.stored_bytes(self.chunk_bytes)
            decode = codec.decode_s(len(blocks) * self.chunk_bytes)
            self.load_s += latency + size / bandwidth + decode
            self.decode_s += decode
            self.loaded_bytes[where] = self.loaded_bytes.get(where, 0) + size
            r.loaded[where] = r.loaded.get(where, 0) + len(blocks) * self.bt
        if self.dram is not None and self.tiers is not None and sources:
            self.dram.touch([b for w, b in sources if w == "dram"])
            for name, cache in self.tiers:
                cache.touch([b for w, b in sources if w == name])
            promoted = {b for w, b in sources if w != "dram"}  # into DRAM, each under its own parent
            if promoted:
                self.dram.put(r.blocks, start=hit, only=promoted)

    # -- running a step ----------------------------------------------------------------------------------------
    def _step(self, plan: list[tuple[_Request, int]]) -> None:
        """Time the planned step (its chunks, decodes, loads and DRAM copies), then advance the clock and every
        request in it."""
        costs = self.costs
        prefills = [(r, n) for r, n in plan if r.computed < r.target]
        self.prefilled += sum(n for _, n in prefills)
        decodes = len(plan) - len(prefills)
        step = (costs.a + sum(costs.chunk(n, r.computed) for r, n in prefills) + costs.d1 * decodes
                if prefills else costs.d0 + costs.d1 * decodes) + self.load_s
        step = self._store([r for r, n in prefills if r.computed + n >= r.target], step)
        # the background writes queued before this step ran on the engine's cores during it
        self.now += step + self.owed
        self.owed, self.background = self.background, 0.0
        self.steps += 1
        for r, n in plan:
            self._advance(r, n)

    def _store(self, finished_prefill: list[_Request], step: float) -> float:
        """Put the whole blocks of the requests whose first prefill ends in this step into DRAM (their copies
        lengthen the step) and every tier; the step's seconds with the copies."""
        if self.dram is None or self.tiers is None:
            return step
        costs, chunk_bytes = self.costs, self.chunk_bytes
        for r in finished_prefill:
            if r.generated != 0:
                continue
            # The worker stores from the first chunk DRAM does not hold (its leading run untouched), as far as
            # admission lets it.
            start = self.dram.run(r.blocks)
            new = self.dram.put(r.blocks[:start + self.admission.admit(r.blocks[start:])], start=start)
            self.stored_bytes["dram"] = self.stored_bytes.get("dram", 0) + len(new) * chunk_bytes
            step += len(new) * chunk_bytes / costs.dram_store_bytes_per_s
            for name, cache in self.tiers:
                written = cache.put(new)
                stored = len(written) * self.coding[name].stored_bytes(chunk_bytes)
                encode = self.coding[name].encode_s(len(written) * chunk_bytes)
                self.encode_s += encode
                self.stored_bytes[name] = self.stored_bytes.get(name, 0) + stored
                # the writer thread encodes, then writes (at the tier's store bandwidth, where calibrated)
                write_s = encode + stored / costs.store.get(name, float("inf"))
                if name == self.shared and self.store_log is not None:
                    for block in written:
                        self.store_log.setdefault(block, self.now + step + write_s)
                if costs.shared_cpu:
                    self.background += write_s
        return step

    def _advance(self, r: _Request, n: int) -> None:
        """``r`` after the step: its ``n`` tokens computed, an output token when it reached its target, and
        released when it finished."""
        if r.computed < r.target:
            r.computed += n
            if r.computed < r.target:
                return
            if not r.registered:  # its whole prompt blocks join the prefix cache (a copy another
                own = [b for b in r.blocks if b not in r.shared]  # request cached meanwhile is freed)
                self.pool.private -= len(own)
                r.private -= len(own)
                self.pool.take(own)
                r.shared += own
                r.registered = True
        else:
            r.computed += 1
        r.generated += 1
        if r.ttft is None:
            r.ttft = self.now - r.arrival
        if r.generated >= r.output:
            r.finish = self.now
            self.running.remove(r)
            self.pool.release(r.shared[::-1])  # tail first, as vLLM frees: the tail is evicted before the head
            self.pool.private -= r.private
            r.shared, r.private = [], 0


def _summary(reqs: list[_Request], end: float, preemptions: int, steps: int, stored: dict[str, int],
             loaded: dict[str, int], costs: StepCosts, bt: int) -> dict[str, Any]:
    ttft = np.array([r.ttft for r in reqs], dtype=float)
    span = max(end - reqs[0].arrival, 1e-9)
    avoided = sum(costs.chunk(sum(r.loaded.values()), r.engine_hit) for r in reqs)
    rows = [{"request": r.index, "arrival_s": round(r.arrival, 6), "ttft_s": round(r.ttft or 0.0, 6),
             "finish_s": round(r.finish or 0.0, 6), "prompt_tokens": r.prompt, "engine_hit_tokens": r.engine_hit,
             "loaded_tokens": dict(r.loaded), "preemptions": r.preemptions} for r in reqs]
    return {
        "requests": rows,
        "ttft_s": {"p50": float(np.percentile(ttft, 50)), "p90": float(np.percentile(ttft, 90)),
                   "p99": float(np.percentile(ttft, 99)), "mean": float(ttft.mean())},
        "makespan_s": span, "requests_per_s": len(reqs) / span,
        "output_tokens_per_s": sum(r.output for r in reqs) / span,
        "engine_hit_tokens": sum(r.engine_hit for r in reqs),
        "loaded_tokens": {k: sum(r.loaded.get(k, 0) for r in reqs)
                          for k in sorted({k for r in reqs for k in r.loaded})},
        "avoided_prefill_s": avoided, "loaded_bytes": loaded, "stored_bytes": stored,
        "preemptions": preemptions, "steps": steps,
    }
