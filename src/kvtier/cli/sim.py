"""The simulator's commands (:mod:`kvtier.sim`): measure this machine, replay a trace, check the simulator
against a real run, and decide whether (and where) to offload.

    kvtier calibrate [--quick] [--out FILE] [--model DIR] [--config FILE] [--dtype bfloat16|float32]
    kvtier validate --trace FILE --deployment FILE --calibration FILE [--model DIR] [--out DIR]
    kvtier simulate --trace FILE [--block-tokens N] [--capacities N,N,...] [--policies P,P] [--out DIR]
    kvtier simulate --scenario preemption --calibration FILE [--out DIR]
    kvtier decide --card FILE --facts FILE --calibration FILE [--accuracy FILE] [--out DIR]

Each refuses what it cannot run with exit 2 and a line on standard error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.cli._common import refuse
from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierError

if TYPE_CHECKING:
    from kvtier.cli._common import Subcommands


def register(top: Subcommands) -> None:
    """``kvtier calibrate``, ``validate``, ``simulate`` and ``decide``, in that order."""
    _add_calibrate(top)
    _add_validate(top)
    _add_simulate(top)
    _add_decide(top)


def _add_calibrate(top: Subcommands) -> None:
    calibrate = top.add_parser("calibrate", help="measure this machine for the simulator: prefill, decode and the "
                                                 "engine's hit floor on vLLM, loads and stores per kvtier tier, each "
                                                 "codec's encode and decode on one thread")
    calibrate.add_argument("--quick", action="store_true", help="a smaller grid (a few minutes on 2 cores)")
    calibrate.add_argument("--out", type=Path, default=Path("calibration.json"),
                           help="the calibration file to write (default calibration.json)")
    calibrate.add_argument("--model", type=Path, help="a local model directory vLLM loads (default: SmolLM2-135M, "
                                                      "prepared as `kvtier bench` does)")
    calibrate.add_argument("--config", help="a kvtier config whose tiers to measure, each on its own behind DRAM "
                                            "and without its codec (default: DRAM and a filesystem tier in a "
                                            "scratch directory)")
    calibrate.add_argument("--work-dir", type=Path, help="keep the engine's log and job here")
    calibrate.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                           help="what the engine computes and stores KV in, as it will serve (default bfloat16; "
                                "float32 on a CPU without bfloat16 instructions, AVX-512 BF16 or AMX, which "
                                "computes bfloat16 ~40x slower than float32)")
    calibrate.set_defaults(run=_calibrate)


def _add_validate(top: Subcommands) -> None:
    validate = top.add_parser("validate", help="replay a trace on vLLM with kvtier and compare the simulator's "
                                               "predicted TTFT and hit ratio with what was measured")
    validate.add_argument("--trace", required=True, type=Path, help="the trace to replay (as for simulate)")
    validate.add_argument("--block-tokens", type=_positive, default=512, metavar="N",
                          help="tokens per block of the trace; kvtier's chunk size in the real run (default 512)")
    validate.add_argument("--deployment", required=True, type=Path, help="engine and kvtier (DRAM, filesystem)")
    validate.add_argument("--calibration", required=True, type=Path, help="from `kvtier calibrate` on this machine")
    validate.add_argument("--model", type=Path, help="the model the calibration measured (default: SmolLM2-135M)")
    validate.add_argument("--out", type=Path, default=Path("results/validate"),
                          help="where validate.json, validate.png and the server's log go")
    validate.set_defaults(run=_validate)


def _add_simulate(top: Subcommands) -> None:
    simulate = top.add_parser("simulate", help="replay a request trace: prefix-hit ratio per eviction policy and "
                                               "cache capacity, with Belady's and the infinite cache's lines")
    simulate.add_argument("--scenario", choices=["preemption"],
                          help="a named scenario instead of a trace (needs --calibration): preemption sweeps how "
                               "many prompts arrive at once at an engine whose KV space overflows, with and "
                               "without kvtier's DRAM tier")
    simulate.add_argument("--trace", type=Path,
                          help="JSONL: Mooncake lines (timestamp, input_length, output_length, hash_ids), or "
                               "token_ids / prompt lines re-chunked with kvtier's keys")
    simulate.add_argument("--block-tokens", type=_positive, default=512, metavar="N",
                          help="tokens per block: the size hash_ids were cut at, or kvtier's chunk_tokens for "
                               "token and text traces (default 512, the Mooncake traces')")
    simulate.add_argument("--tokenizer", metavar="MODEL_DIR", help="a local model directory whose tokenizer "
                                                                   "turns a text trace's prompts into tokens")
    simulate.add_argument("--capacities", type=_capacities, metavar="N,N,...",
                          help="cache sizes in blocks (default: 24 log-spaced from 1 to the trace's distinct "
                               "blocks)")
    simulate.add_argument("--policies", type=_policies, default=["lru", "prefix_lru"], metavar="P,P",
                          help="eviction policies to compare (default lru,prefix_lru)")
    simulate.add_argument("--out", type=Path, default=Path("results/simulate"),
                          help="where cache.json, cache.csv and hit_ratio.png go (default results/simulate)")
    simulate.add_argument("--deployment", type=Path, help="also time the trace against this deployment (engine, "
                                                           "kvtier tiers; YAML), with and without kvtier")
    simulate.add_argument("--calibration", type=Path, help="the `kvtier calibrate` file the timing uses (needed "
                                                            "with --deployment)")
    simulate.add_argument("--strict", action="store_true", help="refuse a trace with a line whose prompt is empty "
                                                                 "(by default such lines are skipped and counted)")
    simulate.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    simulate.set_defaults(run=_simulate)


def _add_decide(top: Subcommands) -> None:
    decide = top.add_parser("decide", help="from a workload card and deployment facts: no offloading, "
                                           "engine-local offloading or a shared tier, with the numbers why")
    decide.add_argument("--card", required=True, type=Path, help="the workload card (YAML; see kvtier.sim.card)")
    decide.add_argument("--facts", required=True, type=Path, help="engines, memory, disk and shared tiers "
                                                                  "(YAML; see kvtier.sim.decide)")
    decide.add_argument("--calibration", required=True, type=Path, help="from `kvtier calibrate`")
    decide.add_argument("--accuracy", type=Path, metavar="FILE",
                        help="a benchmarks/bench_codecs.py result whose accuracy figures are shown beside an answer "
                             "that stores KV lossily (default: the latest benchmarks/results/codecs-*.json under "
                             "the current directory)")
    decide.add_argument("--out", type=Path, help="write decide.json (and heatmap.png) here")
    decide.add_argument("--no-plot", action="store_true", help="skip the PNG")
    decide.set_defaults(run=_decide)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def _capacities(text: str) -> list[int]:
    return [_positive(part) for part in text.split(",") if part.strip()]


def _policies(text: str) -> list[str]:
    from kvtier.eviction import POLICIES

    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in POLICIES.names():
            raise argparse.ArgumentTypeError(f"unknown policy {name!r}; known: {', '.join(POLICIES.names())}")
    return names


def _simulate(args: argparse.Namespace) -> int:
    from kvtier.sim.report import cache_report
    from kvtier.sim.trace import load_trace

    if (args.trace is None) == (args.scenario is None):
        return refuse("simulate needs --trace or --scenario (one of them)")
    if args.scenario is not None:
        return _scenario(args)
    tokenizer = None
    try:
        if args.tokenizer:
            tokenizer = _tokenizer(args.tokenizer)
        trace = load_trace(args.trace, args.block_tokens, tokenizer, strict=args.strict)
    except KVTierError as exc:
        return refuse(exc)
    if trace.skipped_empty:
        lines = "line" if trace.skipped_empty == 1 else "lines"
        print(f"kvtier: warning: skipped {trace.skipped_empty} {lines} of {args.trace} with an empty prompt (they "
              "look up nothing; --strict refuses them)", file=sys.stderr)
    deployment = calibration = None
    if (args.deployment is None) != (args.calibration is None):
        return refuse("--deployment and --calibration go together (the timing layer needs both)")
    if args.deployment is not None:
        from kvtier.sim.calibrate import load_calibration
        from kvtier.sim.deployment import load_deployment

        try:
            deployment = load_deployment(args.deployment)
            calibration = load_calibration(args.calibration)
        except KVTierError as exc:
            return refuse(exc)
        _warn_mismatches(args.calibration, calibration)
        try:  # before the cache layer's minutes: a tier or codec the calibration did not measure
            from kvtier.sim.timing import StepCosts, codings

            codings(deployment, StepCosts.from_calibration(calibration))
        except ValueError as exc:
            return refuse(exc)
        if calibration["model"].get("chunk_tokens") and trace.block_tokens % 128:
            print(f"kvtier: warning: blocks of {trace.block_tokens} tokens are not whole engine blocks of 128",
                  file=sys.stderr)
    cache_report(trace, args.capacities, args.policies, args.out, plot=not args.no_plot)
    if deployment is not None:
        from kvtier.sim.report import timing_report

        assert calibration is not None  # loaded with the deployment
        try:
            timing_report(trace, deployment, calibration, args.out, plot=not args.no_plot)
        except ValueError as exc:
            return refuse(exc)
    return 0


def _warn_mismatches(path: Path, calibration: dict, model: Path | None = None) -> None:
    """Warn, naming each difference, when a calibration was measured on another machine or software."""
    from kvtier.sim.calibrate import mismatches

    for line in mismatches(calibration, model):
        print(f"kvtier: warning: {path} was measured on another machine: {line}", file=sys.stderr)


def _scenario(args: argparse.Namespace) -> int:
    from kvtier.sim import scenario
    from kvtier.sim.calibrate import load_calibration
    from kvtier.sim.timing import StepCosts as Costs  # (renamed: router.config.Costs is the other)

    if args.calibration is None or args.deployment is not None:
        return refuse("--scenario takes --calibration (and no --deployment: the scenario has its own)")
    try:
        calibration = load_calibration(args.calibration)
    except KVTierError as exc:
        return refuse(exc)
    _warn_mismatches(args.calibration, calibration)
    scenario.report(scenario.preemption(Costs.from_calibration(calibration)), args.out, plot=not args.no_plot)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from kvtier.sim.calibrate import calibrate

    chunk_tokens = 256
    tiers: list[tuple[str, dict[str, Any] | None]] | None = None
    try:
        if args.config:
            config = load_config(args.config)
            chunk_tokens = config.chunk_tokens
            # each tier without its codec: the raw medium (the codecs are measured on their own, and the
            # simulator adds their cost: kvtier.sim.codec_model)
            tiers = [("dram", None)] + [(t.name, {"type": t.type, "name": t.name, **t.options,
                                                  "queue_depth": t.queue_depth, "queue_bytes": t.queue_bytes,
                                                  "workers": t.workers, "retry_seconds": t.retry_seconds})
                                        for t in config.tiers]
        if args.model is None:
            from kvtier.bench.model import prepare_model

            model = prepare_model()
        else:
            model = args.model
        result = calibrate(model, args.out, args.quick, tiers, chunk_tokens, args.work_dir, args.dtype)
    except KVTierError as exc:
        return refuse(exc)
    fit = result["prefill"]["fit"]
    print(f"prefill: {fit['a']:.3f} + {fit['b']:.2e}*new + {fit['c']:.2e}*new*(new + 2*cached) s "
          f"(worst point off by {fit['max_rel_error']:.0%}, {fit['rms_rel_error']:.0%} root-mean-square)")
    if fit["held_at_zero"]:
        print(f"prefill: {', '.join(fit['held_at_zero'])} held at 0 (the measurements, noisy or flat, made it "
              "negative; a cost never shrinks as work grows)")
    if not fit["max_rel_error"] <= 0.5:  # NaN too
        print("kvtier: warning: the prefill fit is off by more than 50% at some point: a noisy machine? the "
              "simulator's prefill times will be as far off; recalibrate when it is quiet", file=sys.stderr)
    floor, decode = result["hit_floor"]["fit"], result["decode"]["fit"]
    print(f"engine hit floor: {floor['intercept']:.3f} + {floor['slope']:.2e}*tokens s; decode step: "
          f"{decode['intercept'] * 1000:.1f} + {decode['slope'] * 1000:.2f}*batch ms")
    for name, tier in result["tiers"].items():
        print(f"tier {name}: load latency {tier['latency_s'] * 1000:.1f} ms, "
              f"{tier['bandwidth_bytes_per_s'] / 2**30:.2f} GiB/s")
    for name, codec in result["codecs"]["by_codec"].items():
        print(f"codec {name}: stores {codec['stored_over_raw']:.3f} of the raw bytes; one thread encodes "
              f"{codec['encode_bytes_per_s'] / 1e6:.0f} MB/s, decodes {codec['decode_bytes_per_s'] / 1e6:.0f} MB/s")
    print(f"wrote {args.out}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from kvtier.sim.calibrate import load_calibration
    from kvtier.sim.deployment import load_deployment
    from kvtier.sim.trace import load_trace
    from kvtier.sim.validate import validate

    try:
        trace = load_trace(args.trace, args.block_tokens)
        deployment = load_deployment(args.deployment)
        calibration = load_calibration(args.calibration)
        if deployment.kvtier is None:
            return refuse("validate needs a deployment with kvtier (its `kvtier` section)")
        if args.model is None:
            from kvtier.bench.model import prepare_model

            model = prepare_model()
        else:
            model = args.model
        _warn_mismatches(args.calibration, calibration, model)
        result = validate(trace, deployment, calibration, model, args.out)
    except (KVTierError, ValueError) as exc:  # ValueError: a deployment the calibration cannot cost
        return refuse(exc)
    return 0 if result["pass"] else 1


def _decide(args: argparse.Namespace) -> int:
    import json

    from kvtier.sim.accuracy import find_accuracy
    from kvtier.sim.calibrate import load_calibration
    from kvtier.sim.card import load_card
    from kvtier.sim.decide import decide, load_facts, print_decision

    try:
        card = load_card(args.card)
        facts = load_facts(args.facts)
        calibration = load_calibration(args.calibration)
        accuracy = find_accuracy(args.accuracy)
        _warn_mismatches(args.calibration, calibration)
        result = decide(card, facts, calibration, log=lambda msg: print(f"decide: {msg}", file=sys.stderr,
                                                                         flush=True), accuracy=accuracy)
    except (KVTierError, ValueError) as exc:  # ValueError: facts the calibration cannot cost
        return refuse(exc)
    print_decision(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decide.json").write_text(json.dumps(result, indent=1) + "\n")
        written = [args.out / "decide.json"]
        if not args.no_plot:
            from kvtier.sim.report import plot_heatmap

            plot_heatmap(result["heatmap"], args.out / "heatmap.png", args.card.name)
            written.append(args.out / "heatmap.png")
        print(f"wrote {', '.join(map(str, written))}")
    return 0


def _tokenizer(model_dir: str):
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (ImportError, OSError, ValueError) as exc:
        raise ConfigError(f"--tokenizer: cannot load a tokenizer from {model_dir!r}: {exc}") from exc
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]
