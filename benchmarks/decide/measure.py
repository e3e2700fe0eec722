"""Measure the right answer for each workload card on this machine, and what `kvtier decide` answers.

For every card under benchmarks/decide/cards/, the card's trace (256-token blocks, the same seed decide uses) is
replayed on vLLM's OpenAI server twice, without offloading and with kvtier (DRAM and a filesystem tier sized by
benchmarks/decide/facts.yaml), in alternating order from card to card. The measured answer applies decide's own
rule (`kvtier.sim.decide.choose`) to the measured TTFT p50 and p90; the predicted one is `kvtier decide`'s on the
calibration given, which was measured by `kvtier calibrate` only (never on these runs); see `judge` for the
answer beyond run-to-run noise. Writes benchmarks/results/decide-DATE.json (with every request's TTFT and cached
tokens); tests/sim/test_decide.py holds decide to the measured answers and hit ratios.

    .venv/bin/python benchmarks/decide/measure.py --calibration benchmarks/results/calibration-DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import numpy as np

from kvtier.bench.model import prepare_model
from kvtier.sim.calibrate import load_calibration
from kvtier.sim.card import generate, load_card
from kvtier.sim.decide import choose, decide, deployments, load_facts
from kvtier.sim.validate import measure

HERE = Path(__file__).resolve().parent
SERVED_FLOOR = 0.01  # of prompt tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, help="needed unless --rejudge")
    parser.add_argument("--cards", nargs="*", help="card names (default: all under cards/)")
    parser.add_argument("--out", type=Path,
                        default=HERE.parent / "results" / f"decide-{datetime.date.today().isoformat()}.json")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/kvtier-decide"))
    parser.add_argument("--rejudge", type=Path, metavar="RESULTS",
                        help="recompute a stored run's measured answers (after a change to the rule), measuring "
                             "nothing")
    args = parser.parse_args()
    if args.rejudge is not None:
        return rejudge(args.rejudge)
    if args.calibration is None:
        parser.error("--calibration is needed to measure")
    calibration = load_calibration(args.calibration)
    facts = load_facts(HERE / "facts.yaml")
    model = prepare_model()
    vocab = int(calibration["model"]["vocab_size"])
    paths = sorted((HERE / "cards").glob("*.yaml"))
    if args.cards:
        paths = [p for p in paths if p.stem in args.cards]
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.processor()
               or platform.machine(), "calibration": str(args.calibration), "facts": str(HERE / "facts.yaml"),
               "cards": {}}
    for k, path in enumerate(paths):
        card = load_card(path)
        predicted = decide(card, facts, calibration)
        trace = generate(card, predicted["block_tokens"]).trace
        plans = deployments(facts)
        order = ["none", "local"] if k % 2 == 0 else ["local", "none"]
        measured = {}
        for name in order:
            print(f"measure: {path.stem}: {name}", file=sys.stderr, flush=True)
            run = measure(trace, plans[name][0], model, vocab, args.work_dir / path.stem / name,
                          lambda msg: None, calibration["model"]["dtype"])
            ttft = np.array([r["ttft_s"] for r in run["requests"]])
            prompts = sum(r.input_length for r in trace.requests)
            measured[name] = {"ttft_p50_s": float(np.percentile(ttft, 50)),
                              "ttft_p90_s": float(np.percentile(ttft, 90)),
                              "ttft_mean_s": float(ttft.mean()),
                              "hit_ratio": sum(r["cached_tokens"] for r in run["requests"]) / prompts,
                              "preemptions": run["counters"]["num_preemptions_total"],
                              "per_request": [{"arrival_s": r.timestamp_ms / 1000, "prompt_tokens": r.input_length,
                                               "ttft_s": m["ttft_s"], "cached_tokens": m["cached_tokens"]}
                                              for r, m in zip(trace.requests, run["requests"])]}
        row = {"measured": measured,
               "predicted": {n: {k: o[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "hit_ratio")}
                             for n, o in predicted["options"].items()},
               "predicted_answer": predicted["answer"], "predicted_close": predicted["close"]}
        judge(row)
        answer = row["measured_answer"]
        results["cards"][path.stem] = row
        print(f"{path.stem:<10} measured: none p50 {measured['none']['ttft_p50_s']:.3f} p90 "
              f"{measured['none']['ttft_p90_s']:.3f}, local p50 {measured['local']['ttft_p50_s']:.3f} p90 "
              f"{measured['local']['ttft_p90_s']:.3f} -> {answer}; decide -> {predicted['answer']} "
              f"({'agree' if row['agree'] else 'DISAGREE'})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["agree_beyond_noise"] for r in results["cards"].values()) else 1


def judge(row: dict) -> None:
    """The measured answers of a card's row, from its measured options.

    ``measured_answer`` applies decide's rule to the measured TTFTs as they are. ``answer_beyond_noise`` is
    ``none`` when kvtier served less than :data:`SERVED_FLOOR` of the prompt tokens beyond what the engine's own
    cache served without it: offloading can only gain by what it serves, so a TTFT difference between two runs
    that did the same work is run-to-run noise (on the cards that share nothing, both runs hit nothing, yet
    their p90s differed by 5-15%); otherwise it is ``measured_answer``."""
    measured = row["measured"]
    answer, _, close = choose(measured)
    served = measured["local"]["hit_ratio"] - measured["none"]["hit_ratio"]
    row.update(measured_answer=answer, measured_close=close, kvtier_served_share=served,
               answer_beyond_noise=answer if served >= SERVED_FLOOR else "none",
               agree=answer == row["predicted_answer"])
    row["agree_beyond_noise"] = row["answer_beyond_noise"] == row["predicted_answer"]


def rejudge(path: Path) -> int:
    """Recompute the measured answers of a stored run (the measurements untouched)."""
    results = json.loads(path.read_text())
    for row in results["cards"].values():
        judge(row)
    path.write_text(json.dumps(results, indent=1) + "\n")
    for name, row in results["cards"].items():
        print(f"{name:<10} measured {row['measured_answer']}, beyond noise {row['answer_beyond_noise']} (kvtier "
              f"served {row['kvtier_served_share']:+.4f}), decide {row['predicted_answer']}")
    return 0 if all(r["agree_beyond_noise"] for r in results["cards"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
