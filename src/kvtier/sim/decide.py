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
    shared:                   # shared tiers that could be run, each a tier of the calibration (no codec: decide
      - name: redis           # weighs codecs itself)
        capacity_bytes: 50GiB
    policy: prefix_lru
    block_tokens: 256         # default: the calibration's chunk

The card's trace is timed (:mod:`kvtier.sim.timing`) with no offloading, with engine-local offloading (kvtier's
DRAM, and the disk when there is one) and with each shared tier behind DRAM. A shared tier holds what every
engine wrote: the engines are timed once to learn when each block is first written, then again with every
other engine's blocks available from those times. An option pays when it cuts TTFT p50 or p90 by
:data:`PAYS` and worsens neither by as much; the answer is the paying option with the lowest p90, and a shared
tier must also beat engine-local offloading by :data:`PAYS`. The answer is then timed again storing a prefix only
once it comes again (``admission.store_after``: :func:`admission`). Every reason is a number; when the answer is
close (:func:`choose`), it says what to measure next.

Codecs: an option with tiers besides DRAM (the disk, a shared tier) is also timed with each codec the calibration
measured on all of them (``local+fp8``, ``shared:redis+lossless``: :mod:`kvtier.sim.codec_model` costs them), the
lossy ones (fp8, k16v8) only when the card says ``lossy_kv: true``. A codec must pay for its CPU time and, when
lossy, its accuracy: an option with one must pay against the same tiers without it, and a shared tier against
engine-local offloading with the same codec. Beside an answer (or a close rival) that stores KV lossily, the
decision shows what the codec did to a model's output where ``benchmarks/bench_codecs.py`` measured it
(:mod:`kvtier.sim.accuracy`), and says so where it did not.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvtier.codecs import CODECS
from kvtier.config import FieldReader
from kvtier.errors import KVTierError
from kvtier.eviction import POLICIES
from kvtier.sim import accuracy as measured_accuracy
from kvtier.sim import breakeven, codec_model
from kvtier.sim.accuracy import Accuracy, NoAccuracy
from kvtier.sim.codec_model import split_option
from kvtier.sim.card import Card, Workload, generate
from kvtier.sim.cache import infinite, lru_curve
from kvtier.sim.deployment import ENGINE_KEYS, Deployment, EngineSpec, KVTierSpec, TierCapacity, engine_spec, tier_specs
from kvtier.sim.timing import StepCosts, simulate
from kvtier.sim.trace import Request, Trace
from kvtier.units import size_label

PAYS = 0.05
CLOSE = 0.10
ADMIT_AFTER = 2  # the admission decide tries: a prefix stored once it comes again
NEUTRAL = 0.01  # a change smaller than this is none
SIZE_SHARE = 0.95  # a tier is sized to keep this share of the hits an unbounded one would give


class FactsError(KVTierError, ValueError):
    """Deployment facts are malformed: the message names the field."""


_F = FieldReader(FactsError)


@dataclasses.dataclass(frozen=True)
class Facts:
    engine: EngineSpec
    dram_bytes: int
    engines: int = 1
    routing: str = "session"
    disk_bytes: int | None = None
    disk_tier: str = "filesystem"
    shared: tuple[TierCapacity, ...] = ()
    policy: str = "prefix_lru"
    block_tokens: int | None = None


def load_facts(source: str | Path | Mapping[str, Any]) -> Facts:
    top = _F.mapping(_F.load(source, "deployment facts"), "facts",
                     ("engines", "engine", "routing", "dram_bytes", "disk_bytes", "disk_tier", "shared", "policy",
                      "block_tokens"))
    routing = top.get("routing", "session")
    if routing not in ("session", "round_robin"):
        raise FactsError(f"facts.routing: expected session or round_robin, got {routing!r}")
    policy = top.get("policy", "prefix_lru")
    if not isinstance(policy, str) or policy not in POLICIES.names():
        raise FactsError(f"facts.policy: unknown policy {policy!r}; known: {', '.join(POLICIES.names())}")
    disk_tier = top.get("disk_tier", "filesystem")
    if not isinstance(disk_tier, str) or not disk_tier or disk_tier == "dram":
        raise FactsError(f"facts.disk_tier: expected a (non-DRAM) tier name of the calibration, got {disk_tier!r}")
    engine = engine_spec(_F.mapping(top.get("engine"), "engine", ENGINE_KEYS), "engine", _F)
    disk = _F.size(top, "disk_bytes", "facts", required=False)
    shared = tier_specs([] if top.get("shared") is None else top["shared"], "facts.shared", _F)
    for i, tier in enumerate(shared):
        if tier.name == "dram" or (disk and tier.name == disk_tier):
            raise FactsError(f"facts.shared[{i}].name: {tier.name!r} is kvtier's DRAM or the local disk tier; a "
                             "shared tier needs a name of its own")
        if tier.codec != "none":
            raise FactsError(f"facts.shared[{i}].codec: decide weighs the codecs itself (lossy ones where the card "
                             "says lossy_kv: true); leave it out")
    block = _F.int(top, "block_tokens", "facts", default=0, maximum=16384) or None
    if block is not None and block > engine.kv_tokens:
        raise FactsError(f"facts.block_tokens: {block} is more than the engine's KV space ({engine.kv_tokens} tokens)")
    return Facts(engine=engine, engines=_F.int(top, "engines", "facts", default=1, maximum=4096), routing=routing,
                 dram_bytes=_F.size(top, "dram_bytes", "facts", required=True),
                 disk_bytes=disk, disk_tier=disk_tier, shared=shared, policy=policy, block_tokens=block)


def split(workload: Workload, engines: int, routing: str) -> list[Trace]:
    """The requests each engine serves."""
    parts: list[list[Request]] = [[] for _ in range(engines)]
    for i, (request, session) in enumerate(zip(workload.trace.requests, workload.sessions)):
        parts[(session if routing == "session" else i) % engines].append(request)
    t = workload.trace
    return [Trace(tuple(p), t.block_tokens, t.source) for p in parts if p]


def crossing_share(workload: Workload, engines: int, routing: str) -> float:
    """Of the block accesses that reuse a block seen before, the share on an engine that never had it: the reuse
    only a shared tier (or a router sending the request where the block is) can serve."""
    seen: dict[int, set[int]] = {}
    reuses = crossing = 0
    for i, (request, session) in enumerate(zip(workload.trace.requests, workload.sessions)):
        engine = (session if routing == "session" else i) % engines
        for block in request.blocks[:request.whole]:
            where = seen.setdefault(block, set())
            if where:
                reuses += 1
                crossing += engine not in where
            where.add(engine)
    return crossing / reuses if reuses else 0.0


def unique(parts: list[Trace]) -> list[Trace]:
    """The same arrivals and lengths with nothing shared, on any engine: what offloading costs when it never
    hits."""
    out, fresh = [], 0
    for trace in parts:
        requests = []
        for r in trace.requests:
            requests.append(dataclasses.replace(r, blocks=tuple(range(fresh, fresh + len(r.blocks)))))
            fresh += len(r.blocks)
        out.append(Trace(tuple(requests), trace.block_tokens, trace.source))
    return out


class Plan(NamedTuple):
    """An option: the deployment of every engine, and the tier it shares (if any). (Its codec is in its
    deployment's tiers and in its name: :func:`~kvtier.sim.codec_model.split_option`.)"""

    deployment: Deployment
    shared: str | None = None


def run_option(parts: list[Trace], deployment: Deployment, costs: StepCosts, shared: str | None = None
               ) -> dict[str, Any]:
    """Time every engine's share of the requests, and put the results together.

    With a shared tier and several engines, each engine is timed once to learn when it writes each block to the
    tier, then again seeing the other engines' blocks from then until the tier evicts them. The tier's capacity
    is one LRU over every engine's writes in the order they happen (reads do not refresh it); each engine's own
    writes, in the second pass, take its share of the capacity."""
    elsewhere: Sequence[dict[int, tuple[float, float]] | None] = [None] * len(parts)
    if shared is not None and len(parts) > 1:
        assert deployment.kvtier is not None
        logs: list[dict[int, float]] = []
        for part in parts:
            logs.append({})
            simulate(part, deployment, costs, shared=shared, store_log=logs[-1])
        tier = next(t for t in deployment.kvtier.tiers if t.name == shared)
        chunk = costs.kv_bytes_per_token * parts[0].block_tokens
        capacity = codec_model.blocks_held(tier.capacity_bytes, chunk, costs.codecs[tier.codec])
        elsewhere = _windows(logs, capacity)
        share = None if tier.capacity_bytes is None else max(chunk, tier.capacity_bytes // len(parts))
        tiers = tuple(dataclasses.replace(t, capacity_bytes=share) if t.name == shared else t
                      for t in deployment.kvtier.tiers)
        deployment = dataclasses.replace(deployment, kvtier=dataclasses.replace(deployment.kvtier, tiers=tiers))
    runs = [simulate(part, deployment, costs, shared=shared, elsewhere=elsewhere[e]) for e, part in enumerate(parts)]
    rows = [row for run in runs for row in run["requests"]]
    ttft = np.array([row["ttft_s"] for row in rows])
    loaded: dict[str, int] = {}
    for run in runs:
        for tier_name, tokens in run["loaded_tokens"].items():
            loaded[tier_name] = loaded.get(tier_name, 0) + tokens
    # A preempted request loads again what it loaded before: a request's hits count up to its prompt once.
    first = sum(min(row["engine_hit_tokens"] + sum(row["loaded_tokens"].values()), row["prompt_tokens"])
                for row in rows)
    return {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
            "ttft_mean_s": float(ttft.mean()),
            "hit_ratio": first / sum(row["prompt_tokens"] for row in rows),
            "engine_hit_tokens": sum(run["engine_hit_tokens"] for run in runs), "loaded_tokens": loaded,
            "output_tokens_per_s": sum(run["output_tokens_per_s"] for run in runs),
            "preemptions": sum(run["preemptions"] for run in runs),
            "refused": sum(run["refused"] for run in runs),
            "encode_cpu_s": sum(run["encode_cpu_s"] for run in runs)}


def _windows(logs: list[dict[int, float]], capacity: int | None) -> list[dict[int, tuple[float, float]]]:
    """For each engine, when each block another engine wrote is in the shared tier: from its first write by
    another engine until the tier (an LRU of ``capacity`` blocks over all writes in time order) evicts it."""
    writes = sorted((at, engine, block) for engine, log in enumerate(logs) for block, at in log.items())
    evicted: dict[int, list[float]] = {}
    resident: OrderedDict[int, None] = OrderedDict()
    for at, _, block in writes:
        if block in resident:
            resident.move_to_end(block)
            continue
        resident[block] = None
        if capacity is not None and len(resident) > capacity:
            victim, _ = resident.popitem(last=False)
            evicted.setdefault(victim, []).append(at)
    out: list[dict[int, tuple[float, float]]] = []
    for e in range(len(logs)):
        window: dict[int, tuple[float, float]] = {}
        for at, engine, block in writes:
            if engine != e and block not in window:
                until = next((t for t in evicted.get(block, ()) if t >= at), float("inf"))
                window[block] = (at, until)
        out.append(window)
    return out


def deployments(facts: Facts, codecs: Sequence[str] = ()) -> dict[str, Plan]:
    """The options by name: no offloading, engine-local offloading and each shared tier, and those with tiers
    besides DRAM again with each of ``codecs`` on all of them (``local+fp8``)."""
    local = (TierCapacity(facts.disk_tier, facts.disk_bytes),) if facts.disk_bytes else ()
    placements = {"local": (local, None), **{f"shared:{t.name}": ((*local, t), t.name) for t in facts.shared}}
    out = {"none": Plan(Deployment(facts.engine))}
    for name, (tiers, shared) in placements.items():
        for codec in ("none", *codecs) if tiers else ("none",):
            coded = tuple(dataclasses.replace(t, codec=codec) for t in tiers)
            out[name if codec == "none" else f"{name}+{codec}"] = Plan(
                Deployment(facts.engine, KVTierSpec(facts.dram_bytes, facts.policy, coded)), shared)
    return out


def choose(options: Mapping[str, Mapping[str, float]]) -> tuple[str, str | None, bool]:
    """The answer, its nearest rival and whether the answer is close, from each option's ``ttft_p50_s``,
    ``ttft_p90_s`` and (when given) ``output_tokens_per_s``, ``none`` among them; see the module docstring.

    An option pays when it pays against ``none`` (:func:`_pays`); a shared tier must pay against ``local`` too.
    The answer is the paying option with the lowest p90, or ``none``. When it is ``none``, the rival is the
    option that gains most, and the answer is close when that gain reaches half of :data:`PAYS`. Otherwise the
    rival is the nearest other option that pays against ``none`` when its p90 is within :data:`CLOSE` (the
    answer is then close), else ``none`` (close when the answer gains less than twice :data:`PAYS`)."""
    base = options["none"]
    others = [n for n in options if n != "none"]
    paying = [n for n in others if _pays(base, options[n])]
    eligible = [n for n in paying if all(_pays(options[o], options[n]) for o in _without_extras(n, options))]
    answer = min(eligible, key=lambda n: options[n]["ttft_p90_s"]) if eligible else "none"
    if answer == "none":
        rival = max(others, key=lambda n: _best_gain(base, options[n]), default=None)
        return answer, rival, rival is not None and _best_gain(base, options[rival]) >= PAYS / 2
    p90 = options[answer]["ttft_p90_s"]
    distance = {n: abs(1 - p90 / options[n]["ttft_p90_s"]) for n in paying if n != answer}
    near = min(distance, key=distance.__getitem__, default=None)
    if near is not None and distance[near] < CLOSE:
        return answer, near, True
    return answer, "none", _best_gain(base, options[answer]) < 2 * PAYS


def _without_extras(name: str, options: Mapping[str, Any]) -> list[str]:
    """The options ``name`` must pay against besides none: the same tiers without its codec, and for a shared tier,
    engine-local offloading with the same codec (else without one), where they were timed."""
    placement, codec = split_option(name)
    out = [placement] if codec != "none" else []
    if placement.startswith("shared:"):
        out.append(f"local+{codec}" if f"local+{codec}" in options else "local")
    return [o for o in out if o in options]


def _best_gain(base: Mapping[str, Any], option: Mapping[str, Any]) -> float:
    return max(_gain(base, option, "ttft_p50_s"), _gain(base, option, "ttft_p90_s"))


def _gain(base: Mapping[str, Any], option: Mapping[str, Any], key: str) -> float:
    return 1 - option[key] / base[key] if base[key] > 0 else 0.0


def _pays(base: Mapping[str, Any], option: Mapping[str, Any]) -> bool:
    """It cuts TTFT p50 or p90 by PAYS, and worsens neither, nor throughput, by as much."""
    g50, g90 = _gain(base, option, "ttft_p50_s"), _gain(base, option, "ttft_p90_s")
    throughput = ("output_tokens_per_s" not in base or "output_tokens_per_s" not in option
                  or option["output_tokens_per_s"] > (1 - PAYS) * base["output_tokens_per_s"])
    return max(g50, g90) >= PAYS and min(g50, g90) > -PAYS and throughput


def size_for_reuse(trace: Trace) -> int:
    """Blocks an LRU cache of the trace needs to keep :data:`SIZE_SHARE` of an unbounded one's hits."""
    best = infinite(trace).hits
    if best == 0:
        return 0
    curve = lru_curve(trace)
    low, high = 1, curve.saturation  # hits grow with capacity: the smallest capacity reaching the share
    while low < high:
        mid = (low + high) // 2
        if curve.at(mid).hits >= SIZE_SHARE * best:
            high = mid
        else:
            low = mid + 1
    return low


def decide(card: Card, facts: Facts, calibration: dict[str, Any], log=None,
           accuracy: Accuracy | NoAccuracy | None = None) -> dict[str, Any]:
    """Time the options and answer; see the module docstring. ``accuracy``: the lossy codecs' measured accuracy
    (:func:`kvtier.sim.accuracy.find_accuracy`; None: no file was given)."""
    def say(msg: str) -> None:
        if log is not None:
            log(msg)

    costs = StepCosts.from_calibration(calibration)
    bt = facts.block_tokens or int(calibration["model"].get("chunk_tokens") or 256)
    for name in [*(t.name for t in facts.shared), *([facts.disk_tier] if facts.disk_bytes else [])]:
        if name not in costs.load:
            raise FactsError(f"facts.{'disk_tier' if name == facts.disk_tier else 'shared'}: {name!r} is not a tier "
                             f"of the calibration (calibrated: {', '.join(costs.load)}); measure it with "
                             "`kvtier calibrate --config`")
    workload = generate(card, bt)
    trace = workload.trace
    parts = split(workload, facts.engines, facts.routing)
    weighed = codec_model.weigh(costs.codecs, card.lossy_kv, bool(facts.disk_bytes or facts.shared))
    plans = deployments(facts, weighed.codecs)
    options = {}
    for name, plan in plans.items():
        say(f"timing {name} on {len(trace.requests)} requests, {len(parts)} engine(s)")
        options[name] = run_option(parts, plan.deployment, costs, plan.shared)
    say("timing DRAM x disk sizes for the heatmap")
    grid_result = size_grid(parts, plans["local"].deployment, facts.disk_tier, facts.disk_bytes, costs)
    say("timing the same arrivals with nothing shared (the cost at zero hits)")
    lonely = unique(parts)
    zero = {name: run_option(lonely, plan.deployment, costs, plan.shared) for name, plan in plans.items()}
    median_prompt = int(np.median([r.input_length for r in trace.requests]))
    answer, rival, close = choose(options)
    if answer != "none":
        say(f"timing {answer} with admission.store_after {ADMIT_AFTER}, on the card and with nothing shared")
    result = {
        "card": dataclasses.asdict(card), "facts": _plain(facts), "block_tokens": bt,
        "requests": len(trace.requests), "median_prompt_tokens": median_prompt,
        "options": options,
        "answer": answer,
        "rival": rival,
        "close": close,
        "zero_hit_cost": {name: _zero_cost(z, zero["none"]) for name, z in zero.items() if name != "none"},
        "admission": None if answer == "none" else admission(parts, lonely, plans[answer], costs, options[answer],
                                                             zero, answer),
        "engines_used": len(parts),
        "crossing_share": crossing_share(workload, facts.engines, facts.routing),
        "tiers": breakeven.tier_facts(costs, ["dram", *([facts.disk_tier] if facts.disk_bytes else []),
                                                 *(t.name for t in facts.shared)], bt, median_prompt),
        "codecs": _codec_facts(weighed, costs, [n for n in (answer, rival) if n is not None],
                               accuracy or NoAccuracy("no accuracy file was given")),
        "heatmap": grid_result,
        "sizes": _sizes(facts, parts, trace, plans["local"].deployment, costs.kv_bytes_per_token * bt),
    }
    result["reasons"] = _reasons(result)
    result["measure_next"] = _next(result) if result["close"] else []
    return result


def _sizes(facts: Facts, parts: list[Trace], trace: Trace, local: Deployment, chunk_bytes: int) -> dict[str, Any]:
    """The DRAM per engine and the shared tier that keep :data:`SIZE_SHARE` of the reuse (raw bytes), and those
    given."""
    assert local.kvtier is not None, "the local plan runs kvtier"
    pages = -(-chunk_bytes // local.kvtier.page_bytes)
    return {"local_bytes_for_reuse": max(size_for_reuse(part) for part in parts) * pages * local.kvtier.page_bytes,
            "shared_bytes_for_reuse": size_for_reuse(trace) * chunk_bytes,
            "dram_bytes": facts.dram_bytes, "disk_bytes": facts.disk_bytes,
            "shared_capacity_bytes": {t.name: t.capacity_bytes for t in facts.shared}}


def _codec_facts(weighed: codec_model.Weighed, costs: StepCosts, named: list[str],
                 accuracy: Accuracy | NoAccuracy) -> dict[str, Any]:
    """The codecs weighed (their costs), why no others, and the accuracy of the lossy codecs of ``named`` (the
    answer and its rival)."""
    shown = dict.fromkeys(split_option(n).codec for n in named)
    return {"weighed": list(weighed.codecs), "costs": {c: dataclasses.asdict(costs.codecs[c]) for c in weighed.codecs},
            "not_weighed": list(weighed.why_not),
            "accuracy": [measured_accuracy.describe(c, accuracy, costs.kv_bytes_per_token) for c in shown
                         if c in codec_model.LOSSY]}


def admission(parts: list[Trace], lonely: list[Trace], plan: Plan, costs: StepCosts,
              every: Mapping[str, Any], zero: Mapping[str, Mapping[str, Any]], name: str) -> dict[str, Any]:
    """Option ``name`` (its ``plan``) timed again with ``admission.store_after`` :data:`ADMIT_AFTER`, on the
    card's ``parts`` and on ``lonely`` (nothing shared), against ``every`` and ``zero[name]`` (the same, storing
    every put; ``zero["none"]``: no offloading, nothing shared). It is
    recommended when it pays against storing every put (:func:`_pays`), or when it leaves the card's TTFT p50,
    p90, mean and throughput within :data:`NEUTRAL` and cuts the cost at zero hits (TTFT p90 or throughput) by as
    much:
    what a first repeat loses is then won back by the copies and writes it saves."""
    deployment, shared = plan.deployment, plan.shared
    assert deployment.kvtier is not None, "an option that stores"
    admitting = dataclasses.replace(deployment, kvtier=dataclasses.replace(deployment.kvtier, store_after=ADMIT_AFTER))
    card = run_option(parts, admitting, costs, shared)
    alone = run_option(lonely, admitting, costs, shared)
    neutral = (min(_gain(every, card, key) for key in ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s")) > -NEUTRAL
               and card["output_tokens_per_s"] >= (1 - NEUTRAL) * every["output_tokens_per_s"])
    saves = max(_gain(zero[name], alone, "ttft_p90_s"),
                alone["output_tokens_per_s"] / zero[name]["output_tokens_per_s"] - 1) >= NEUTRAL
    return {"store_after": ADMIT_AFTER, "card": card, "zero_hit_cost": _zero_cost(alone, zero["none"]),
            "recommended": _pays(every, card) or (neutral and saves)}


def _zero_cost(option: Mapping[str, Any], none: Mapping[str, Any]) -> dict[str, float]:
    """An option's TTFT and throughput with nothing reused, as ratios to no offloading's."""
    return {"ttft_p50_ratio": option["ttft_p50_s"] / none["ttft_p50_s"],
            "ttft_p90_ratio": option["ttft_p90_s"] / none["ttft_p90_s"],
            "throughput_ratio": option["output_tokens_per_s"] / none["output_tokens_per_s"]}


def size_grid(parts: list[Trace], local: Deployment, disk_tier: str, disk_bytes: int | None, costs: StepCosts,
              codec: str = "none") -> dict[str, Any]:
    """Engine-local offloading's TTFT p90 over DRAM sizes (an eighth to four times ``local``'s) by sizes of the
    disk tier storing chunks in ``codec`` (none, and a sixteenth to all of ``disk_bytes``, or of the trace's
    footprint when it is None)."""
    assert local.kvtier is not None
    chunk_bytes = costs.kv_bytes_per_token * parts[0].block_tokens
    drams = sorted({max(chunk_bytes, int(local.kvtier.dram_bytes * f)) for f in (0.125, 0.25, 0.5, 1, 2, 4)})
    footprint = max(part.distinct_blocks for part in parts) * chunk_bytes
    top = disk_bytes or max(footprint, chunk_bytes)
    disks = [0]
    if disk_tier in costs.load:  # a disk the calibration did not measure cannot be timed
        disks += sorted({max(chunk_bytes, int(top * f)) for f in (0.0625, 0.25, 1)})
    p90 = []
    for disk in disks:
        tiers = (TierCapacity(disk_tier, disk, codec),) if disk else ()
        row = []
        for dram in drams:
            kv = dataclasses.replace(local.kvtier, dram_bytes=dram, tiers=tiers)
            row.append(run_option(parts, dataclasses.replace(local, kvtier=kv), costs)["ttft_p90_s"])
        p90.append(row)
    return {"dram_bytes": drams, "disk_bytes": disks, "disk_tier": disk_tier, "ttft_p90_s": p90}


def _plain(facts: Facts) -> dict[str, Any]:
    return dataclasses.asdict(facts)


def _change(base: Mapping[str, Any], option: Mapping[str, Any], key: str) -> str:
    gain = _gain(base, option, key)
    return f"{abs(gain):.1%} {'lower' if gain >= 0 else 'higher'} than none"


def _reasons(r: dict[str, Any]) -> list[str]:
    base = r["options"]["none"]
    out = list(r["codecs"]["accuracy"])  # first: what a lossy answer does to the output
    for name, o in r["options"].items():
        if name == "none":
            out.append(f"no offloading: TTFT p50 {o['ttft_p50_s']:.3f} s, p90 {o['ttft_p90_s']:.3f} s, "
                       f"{o['output_tokens_per_s']:.1f} output tokens/s; prefix hits {o['hit_ratio']:.1%} of prompt "
                       "tokens (the engine's own cache)")
            continue
        encoding = (f"; encoding took {o['encode_cpu_s']:.2f} CPU-seconds on the writer threads"
                    if o.get("encode_cpu_s") else "")
        out.append(f"{name}: TTFT p50 {o['ttft_p50_s']:.3f} s ({_change(base, o, 'ttft_p50_s')}), p90 "
                   f"{o['ttft_p90_s']:.3f} s ({_change(base, o, 'ttft_p90_s')}), {o['output_tokens_per_s']:.1f} "
                   f"output tokens/s; prefix hits {o['hit_ratio']:.1%}{encoding}")
    refused = r["options"]["none"]["refused"]
    if refused:
        out.append(f"{refused} of {r['requests']} requests do not fit the engine's KV space (prompt and output) "
                   "and were left out of every option")
    for name, z in r["zero_hit_cost"].items():
        out.append(f"{name} when nothing is reused (same arrivals, every prompt unique): TTFT p50 "
                   f"x{z['ttft_p50_ratio']:.3f}, p90 x{z['ttft_p90_ratio']:.3f}, throughput "
                   f"x{z['throughput_ratio']:.3f} of none's")
    out.append(f"reuse that crosses engines: {r['crossing_share']:.1%} of reused blocks reach an engine that never "
               f"had them ({r['engines_used']} engine(s) serving, {r['facts']['routing']} routing)")
    if r["admission"] is not None:
        out.append(_admission_line(r))
    for tier, t in r["tiers"].items():
        even = t["break_even_tokens"]
        out.append(f"{tier}: delivers {_rate(t['bandwidth_bytes_per_s'])}; beating recompute at the median prompt "
                   f"({r['median_prompt_tokens']:,} tokens) needs {_rate(t['needed_bytes_per_s_at_median_prompt'])};"
                   " break-even prompt length " + (f"{even:,} tokens" if even is not None else
                                                   "none up to 16K tokens (slower than recompute)"))
    out += [_codec_line(c) for c in r["codecs"]["costs"].values()]
    out += r["codecs"]["not_weighed"]
    s = r["sizes"]
    line = (f"sizes to keep {SIZE_SHARE:.0%} of the reuse: {_size(s['local_bytes_for_reuse'])} of DRAM per engine "
            f"(given: DRAM {_size(s['dram_bytes'])}, disk {_size(s['disk_bytes']) if s['disk_bytes'] else 'none'})")
    if s["shared_capacity_bytes"]:
        line += f", {_size(s['shared_bytes_for_reuse'])} in a shared tier (given: " + ", ".join(
            f"{name} {_size(c)}" for name, c in s["shared_capacity_bytes"].items()) + ")"
    out.append(line)
    return out


def _admission_line(r: dict[str, Any]) -> str:
    a, every = r["admission"], r["options"][r["answer"]]
    card, zero, every_zero = a["card"], a["zero_hit_cost"], r["zero_hit_cost"][r["answer"]]

    def against(key: str) -> str:
        gain = _gain(every, card, key)
        return f"{abs(gain):.1%} {'lower' if gain >= 0 else 'higher'}"

    return (f"{r['answer']} storing a prefix only once it comes again (admission.store_after {a['store_after']}): "
            f"TTFT p50 {card['ttft_p50_s']:.3f} s ({against('ttft_p50_s')}), p90 {card['ttft_p90_s']:.3f} s "
            f"({against('ttft_p90_s')} than storing every put), {card['output_tokens_per_s']:.1f} output tokens/s, "
            f"prefix hits {card['hit_ratio']:.1%}; when nothing is reused TTFT p90 x{zero['ttft_p90_ratio']:.3f} and "
            f"throughput x{zero['throughput_ratio']:.3f} of none's (storing every put: "
            f"x{every_zero['ttft_p90_ratio']:.3f}, x{every_zero['throughput_ratio']:.3f}): "
            + ("recommended" if a["recommended"] else "not recommended"))


def _codec_line(c: Mapping[str, Any]) -> str:
    """What a weighed codec (a :class:`~kvtier.sim.codec_model.CodecCost`, as a mapping) stores and costs."""
    return (f"codec {c['name']} ({'exact' if c['exact'] else 'lossy'}): a tier stores {c['stored_over_raw']:.3f} of "
            f"the raw bytes ({1 / c['stored_over_raw']:.2f}x the chunks); one thread encodes "
            f"{_rate(c['encode_bytes_per_s'])} (on the writer threads) and decodes {_rate(c['decode_bytes_per_s'])} "
            "(added to each load), as `kvtier calibrate` measured")


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"


def _size(n: int | None) -> str:
    """A size as the decision prints it (``1.5 GiB``), or what its absence means."""
    if n is None:
        return "unbounded"
    return size_label(n) if n else "none"


def _next(r: dict[str, Any]) -> list[str]:
    out = [f"the answer ({r['answer']}) is close to {r['rival']}: replay a trace of your own traffic on both "
           "with `kvtier validate`"]
    for name, z in r["zero_hit_cost"].items():
        if max(z["ttft_p90_ratio"], 1 / z["throughput_ratio"]) > 1.02:
            out.append(f"{name} costs over 2% when nothing hits: measure your engine's throughput with no reuse, "
                       "with and without kvtier (`kvtier bench`)")
    for tier, t in r["tiers"].items():
        if t["bandwidth_bytes_per_s"] < 2 * t["needed_bytes_per_s_at_median_prompt"]:
            out.append(f"{tier} delivers less than twice the bandwidth recompute needs: measure it at the "
                       "concurrency you run (`kvtier calibrate --config`)")
    if r["crossing_share"] > 0.2 and r["engines_used"] > 1:
        out.append("much of the reuse crosses engines: measure what a cache-aware router keeps local "
                   "(`kvtier router`) before paying for a shared tier")
    return out


def _answer_line(r: dict[str, Any]) -> str:
    line = f"answer: {r['answer']}"
    if r["admission"] is not None and r["admission"]["recommended"]:
        line += f" with admission.store_after: {r['admission']['store_after']}"
    placement, codec = split_option(r["answer"])
    if codec != "none":
        line += f" (its tiers besides DRAM store chunks in {codec}: {'exact' if CODECS[codec].exact else 'lossy'})"
    if placement.startswith("shared:"):
        name = placement.split(":", 1)[1]
        ratio = r["codecs"]["costs"][codec]["stored_over_raw"] if codec != "none" else 1.0
        need = math.ceil(r["sizes"]["shared_bytes_for_reuse"] * ratio)
        given = r["sizes"]["shared_capacity_bytes"].get(name)
        line += f", sized to {_size(need)} ({SIZE_SHARE:.0%} of the reuse)"
        if given is not None and given < need:
            line += f"; the {_size(given)} timed holds less"
    return line + (f" (close to {r['rival']})" if r["close"] else "")


def print_decision(r: dict[str, Any], out=sys.stdout) -> None:
    print(_answer_line(r), file=out)
    for line in r["reasons"]:
        print(f"  - {line}", file=out)
    if r["measure_next"]:
        print("measure next:", file=out)
        for line in r["measure_next"]:
            print(f"  - {line}", file=out)
