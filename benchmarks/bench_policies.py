"""Eviction policies on the Mooncake traces: prefix-hit ratio of lru and prefix_lru (the store's own policy
classes, replayed as the DRAM pool runs them) against oracle admission, Belady's MIN and the infinite cache;
and on synthetic multi-tenant agent traces (kvtier.sim.trace.agent_trace, 256-token blocks, a 100-block cache)
against textbook leaf-first LRU too.

    .venv/bin/python benchmarks/bench_policies.py [--json benchmarks/results/policies-DATE.json]

The default DRAM policy is the one this script shows never losing (README, "Choosing the eviction policy").
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_store import machine

from kvtier.sim.cache import belady, default_capacities, leaf_first_lru, replay
from kvtier.sim.report import cache_report
from kvtier.sim.trace import agent_trace, load_trace

TRACES = Path(__file__).parent / "traces"
HEADLINE = (1000, 3000, 10000, 30000)
AGENT_CAPACITY = 100
# (name, agent_trace arguments): sessions within the cache, many sessions, and sessions that outgrow it
AGENT_SHAPES = (("4 sessions, up to 80 blocks", {}), ("16 sessions, up to 80 blocks", {"sessions": 16}),
                ("3 sessions, up to 120 blocks", {"sessions": 3, "longest_blocks": 120, "added_tokens": (50, 600)}),
                ("6 sessions, up to 150 blocks", {"sessions": 6, "longest_blocks": 150}),
                ("2 sessions, up to 200 blocks", {"sessions": 2, "longest_blocks": 200, "added_tokens": (50, 600)}))
AGENT_SEEDS = (0, 1, 2)


def agents() -> list[dict[str, object]]:
    rows = []
    for name, shape in AGENT_SHAPES:
        for seed in AGENT_SEEDS:
            trace = agent_trace(seed=seed, **shape)
            ratios = {"lru": replay(trace, "lru", AGENT_CAPACITY).ratio,
                      "prefix_lru": replay(trace, "prefix_lru", AGENT_CAPACITY).ratio,
                      "leaf_first_lru": leaf_first_lru(trace, AGENT_CAPACITY).ratio,
                      "belady": belady(trace, AGENT_CAPACITY).ratio}
            rows.append({"name": f"{name}, seed {seed}", "shape": {k: list(v) if isinstance(v, tuple) else v
                                                                  for k, v in shape.items()},
                         "seed": seed, "capacity_blocks": AGENT_CAPACITY, "requests": len(trace.requests),
                         "hit_ratio": {k: round(v, 6) for k, v in ratios.items()},
                         "prefix_lru_over_leaf_first": round(ratios["prefix_lru"] / ratios["leaf_first_lru"], 4)})
            print(f"| {name} | {seed} | " + " | ".join(f"{ratios[k]:.3f}" for k in
                                                      ("lru", "prefix_lru", "leaf_first_lru", "belady")) + " |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path(f"benchmarks/results/policies-{date.today()}.json"))
    parser.add_argument("--plots", type=Path, default=Path("benchmarks/results"),
                        help="where the hit-ratio PNGs go (policies-<trace>.png)")
    args = parser.parse_args()
    results = {"date": str(date.today()), "machine": machine(), "python": platform.python_version(), "traces": {}}
    for name in ("conversation", "synthetic"):
        trace = load_trace(TRACES / f"{name}_trace.jsonl")
        caps = sorted(set(default_capacities(trace)) | set(HEADLINE))
        out = Path(f"/tmp/kvtier-bench-policies/{name}")
        report = cache_report(trace, caps, ["lru", "prefix_lru"], out)
        (args.plots / f"policies-{name}.png").write_bytes((out / "hit_ratio.png").read_bytes())
        ratio = report["hit_ratio"]
        worst = min(ratio["prefix_lru"][str(c)] / ratio["lru"][str(c)] for c in caps if ratio["lru"][str(c)] > 0)
        report["prefix_lru_over_lru_worst"] = round(worst, 4)
        results["traces"][name] = report
        print(f"{name}: prefix_lru / lru at its worst capacity = {worst:.4f}\n")
    print("| trace | capacity (blocks) | lru | prefix_lru | oracle admission | Belady | infinite |")
    print("|---|---|---|---|---|---|---|")
    for name, report in results["traces"].items():
        for c in HEADLINE:
            r = report["hit_ratio"]
            print(f"| {name} | {c:,} | " + " | ".join(f"{r[k][str(c)]:.3f}" for k in
                                                    ("lru", "prefix_lru", "oracle_admit", "belady", "infinite")) + " |")
    print("\n| agent trace | seed | lru | prefix_lru | textbook leaf-first LRU | Belady |")
    print("|---|---|---|---|---|---|")
    results["agents"] = agents()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
