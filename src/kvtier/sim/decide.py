"""``kvtier decide``: from a workload card, deployment facts and a calibration, whether and how to offload KV.

The facts (YAML; bad keys are a :class:`FactsError` naming the field)::

    engines: 1                # engines serving the workload
    engine:                   # each engine, as in a deployment (kv_tokens: its KV space in tokens)
      kv_tokens: 6144
      max_num_batched_tokens: 8192
      max_num_seqs: 64
    routing: session          # session: a session stays on one engine; round_robin: request by request
    dram_bytes: 2GiB          # host memory kvtier may take, per engine
    disk_bytes: 20GiB         # local disk per engine (absent or null: none)
    disk_tier: filesystem     # the calibration's tier that measured that disk
    shared:                   # shared tiers that could be run, each a tier of the calibration
      - name: redis
        capacity_bytes: 50GiB
    policy: prefix_lru
    block_tokens: 256         # default: the calibration's chunk

The card's trace is timed (:mod:`kvtier.sim.timing`) with no offloading, with engine-local offloading (kvtier's
DRAM, and the disk when there is one) and with each shared tier behind DRAM. A shared tier holds what every
engine wrote: the engines are timed once to learn when each block is first written, then again with every
other engine's blocks available from those times. An option pays when it cuts TTFT p50 or p90 by
:data:`PAYS` and worsens neither by as much; the answer is the paying option with the lowest p90, and a shared
tier must also beat engine-local offloading by :data:`PAYS`. Every reason is a number; when the answer is close
(:func:`choose`), it says what to measure next.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import KVTierError
from kvtier.eviction import POLICIES
from kvtier.sim import breakeven
from kvtier.sim.card import Card, Workload, generate
from kvtier.sim.cache import infinite, lru_curve
from kvtier.sim.deployment import ENGINE_KEYS, Deployment, EngineSpec, KVTierSpec, TierSpec, engine_spec, tier_specs
from kvtier.sim.fields import Fields
from kvtier.sim.timing import Costs, simulate
from kvtier.sim.trace import Request, Trace

PAYS = 0.05
CLOSE = 0.10
SIZE_SHARE = 0.95  # a tier is sized to keep this share of the hits an unbounded one would give


class FactsError(KVTierError, ValueError):
    """Deployment facts are malformed: the message names the field."""


_F = Fields(FactsError)


@dataclasses.dataclass(frozen=True)
class Facts:
    engine: EngineSpec
    engines: int = 1
    routing: str = "session"
    dram_bytes: int = 2**31
    disk_bytes: int | None = None
    disk_tier: str = "filesystem"
    shared: tuple[TierSpec, ...] = ()
    policy: str = "prefix_lru"
    block_tokens: int | None = None


def load_facts(source: str | Path | Mapping[str, Any]) -> Facts:
    top = _F.mapping(_F.load(source, "deployment facts"), "facts",
                     ("engines", "engine", "routing", "dram_bytes", "disk_bytes", "disk_tier", "shared", "policy",
                      "block_tokens"))
    routing = top.get("routing", "session")
    if routing not in ("session", "round_robin"):
        raise FactsError(f"routing: expected session or round_robin, got {routing!r}")
    policy = top.get("policy", "prefix_lru")
    if not isinstance(policy, str) or policy not in POLICIES.names():
        raise FactsError(f"policy: unknown policy {policy!r}; known: {', '.join(POLICIES.names())}")
    disk_tier = top.get("disk_tier", "filesystem")
    if not isinstance(disk_tier, str) or not disk_tier:
        raise FactsError(f"disk_tier: expected a tier name of the calibration, got {disk_tier!r}")
    return Facts(
        engine=engine_spec(_F.mapping(top.get("engine"), "engine", ENGINE_KEYS), "engine", _F),
        engines=_F.int(top, "engines", "facts", default=1),
        routing=routing,
        dram_bytes=_F.size(top, "dram_bytes", "facts", required=True),  # type: ignore[arg-type]
        disk_bytes=_F.size(top, "disk_bytes", "facts", required=False),
        disk_tier=disk_tier,
        shared=tier_specs(top.get("shared") or [], "shared", _F),
        policy=policy,
        block_tokens=_F.int(top, "block_tokens", "facts", default=0) or None)


def split(workload: Workload, engines: int, routing: str) -> list[Trace]:
    """The requests each engine serves."""
    parts: list[list[Request]] = [[] for _ in range(engines)]
    for i, (request, session) in enumerate(zip(workload.trace.requests, workload.sessions)):
        parts[(session if routing == "session" else i) % engines].append(request)
    t = workload.trace
    return [Trace(tuple(p), t.block_tokens, t.source) for p in parts if p]


def crossing_share(workload: Workload, engines: int, routing: str) -> float:
    """Of the block accesses that reuse a block seen before, the share whose last access was on another engine:
    the reuse only a shared tier (or a router) can serve."""
    last: dict[int, int] = {}
    reuses = crossing = 0
    for i, (request, session) in enumerate(zip(workload.trace.requests, workload.sessions)):
        engine = (session if routing == "session" else i) % engines
        for block in request.blocks[:request.whole]:
            if block in last:
                reuses += 1
                crossing += last[block] != engine
            last[block] = engine
    return crossing / reuses if reuses else 0.0


def unique(trace: Trace) -> Trace:
    """The same arrivals and lengths with nothing shared: what offloading costs when it never hits."""
    out, fresh = [], 0
    for r in trace.requests:
        blocks = tuple(range(fresh, fresh + len(r.blocks)))
        fresh += len(r.blocks)
        out.append(dataclasses.replace(r, blocks=blocks))
    return Trace(tuple(out), trace.block_tokens, trace.source)


def run_option(parts: list[Trace], deployment: Deployment, costs: Costs, shared: str | None = None) -> dict[str, Any]:
    """Time every engine's share; with a shared tier, twice (the second time seeing the others' writes)."""
    elsewhere: list[dict[int, float] | None] = [None] * len(parts)
    if shared is not None and len(parts) > 1:
        logs: list[dict[int, float]] = []
        for part in parts:
            logs.append({})
            simulate(part, deployment, costs, shared=shared, store_log=logs[-1])
        for e in range(len(parts)):
            seen: dict[int, float] = {}
            for other, log in enumerate(logs):
                if other != e:
                    for block, at in log.items():
                        if at < seen.get(block, float("inf")):
                            seen[block] = at
            elsewhere[e] = seen
    runs = [simulate(part, deployment, costs, shared=shared, elsewhere=elsewhere[e]) for e, part in enumerate(parts)]
    ttft = np.array([row["ttft_s"] for run in runs for row in run["requests"]])
    prompts = sum(r.input_length for part in parts for r in part.requests)
    loaded: dict[str, int] = {}
    for run in runs:
        for tier, tokens in run["loaded_tokens"].items():
            loaded[tier] = loaded.get(tier, 0) + tokens
    engine_hits = sum(run["engine_hit_tokens"] for run in runs)
    return {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
            "ttft_mean_s": float(ttft.mean()),
            "hit_ratio": (engine_hits + sum(loaded.values())) / prompts,
            "engine_hit_tokens": engine_hits, "loaded_tokens": loaded,
            "output_tokens_per_s": sum(run["output_tokens_per_s"] for run in runs),
            "preemptions": sum(run["preemptions"] for run in runs),
            "refused": sum(run["refused"] for run in runs)}


def deployments(facts: Facts) -> dict[str, tuple[Deployment, str | None]]:
    """The options: each one's deployment of every engine, and the tier it shares (if any)."""
    local = (TierSpec(facts.disk_tier, facts.disk_bytes),) if facts.disk_bytes else ()
    out: dict[str, tuple[Deployment, str | None]] = {
        "none": (Deployment(facts.engine), None),
        "local": (Deployment(facts.engine, KVTierSpec(facts.dram_bytes, facts.policy, local)), None)}
    for tier in facts.shared:
        out[f"shared:{tier.name}"] = (Deployment(facts.engine, KVTierSpec(facts.dram_bytes, facts.policy,
                                                                           (*local, tier))), tier.name)
    return out


def choose(options: Mapping[str, Mapping[str, float]]) -> tuple[str, str | None, bool]:
    """The answer, its nearest rival and whether the answer is close, from each option's ``ttft_p50_s`` and
    ``ttft_p90_s`` (``none`` among them); see the module docstring.

    When the answer is ``none`` the rival is the option that gains most, and the answer is close when that gain
    reaches half of :data:`PAYS`. Otherwise the rival is ``none`` or, when another option comes within
    :data:`CLOSE` on p90, that one; close when the answer gains less than twice :data:`PAYS` over ``none`` or
    a rival comes within :data:`CLOSE`."""
    base = options["none"]
    others = [n for n in options if n != "none"]
    paying = [n for n in others if _pays(base, options[n])]
    answer = min(paying, key=lambda n: options[n]["ttft_p90_s"]) if paying else "none"
    if answer.startswith("shared:") and "local" in paying and not _pays(options["local"], options[answer]):
        answer = "local"
    if answer == "none":
        rival = max(others, key=lambda n: _best_gain(base, options[n]), default=None)
        return answer, rival, rival is not None and _best_gain(base, options[rival]) >= PAYS / 2
    near = [n for n in others if n != answer
            and abs(1 - options[answer]["ttft_p90_s"] / options[n]["ttft_p90_s"]) < CLOSE]
    if near:
        return answer, near[0], True
    return answer, "none", _best_gain(base, options[answer]) < 2 * PAYS


def _best_gain(base: Mapping[str, Any], option: Mapping[str, Any]) -> float:
    return max(_gain(base, option, "ttft_p50_s"), _gain(base, option, "ttft_p90_s"))


def _gain(base: Mapping[str, Any], option: Mapping[str, Any], key: str) -> float:
    return 1 - option[key] / base[key] if base[key] > 0 else 0.0


def _pays(base: Mapping[str, Any], option: Mapping[str, Any]) -> bool:
    """It cuts p50 or p90 by PAYS and worsens neither by as much."""
    g50, g90 = _gain(base, option, "ttft_p50_s"), _gain(base, option, "ttft_p90_s")
    return max(g50, g90) >= PAYS and min(g50, g90) > -PAYS


def size_for_reuse(trace: Trace, chunk_bytes: int) -> int:
    """Bytes an LRU cache of the trace's blocks needs to keep :data:`SIZE_SHARE` of an unbounded one's hits."""
    best = infinite(trace).hits
    if best == 0:
        return 0
    curve = lru_curve(trace)
    capacity = next((c for c in range(1, curve.saturation + 1) if curve.at(c).hits >= SIZE_SHARE * best),
                    curve.saturation)
    return capacity * chunk_bytes


def decide(card: Card, facts: Facts, calibration: dict[str, Any], log=None) -> dict[str, Any]:
    """Time the options and answer; see the module docstring."""
    def say(msg: str) -> None:
        if log is not None:
            log(msg)

    costs = Costs.from_calibration(calibration)
    bt = facts.block_tokens or int(calibration["model"].get("chunk_tokens") or 256)
    for name in [*(t.name for t in facts.shared), *([facts.disk_tier] if facts.disk_bytes else [])]:
        if name not in costs.load:
            raise FactsError(f"{'disk_tier' if name == facts.disk_tier else 'shared'}: {name!r} is not a tier of "
                             f"the calibration (calibrated: {', '.join(costs.load)}); measure it with "
                             "`kvtier calibrate --config`")
    workload = generate(card, bt)
    trace = workload.trace
    parts = split(workload, facts.engines, facts.routing)
    chunk_bytes = costs.kv_bytes_per_token * bt
    plans = deployments(facts)
    options = {}
    for name, (deployment, shared) in plans.items():
        say(f"timing {name} on {len(trace.requests)} requests, {len(parts)} engine(s)")
        options[name] = run_option(parts, deployment, costs, shared)
    say("timing DRAM x disk sizes for the heatmap")
    grid_result = size_grid(parts, facts, costs, chunk_bytes)
    say("timing the same arrivals with nothing shared (the cost at zero hits)")
    lonely = [unique(part) for part in parts]
    zero = {name: run_option(lonely, plans[name][0], costs) for name in ("none", "local")}
    median_prompt = int(np.median([r.input_length for r in trace.requests]))
    tiers = {"dram": None, **({facts.disk_tier: None} if facts.disk_bytes else {}),
             **{t.name: None for t in facts.shared}}
    grid = breakeven.lengths(bt)
    needed = breakeven.needed_bandwidth(costs, median_prompt)
    tier_facts = {t: {"bandwidth_bytes_per_s": costs.load[t][1], "latency_s": costs.load[t][0],
                      "needed_bytes_per_s_at_median_prompt": needed,
                      "break_even_tokens": breakeven.break_even(costs, t, bt, grid)} for t in tiers}
    local_need = max(size_for_reuse(part, chunk_bytes) for part in parts)
    shared_need = size_for_reuse(trace, chunk_bytes)
    answer, rival, close = choose(options)
    result = {
        "card": dataclasses.asdict(card), "facts": _plain(facts), "block_tokens": bt,
        "requests": len(trace.requests), "median_prompt_tokens": median_prompt,
        "options": options,
        "answer": answer,
        "rival": rival,
        "close": close,
        "zero_hit_cost": {
            "ttft_p50_ratio": zero["local"]["ttft_p50_s"] / zero["none"]["ttft_p50_s"],
            "ttft_p90_ratio": zero["local"]["ttft_p90_s"] / zero["none"]["ttft_p90_s"],
            "throughput_ratio": zero["local"]["output_tokens_per_s"] / zero["none"]["output_tokens_per_s"]},
        "crossing_share": crossing_share(workload, facts.engines, facts.routing),
        "tiers": tier_facts,
        "heatmap": grid_result,
        "sizes": {"local_bytes_for_reuse": local_need, "shared_bytes_for_reuse": shared_need,
                  "dram_bytes": facts.dram_bytes, "disk_bytes": facts.disk_bytes},
    }
    result["reasons"] = _reasons(result)
    result["measure_next"] = _next(result) if result["close"] else []
    return result


def size_grid(parts: list[Trace], facts: Facts, costs: Costs, chunk_bytes: int) -> dict[str, Any]:
    """Engine-local offloading's TTFT p90 over DRAM sizes (an eighth to four times the facts') by disk sizes
    (none, and a sixteenth to all of the facts' disk, or to the trace's footprint when the facts have none)."""
    drams = sorted({max(chunk_bytes, int(facts.dram_bytes * f)) for f in (0.125, 0.25, 0.5, 1, 2, 4)})
    footprint = max(part.distinct_blocks for part in parts) * chunk_bytes
    top = facts.disk_bytes or max(footprint, chunk_bytes)
    disks = [0, *sorted({max(chunk_bytes, int(top * f)) for f in (0.0625, 0.25, 1)})]
    p90 = []
    for disk in disks:
        tiers = (TierSpec(facts.disk_tier, disk),) if disk else ()
        row = []
        for dram in drams:
            deployment = Deployment(facts.engine, KVTierSpec(dram, facts.policy, tiers))
            row.append(run_option(parts, deployment, costs)["ttft_p90_s"])
        p90.append(row)
    return {"dram_bytes": drams, "disk_bytes": disks, "disk_tier": facts.disk_tier, "ttft_p90_s": p90}


def _plain(facts: Facts) -> dict[str, Any]:
    return dataclasses.asdict(facts)


def _gib(n: float | None) -> str:
    return "none" if n is None else f"{n / 2**30:.2f} GiB"


def _reasons(r: dict[str, Any]) -> list[str]:
    base = r["options"]["none"]
    out = []
    for name, o in r["options"].items():
        if name == "none":
            out.append(f"no offloading: TTFT p50 {o['ttft_p50_s']:.3f} s, p90 {o['ttft_p90_s']:.3f} s, "
                       f"prefix hits {o['hit_ratio']:.1%} of prompt tokens (the engine's own cache)")
            continue
        out.append(f"{name}: TTFT p50 {o['ttft_p50_s']:.3f} s ({_gain(base, o, 'ttft_p50_s'):+.1%} vs none), "
                   f"p90 {o['ttft_p90_s']:.3f} s ({_gain(base, o, 'ttft_p90_s'):+.1%}); prefix hits "
                   f"{o['hit_ratio']:.1%} (engine {base['hit_ratio']:.1%} without offloading)")
    refused = r["options"]["none"]["refused"]
    if refused:
        out.append(f"{refused} of {r['requests']} requests do not fit the engine's KV space (prompt and output) "
                   "and were left out of every option")
    z = r["zero_hit_cost"]
    out.append(f"cost when nothing is reused (same arrivals, every prompt unique): local TTFT p50 x"
               f"{z['ttft_p50_ratio']:.3f}, p90 x{z['ttft_p90_ratio']:.3f}, throughput x{z['throughput_ratio']:.3f}")
    out.append(f"reuse that crosses engines: {r['crossing_share']:.1%} of reused blocks were last used on another "
               f"engine ({r['facts']['engines']} engine(s), {r['facts']['routing']} routing)")
    for tier, t in r["tiers"].items():
        even = t["break_even_tokens"]
        out.append(f"{tier}: delivers {t['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; beating recompute at the median "
                   f"prompt ({r['median_prompt_tokens']:,} tokens) needs {t['needed_bytes_per_s_at_median_prompt'] / 1e9:.3f}"
                   f" GB/s; break-even prompt length " + (f"{even:,} tokens" if even is not None else
                                                          "none up to 16K tokens (slower than recompute)"))
    s = r["sizes"]
    out.append(f"sizes to keep {SIZE_SHARE:.0%} of the reuse: {_gib(s['local_bytes_for_reuse'])} per engine "
               f"(given: DRAM {_gib(s['dram_bytes'])}, disk {_gib(s['disk_bytes'])}), "
               f"{_gib(s['shared_bytes_for_reuse'])} in a shared tier")
    return out


def _next(r: dict[str, Any]) -> list[str]:
    out = [f"the answer ({r['answer']}) is close to {r['rival']}: replay a trace of your own traffic on both "
           "with `kvtier validate`"]
    z = r["zero_hit_cost"]
    if max(z["ttft_p90_ratio"], 1 / z["throughput_ratio"]) > 1.02:
        out.append("offloading costs over 2% when nothing hits: measure your engine's throughput with no reuse, "
                   "with and without kvtier (`kvtier bench`)")
    for tier, t in r["tiers"].items():
        if t["bandwidth_bytes_per_s"] < 2 * t["needed_bytes_per_s_at_median_prompt"]:
            out.append(f"{tier} delivers less than twice the bandwidth recompute needs: measure it at the "
                       "concurrency you run (`kvtier calibrate --config`)")
    if r["crossing_share"] > 0.2 and r["facts"]["engines"] > 1:
        out.append("much of the reuse crosses engines: measure what a cache-aware router keeps local "
                   "(`kvtier router`) before paying for a shared tier")
    return out


def print_decision(r: dict[str, Any], out=sys.stdout) -> None:
    print(f"answer: {r['answer']}" + (f" (close to {r['rival']})" if r["close"] else ""), file=out)
    for line in r["reasons"]:
        print(f"  - {line}", file=out)
    if r["measure_next"]:
        print("measure next:", file=out)
        for line in r["measure_next"]:
            print(f"  - {line}", file=out)
