"""Named ``kvtier simulate`` scenarios: workloads every offloading explainer starts from, on a calibration.

``preemption``: ``N`` different prompts arrive at once at an engine whose KV space holds a few of them. As ``N``
rises past what the KV space holds, decoding requests run out of blocks and vLLM preempts the latest: its blocks
are freed, and when it is scheduled again it computes its prompt and what it had generated again. With kvtier's
DRAM tier, the prompt's chunks were stored when its prefill finished, so only the generated tokens (and what
the engine's own cache no longer holds of the last chunk) are recomputed. The scenario sweeps ``N``, times both
deployments, and reports per ``N`` the KV demand over the KV space (utilization), preemptions, tokens prefilled,
re-prefill avoided and throughput, and the lowest utilization swept at which the CPU tier pays
(:data:`PAYS` more output tokens per second). Its parameters are :class:`Preemption`'s defaults (sized for a small
model on CPU); from Python, pass another :class:`Preemption`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvtier.sim.deployment import Deployment, EngineSpec, KVTierSpec
from kvtier.sim.timing import StepCosts, simulate
from kvtier.sim.trace import Request, Trace

PAYS = 0.05


@dataclasses.dataclass(frozen=True)
class Preemption:
    prompt_tokens: int = 768
    output_tokens: int = 384
    kv_tokens: int = 4096
    block_tokens: int = 128  # vLLM's block and kvtier's chunk: preemption happens a block at a time
    max_num_batched_tokens: int = 8192
    concurrency: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
    dram_bytes: int = 2**30

    def trace(self, n: int) -> Trace:
        """``n`` different prompts, all arriving at time 0."""
        per = -(-self.prompt_tokens // self.block_tokens)
        requests = tuple(Request(0.0, self.prompt_tokens, self.output_tokens, tuple(range(i * per, (i + 1) * per)),
                                 self.prompt_tokens // self.block_tokens) for i in range(n))
        return Trace(requests, self.block_tokens, f"preemption scenario, {n} at once")

    def deployment(self, kvtier: bool) -> Deployment:
        """The engine (room for every request of the sweep to run at once), with or without kvtier's DRAM."""
        engine = EngineSpec(self.kv_tokens, self.max_num_batched_tokens, max(self.concurrency))
        return Deployment(engine, KVTierSpec(self.dram_bytes) if kvtier else None)


def preemption(costs: StepCosts, scenario: Preemption | None = None) -> dict[str, Any]:
    s = scenario or Preemption()
    rows = []
    for n in s.concurrency:
        trace = s.trace(n)
        alone = simulate(trace, s.deployment(False), costs)
        with_tier = simulate(trace, s.deployment(True), costs)
        rows.append({
            "requests": n,
            "utilization": n * (s.prompt_tokens + s.output_tokens) / s.kv_tokens,
            "preemptions": {"engine_alone": alone["preemptions"], "kvtier": with_tier["preemptions"]},
            "prefilled_tokens": {"engine_alone": alone["prefilled_tokens"], "kvtier": with_tier["prefilled_tokens"]},
            "re_prefill_avoided_tokens": alone["prefilled_tokens"] - with_tier["prefilled_tokens"],
            "loaded_tokens": sum(with_tier["loaded_tokens"].values()),
            "output_tokens_per_s": {"engine_alone": alone["output_tokens_per_s"],
                                    "kvtier": with_tier["output_tokens_per_s"]},
            "makespan_s": {"engine_alone": alone["makespan_s"], "kvtier": with_tier["makespan_s"]},
            "throughput_gain": with_tier["output_tokens_per_s"] / alone["output_tokens_per_s"] - 1,
        })
    pays = next((r["utilization"] for r in rows if r["throughput_gain"] >= PAYS), None)
    return {"scenario": "preemption", "parameters": dataclasses.asdict(s), "rows": rows,
            "pays_from_utilization": pays}


def report(result: dict[str, Any], out: Path, plot: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "preemption.json").write_text(json.dumps(result, indent=1) + "\n")
    p = result["parameters"]
    print(f"preemption scenario: prompts of {p['prompt_tokens']} tokens generating {p['output_tokens']}, all at "
          f"once, on a KV space of {p['kv_tokens']} tokens; kvtier DRAM {p['dram_bytes'] / 2**30:.2f} GiB")
    print(f"{'N':>3} {'util':>5} {'preempt':>8} {'w/ kvtier':>9} {'re-prefill avoided':>18} {'tok/s':>7} "
          f"{'w/ kvtier':>9} {'gain':>6}")
    for r in result["rows"]:
        print(f"{r['requests']:>3} {r['utilization']:>5.2f} {r['preemptions']['engine_alone']:>8} "
              f"{r['preemptions']['kvtier']:>9} {r['re_prefill_avoided_tokens']:>18,} "
              f"{r['output_tokens_per_s']['engine_alone']:>7.1f} {r['output_tokens_per_s']['kvtier']:>9.1f} "
              f"{r['throughput_gain']:>+6.1%}")
    pays = result["pays_from_utilization"]
    print(f"the CPU tier first pays ({PAYS:.0%} more throughput) at a KV demand of {pays:.2f}x the engine's KV space"
          if pays is not None else f"the CPU tier gives {PAYS:.0%} more throughput at no concurrency swept")
    if plot:
        _plot(result, out / "preemption.png")
    print(f"wrote {out / 'preemption.json'}" + (f", {out / 'preemption.png'}" if plot else ""))


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["utilization"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    for key, label in (("engine_alone", "engine alone"), ("kvtier", "with kvtier DRAM")):
        top.plot(x, [r["output_tokens_per_s"][key] for r in rows], marker="o", label=label)
        bottom.plot(x, [r["prefilled_tokens"][key] for r in rows], marker="o", label=label)
    for ax in (top, bottom):
        ax.axvline(1.0, color="grey", linewidth=0.6, linestyle=":")
        if result["pays_from_utilization"] is not None:
            ax.axvline(result["pays_from_utilization"], color="green", linewidth=0.8, linestyle="--")
        ax.grid(True, alpha=0.3)
    top.set_ylabel("output tokens / s")
    top.set_title("preemption scenario (dashed: the CPU tier pays from here)")
    top.legend()
    bottom.set_ylabel("tokens prefilled (incl. re-prefill)")
    bottom.set_xlabel("KV demand / engine KV space (requests at once x (prompt + output) / KV tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
