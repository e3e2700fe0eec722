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
  computing on the CPU loses the writes' time, as they run on its cores: the next step takes it). A block read
  from a tier is promoted into DRAM. Neither the engine nor kvtier hits a prompt's last token.

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

from kvtier.sim.cache import BlockCache
from kvtier.sim.deployment import Deployment
from kvtier.sim.trace import Trace


@dataclasses.dataclass(frozen=True)
class Costs:
    """The calibration's fits, as the timing layer uses them."""

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

    @classmethod
    def from_calibration(cls, cal: dict[str, Any]) -> Costs:
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
                   shared_cpu=cal["fingerprint"].get("accelerator") is None)

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


def simulate(trace: Trace, deployment: Deployment, costs: Costs, shared: str | None = None,
             elsewhere: Mapping[int, tuple[float, float]] | None = None, store_log: dict[int, float] | None = None
             ) -> dict[str, Any]:
    """Replay ``trace``; returns per-request rows and aggregates.

    ``shared`` names a tier the engine shares with others: besides what this engine wrote to it, it holds each
    block of ``elsewhere`` during its ``(from, until)`` seconds (written by another engine, then evicted).
    ``store_log``, when given, gets the time each block this engine wrote to the shared tier was written
    (the end of the step that stored it, plus the write at the tier's calibrated store bandwidth).
    """
    bt = trace.block_tokens
    engine = deployment.engine
    # vLLM's KV space less its null block, in the trace's blocks (rounded up: a trace block may be several of
    # vLLM's, and a request vLLM fits must fit here)
    pool = _Pool(-(-max(0, engine.kv_tokens - engine.block_size) // bt), engine.prefix_caching)
    chunk_bytes = costs.kv_bytes_per_token * bt
    kv = deployment.kvtier
    never = (float("inf"), float("inf"))
    dram = tiers = None
    if kv is not None:
        pages = -(-chunk_bytes // kv.page_bytes)  # the pool hands out whole pages
        dram = BlockCache(kv.policy, max(1, (kv.dram_bytes // kv.page_bytes) // pages))
        tiers = [(t.name, BlockCache("lru", None if t.capacity_bytes is None
                                          else max(1, t.capacity_bytes // chunk_bytes)))
                 for t in kv.tiers]
        for name in ["dram", *(t.name for t in kv.tiers)]:
            if name not in costs.load:
                raise ValueError(f"kvtier.tiers: {name!r} is not a tier of the calibration "
                                 f"(calibrated: {', '.join(costs.load)})")
    # A request whose prompt and output the whole KV space cannot hold is refused, as vLLM refuses a prompt
    # beyond max_model_len; it is counted, not timed.
    fits = [(i, r) for i, r in enumerate(trace.requests)
            if -(-(r.input_length + max(r.output_length, 1)) // bt) <= pool.total]
    if not fits:
        raise ValueError(f"engine.kv_tokens: {engine.kv_tokens} tokens hold no request of the trace whole")
    reqs = [_Request(i, r.timestamp_ms / 1000 / deployment.time_scale, r.blocks[:r.whole], r.input_length,
                     max(r.output_length, 1)) for i, r in fits]  # numbered by their place in the trace
    arrivals = iter(reqs)
    upcoming = next(arrivals, None)
    waiting: list[_Request] = []
    running: list[_Request] = []
    now = 0.0
    stored_bytes: dict[str, int] = {}
    loaded_bytes: dict[str, int] = {}
    preemptions = 0
    steps = 0
    prefilled = 0  # tokens computed by prefill chunks (recomputation after preemptions included)
    owed = background = 0.0  # seconds of tier writes the engine's cores owe (CPU engine only)
    while upcoming is not None or waiting or running:
        while upcoming is not None and upcoming.arrival <= now:
            waiting.append(upcoming)
            upcoming = next(arrivals, None)
        if not waiting and not running:
            now = upcoming.arrival  # type: ignore[union-attr]
            continue
        budget = engine.max_num_batched_tokens
        plan: list[tuple[_Request, int]] = []
        load_s = 0.0

        def blocks_for(tokens: int) -> int:
            return -(-tokens // bt)

        preempted_now = False  # as vLLM: a step that preempted admits no waiting request

        def preempt(victim: _Request) -> None:
            nonlocal preemptions, preempted_now
            preempted_now = True
            running.remove(victim)
            pool.release(victim.shared[::-1])
            pool.private -= victim.private
            victim.shared, victim.private, victim.computed, victim.registered = [], 0, 0, False
            victim.admitted = False
            victim.preemptions += 1
            preemptions += 1
            waiting.insert(0, victim)

        for r in running:
            if r not in running or budget == 0:
                continue
            n = min(r.target - r.computed, budget) if r.computed < r.target else 1
            need = blocks_for(r.computed + n) - len(r.shared) - r.private
            while need > 0 and not pool.allocate(need):
                victim = running[-1]
                preempt(victim)
                if victim is r:
                    break
            if r not in running:
                continue
            r.private += max(need, 0)
            plan.append((r, n))
            budget -= n
        while waiting and budget > 0 and len(running) < engine.max_num_seqs and not preempted_now:
            r = waiting[0]
            limit = (r.target - 1) // bt  # the last token is always computed
            hit = pool.hit(r.blocks, limit)
            sources: list[tuple[str, int]] = []
            if dram is not None and tiers is not None:
                # kvtier's lookup counts the chunks it holds from the first one; it loads those past the
                # engine's hit.
                j = 0
                while j < min(len(r.blocks), limit):
                    block = r.blocks[j]
                    where = "dram" if block in dram.resident else next(
                        (name for name, cache in tiers if block in cache.resident
                         or (name == shared and elsewhere is not None
                             and elsewhere.get(block, never)[0] <= now < elsewhere.get(block, never)[1])),
                        None)
                    if where is None:
                        break
                    if j >= hit:
                        sources.append((where, block))
                    j += 1
            done = (hit + len(sources)) * bt
            n = min(r.target - done, budget)
            need = blocks_for(done + n) - hit
            pool.take(list(r.blocks[:hit]))  # the hit blocks are held first: allocating cannot evict them
            if not pool.allocate(need):
                pool.release(list(r.blocks[:hit])[::-1])
                break
            waiting.pop(0)
            r.shared, r.private, r.computed = list(r.blocks[:hit]), need, done
            if not r.admitted and r.preemptions == 0:
                r.engine_hit = hit * bt
            r.admitted = True
            per_tier: dict[str, list[int]] = {}
            for where, block in sources:
                per_tier.setdefault(where, []).append(block)
            for where, blocks in per_tier.items():
                latency, bandwidth = costs.load[where]
                size = len(blocks) * chunk_bytes
                load_s += latency + size / bandwidth
                loaded_bytes[where] = loaded_bytes.get(where, 0) + size
                r.loaded[where] = r.loaded.get(where, 0) + len(blocks) * bt
            if dram is not None and tiers is not None and sources:
                dram.touch([b for w, b in sources if w == "dram"])
                for name, cache in tiers:
                    cache.touch([b for w, b in sources if w == name])
                promoted = {b for w, b in sources if w != "dram"}  # into DRAM, each under its own parent
                if promoted:
                    dram.put(r.blocks, start=hit, only=promoted)
            running.append(r)
            plan.append((r, n))
            budget -= n
        if not plan:  # nothing running and the next waiting request does not fit yet: it never will by waiting
            assert not running and upcoming is not None, "a fitting request could not be scheduled on an idle engine"
            now = upcoming.arrival
            continue
        prefills = [(r, n) for r, n in plan if r.computed < r.target]
        prefilled += sum(n for _, n in prefills)
        decodes = len(plan) - len(prefills)
        step = (costs.a + sum(costs.chunk(n, r.computed) for r, n in prefills) + costs.d1 * decodes
                if prefills else costs.d0 + costs.d1 * decodes) + load_s
        finished_prefill = [r for r, n in prefills if r.computed + n >= r.target]
        if dram is not None and tiers is not None:
            for r in finished_prefill:
                if r.generated == 0:
                    # The worker stores from the first chunk DRAM does not hold (its leading run untouched).
                    new = dram.put(r.blocks, start=dram.run(r.blocks))
                    stored_bytes["dram"] = stored_bytes.get("dram", 0) + len(new) * chunk_bytes
                    step += len(new) * chunk_bytes / costs.dram_store_bytes_per_s
                    for name, cache in tiers:
                        written = cache.put(new)
                        stored_bytes[name] = stored_bytes.get(name, 0) + len(written) * chunk_bytes
                        if name == shared and store_log is not None:
                            written_at = now + step + len(written) * chunk_bytes / costs.store.get(name, float("inf"))
                            for block in written:
                                store_log.setdefault(block, written_at)
                        if costs.shared_cpu and name in costs.store:
                            background += len(written) * chunk_bytes / costs.store[name]
        now += step + owed  # the background writes queued before this step ran on the engine's cores during it
        owed, background = background, 0.0
        steps += 1
        for r, n in plan:
            if r.computed < r.target:
                r.computed += n
                if r.computed < r.target:
                    continue
                if not r.registered:  # its whole prompt blocks join the prefix cache (a copy another
                    own = [b for b in r.blocks if b not in r.shared]  # request cached meanwhile is freed)
                    pool.private -= len(own)
                    r.private -= len(own)
                    pool.take(own)
                    r.shared += own
                    r.registered = True
            else:
                r.computed += 1
            r.generated += 1
            if r.ttft is None:
                r.ttft = now - r.arrival
            if r.generated >= r.output:
                r.finish = now
                running.remove(r)
                pool.release(r.shared[::-1])  # tail first, as vLLM frees: the tail is evicted before the head
                pool.private -= r.private
                r.shared, r.private = [], 0
    out = _summary(reqs, now, preemptions, steps, stored_bytes, loaded_bytes, costs, bt)
    out["refused"] = len(trace.requests) - len(fits)
    out["prefilled_tokens"] = prefilled
    return out


def _summary(reqs: list[_Request], end: float, preemptions: int, steps: int, stored: dict[str, int],
             loaded: dict[str, int], costs: Costs, bt: int) -> dict[str, Any]:
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
