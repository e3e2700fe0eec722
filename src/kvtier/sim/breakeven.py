"""When loading beats recomputing: TTFT of one request on an idle engine against its prompt length, per tier.

From a calibration alone. A prompt of ``n`` tokens recomputed costs ``a + b*n + c*n*n``; served from a tier, its
whole chunks but the last token's are loaded (``latency + bytes / bandwidth``) and the rest computed after
them. A tier pays from the shortest prompt at which that is faster (its break-even length); the bandwidth it
needs to beat recompute at length ``n`` is KV bytes per token times the tokens per second prefill would take.
"""

from __future__ import annotations

from typing import Any

from kvtier.sim.timing import StepCosts

def lengths(chunk_tokens: int) -> list[float]:
    """Prompts of whole chunks from one chunk to 16K tokens, about four an octave: a prompt asked again, so
    each length pays the same recomputed last chunk and the curves compare like with like."""
    grid = sorted({max(1, round(128 * 2**(k / 4) / chunk_tokens)) * chunk_tokens for k in range(29)})
    return [float(n) for n in grid if n <= 16384]


def recompute_s(costs: StepCosts, n: float) -> float:
    return costs.a + costs.chunk(int(n), 0)


def served_s(costs: StepCosts, tier: str | None, n: float, chunk_tokens: int) -> float:
    """TTFT with the prompt's whole chunks (the last token never) from ``tier`` (None: the engine's own cache)."""
    hit = int((n - 1) // chunk_tokens) * chunk_tokens
    rest = int(n) - hit
    load = 0.0
    if tier is not None and hit:
        latency, bandwidth = costs.load[tier]
        load = latency + hit * costs.kv_bytes_per_token / bandwidth
    return load + costs.a + costs.chunk(rest, hit)


def break_even(costs: StepCosts, tier: str, chunk_tokens: int, grid: list[float] | None = None) -> int | None:
    """The shortest prompt (of ``grid``) from which the tier's TTFT stays below recompute's; None if never."""
    found = None
    for n in reversed(grid if grid is not None else lengths(chunk_tokens)):
        if served_s(costs, tier, n, chunk_tokens) < recompute_s(costs, n):
            found = int(n)
        else:
            break
    return found


def needed_bandwidth(costs: StepCosts, n: float) -> float:
    """Bytes per second a tier must deliver to load a prompt of ``n`` tokens faster than it is computed."""
    return n * costs.kv_bytes_per_token / max(costs.chunk(int(n), 0), 1e-12)


def tier_facts(costs: StepCosts, tiers: list[str], chunk_tokens: int, median_prompt: int) -> dict[str, dict[str, Any]]:
    """Each tier's bandwidth and latency, the bandwidth beating recompute at the median prompt needs, and its
    break-even length (``kvtier decide``'s figures)."""
    grid = lengths(chunk_tokens)
    needed = needed_bandwidth(costs, median_prompt)
    return {t: {"bandwidth_bytes_per_s": costs.load[t][1], "latency_s": costs.load[t][0],
                "needed_bytes_per_s_at_median_prompt": needed,
                "break_even_tokens": break_even(costs, t, chunk_tokens, grid)} for t in tiers}


def table(costs: StepCosts, chunk_tokens: int) -> dict[str, Any]:
    tiers = list(costs.load)
    grid = lengths(chunk_tokens)
    return {
        "lengths": [int(n) for n in grid],
        "recompute_s": [recompute_s(costs, n) for n in grid],
        "engine_hit_s": [served_s(costs, None, n, chunk_tokens) for n in grid],
        "tiers": {t: {"ttft_s": [served_s(costs, t, n, chunk_tokens) for n in grid],
                      "break_even_tokens": break_even(costs, t, chunk_tokens),
                      "bandwidth_bytes_per_s": costs.load[t][1]} for t in tiers},
        "needed_bandwidth_bytes_per_s": {str(n): needed_bandwidth(costs, n) for n in (1024, 4096, 16384)},
    }


def plot(data: dict[str, Any], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = data["lengths"]
    ax.plot(n, data["recompute_s"], color="black", label="recompute")
    ax.plot(n, data["engine_hit_s"], color="grey", linestyle=":", label="engine's own hit")
    for tier, row in data["tiers"].items():
        line, = ax.plot(n, row["ttft_s"], label=f"from {tier}")
        if row["break_even_tokens"] is not None:
            ax.axvline(row["break_even_tokens"], color=line.get_color(), linewidth=0.6, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens, whole chunks asked again (one request, idle engine)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"{title}: TTFT by prompt length (dashed: break-even)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
