"""``kvtier simulate``'s cache report: hit ratio per policy and capacity, as a table, JSON, CSV and a plot."""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

import numpy as np

from kvtier.sim.cache import HitCount, LRUCurve, compare, default_capacities, lru_curve
from kvtier.sim.decide import size_grid
from kvtier.sim.trace import Trace
from kvtier.units import size_label


def cache_report(trace: Trace, capacities: Sequence[int] | None, policies: Sequence[str], out: Path,
                 plot: bool = True) -> dict:
    """Run the cache layer, write ``cache.json``, ``cache.csv`` and (with ``plot``) ``hit_ratio.png`` under
    ``out``, print a table; returns what ``cache.json`` holds."""
    caps = sorted(set(capacities)) if capacities else default_capacities(trace)
    runs = 1 + (len(policies) + 2) * len(caps)  # the one-pass curve, the replays, oracle admission, Belady
    started = time.monotonic()
    with tqdm(total=runs * len(trace.requests), unit="req", desc="simulate: cache layer", file=sys.stderr,
              mininterval=1.0) as bar:
        curve = lru_curve(trace, progress=bar.update)
        table = compare(trace, caps, policies, progress=bar.update)
    elapsed = time.monotonic() - started
    result = {
        "trace": {"source": trace.source, "requests": len(trace.requests), "block_tokens": trace.block_tokens,
                  "block_accesses": trace.accesses, "distinct_whole_blocks": trace.distinct_blocks,
                  "skipped_empty_prompts": trace.skipped_empty},
        "model": "prefix hits of one cache; capacity in blocks; partial trailing blocks never stored",
        "seconds": round(elapsed, 2),
        "capacities": caps,
        "hit_ratio": {name: {str(c): round(h.ratio, 6) for c, h in row.items()} for name, row in table.items()},
        "hit_blocks": {name: {str(c): h.hits for c, h in row.items()} for name, row in table.items()},
        "lru_one_pass": {str(c): round(curve.at(c).ratio, 6) for c in caps},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache.json").write_text(json.dumps(result, indent=1) + "\n")
    with (out / "cache.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["capacity_blocks", *table])
        for c in caps:
            writer.writerow([c, *(f"{row[c].ratio:.6f}" for row in table.values())])
    _print_table(trace, caps, table, elapsed)
    if plot:
        _plot(trace, caps, table, curve, out / "hit_ratio.png")
    print(f"wrote {out / 'cache.json'}, {out / 'cache.csv'}" + (f", {out / 'hit_ratio.png'}" if plot else ""))
    return result


def _print_table(trace: Trace, caps: Sequence[int], table: dict[str, dict[int, HitCount]], elapsed: float) -> None:
    lines = "line" if trace.skipped_empty == 1 else "lines"
    skipped = f" ({trace.skipped_empty:,} {lines} with an empty prompt skipped)" if trace.skipped_empty else ""
    print(f"{trace.source}: {len(trace.requests):,} requests{skipped}, {trace.accesses:,} block lookups, "
          f"{trace.distinct_blocks:,} distinct whole blocks of {trace.block_tokens} tokens ({elapsed:.1f} s)")
    widths = {n: max(10, len(n)) for n in table}
    print("capacity  " + "  ".join(f"{n:>{w}}" for n, w in widths.items()))
    for c in caps:
        print(f"{c:>8}  " + "  ".join(f"{table[n][c].ratio:>{w}.4f}" for n, w in widths.items()))


def _plot(trace: Trace, caps: Sequence[int], table: dict[str, dict[int, HitCount]], curve: LRUCurve,
          path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in table.items():
        style: dict[str, dict[str, Any]] = {"belady": {"color": "black", "linestyle": "--"},
                                            "infinite": {"color": "grey", "linestyle": ":"},
                                            "oracle_admit": {"color": "tab:green", "linestyle": "-."}}
        ax.plot(caps, [row[c].ratio for c in caps], label=name, **style.get(name, {"marker": "."}))
    dense = np.unique(np.round(np.geomspace(1, max(curve.saturation, 2), 400)).astype(int))
    ax.plot(dense, [curve.at(int(c)).ratio for c in dense], color="tab:blue", alpha=0.35, linewidth=3,
            label="lru, one pass (all capacities)")
    ax.set_xscale("log")
    ax.set_xlabel(f"cache capacity (blocks of {trace.block_tokens} tokens)")
    ax.set_ylabel("prefix-hit ratio (blocks)")
    ax.set_title(Path(trace.source).name)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timing_report(trace: Trace, deployment, calibration: dict, out: Path, plot: bool = True) -> dict:
    """Run the timing layer with the deployment as described and, when it has kvtier, without; write
    ``timing.json``, ``requests.csv`` and ``ttft_cdf.png`` under ``out``; print a summary."""
    from kvtier.sim.timing import StepCosts, simulate

    costs = StepCosts.from_calibration(calibration)
    runs = {"kvtier": deployment} if deployment.kvtier is not None else {}
    runs["engine_alone"] = deployment.without_kvtier()
    results = {}
    for name, dep in runs.items():
        started = time.monotonic()
        print(f"simulate: timing {name} ...", file=sys.stderr, flush=True)
        results[name] = simulate(trace, dep, costs)
        print(f"simulate: timing {name}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    from kvtier.sim import breakeven

    lengths = breakeven.table(costs, trace.block_tokens)
    grid = None
    if deployment.kvtier is not None:
        tier = deployment.kvtier.tiers[0] if deployment.kvtier.tiers else None
        print("simulate: timing DRAM x disk sizes for the heatmap ...", file=sys.stderr, flush=True)
        grid = size_grid([trace], deployment, tier.name if tier else "filesystem",
                         tier.capacity_bytes if tier else None, costs, tier.codec if tier else "none")
    out.mkdir(parents=True, exist_ok=True)
    summary = {name: {k: v for k, v in r.items() if k != "requests"} for name, r in results.items()}
    (out / "timing.json").write_text(json.dumps({"trace": trace.source, "deployment": _plain(deployment),
                                                 "calibration": calibration.get("created"), "runs": summary,
                                                 "by_prompt_length": lengths, "heatmap": grid}, indent=1) + "\n")
    with (out / "requests.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "request", "arrival_s", "ttft_s", "finish_s", "prompt_tokens", "engine_hit_tokens",
                         "loaded_tokens", "preemptions"])
        for name, r in results.items():
            for row in r["requests"]:
                writer.writerow([name, row["request"], row["arrival_s"], row["ttft_s"], row["finish_s"],
                                 row["prompt_tokens"], row["engine_hit_tokens"],
                                 ";".join(f"{k}={v}" for k, v in row["loaded_tokens"].items()), row["preemptions"]])
    for name, r in results.items():
        t = r["ttft_s"]
        loaded = ", ".join(f"{k} {v:,}" for k, v in r["loaded_tokens"].items()) or "none"
        coded = (f"; codecs: {r['encode_cpu_s']:.2f} CPU-s encoding on the writer threads, {r['decode_s']:.2f} s "
                 "decoding in loads" if r["encode_cpu_s"] or r["decode_s"] else "")
        print(f"{name:>12}: TTFT p50 {t['p50']:.3f} s, p90 {t['p90']:.3f} s, p99 {t['p99']:.3f} s; "
              f"{r['requests_per_s']:.2f} req/s; engine hits {r['engine_hit_tokens']:,} tokens; loaded {loaded}; "
              f"avoided prefill {r['avoided_prefill_s']:.1f} s; preemptions {r['preemptions']}; "
              f"refused {r['refused']}{coded}")
    for tier, row in lengths["tiers"].items():
        even = row["break_even_tokens"]
        print(f"{'break-even':>12}: {tier} beats recompute from {even:,} tokens" if even is not None else
              f"{'break-even':>12}: {tier} never beats recompute up to 16K tokens")
    if plot:
        _plot_cdf(results, out / "ttft_cdf.png", Path(trace.source).name)
        breakeven.plot(lengths, out / "ttft_vs_length.png", Path(trace.source).name)
        if grid is not None:
            plot_heatmap(grid, out / "heatmap.png", Path(trace.source).name)
    print(f"wrote {out / 'timing.json'}, {out / 'requests.csv'}" +
          (f", {out / 'ttft_cdf.png'}, {out / 'ttft_vs_length.png'}" if plot else "") +
          (f", {out / 'heatmap.png'}" if plot and grid is not None else ""))
    return summary


def _plain(deployment) -> dict:
    import dataclasses

    return dataclasses.asdict(deployment)


def _plot_cdf(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        ttft = np.sort([row["ttft_s"] for row in r["requests"]])
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name.replace("_", " "))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"{title}: TTFT, simulated")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmap(grid: dict, path: Path, title: str) -> None:
    """TTFT p90 over DRAM (columns) by disk (rows) sizes, each cell labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = grid["ttft_p90_s"]
    fig, ax = plt.subplots(figsize=(1.2 * len(grid["dram_bytes"]) + 2, 0.7 * len(grid["disk_bytes"]) + 2))
    image = ax.imshow(values, cmap="viridis_r", aspect="auto", origin="lower")
    ax.set_xticks(range(len(grid["dram_bytes"])), [size_label(b) for b in grid["dram_bytes"]])
    ax.set_yticks(range(len(grid["disk_bytes"])), [size_label(b) if b else "none" for b in grid["disk_bytes"]])
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="white", fontsize=8)
    ax.set_xlabel("kvtier DRAM per engine")
    ax.set_ylabel(f"{grid['disk_tier']} per engine")
    ax.set_title(f"{title}: TTFT p90 (s)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
