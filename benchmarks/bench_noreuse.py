"""No reuse at all (every prompt unique): vLLM alone, with kvtier, and with kvtier storing a prefix only once it
comes again (``admission.store_after: 2``), as rounds of fresh engine processes in a rotating order.

Each phase is a fresh engine process (``kvtier.bench.phase``, ``noreuse_*``): its start, the first prompt's TTFT
(nothing warmed before it: the first prompt after start), the throughput of the other unique prompts, and one of
them asked twice more (vLLM's prefix cache emptied before each): what admission costs on a first repeat. Each
round runs the three in a rotated order (a third of the rounds each variant first, half of those reversed), so
machine drift hits them alike; the figures are medians of the per-round ratios to vLLM alone, with their spread.
Uses the job that ``kvtier bench`` wrote in ``--work-dir`` (its model, documents and engine settings), or makes
one of the full profile. Usage:

    python benchmarks/bench_noreuse.py [--rounds 7] [--work-dir results/bench-work] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from kvtier.bench.server import inprocess_env
from kvtier.bench.ttft import commit, machine

VARIANTS = ("noreuse_plain", "noreuse_kvtier", "noreuse_admission")
LABELS = {"noreuse_plain": "vLLM alone", "noreuse_kvtier": "kvtier", "noreuse_admission": "kvtier, store_after 2"}


def phase(work: Path, name: str) -> dict:
    out = work / f"{name}.json"
    with open(work / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "kvtier.bench.phase", str(work / "job-noreuse.json"), name, str(out)],
                       stdout=log, stderr=subprocess.STDOUT, check=True,
                       env={**inprocess_env(), "VLLM_LOGGING_LEVEL": "WARNING"})
    return json.loads(out.read_text())


def order(i: int) -> tuple[str, ...]:
    """Round ``i``'s order: the variants rotated by ``i``, reversed in every other block of three rounds."""
    rotated = VARIANTS[i % 3:] + VARIANTS[:i % 3]
    return rotated if (i // 3) % 2 == 0 else rotated[::-1]


def job_for(work: Path) -> dict:
    if (work / "job.json").exists():
        return json.loads((work / "job.json").read_text())
    from kvtier.bench.model import prepare_model
    from kvtier.bench.ttft import PROFILES, make_job

    print(f"no {work / 'job.json'}: making one of the full profile", file=sys.stderr, flush=True)
    work.mkdir(parents=True, exist_ok=True)
    job = make_job(prepare_model(), dict(PROFILES["full"], chunk_tokens=256, tails=True),
                   {"type": "filesystem", "path": str(work / "kv")})
    (work / "job.json").write_text(json.dumps(job))
    return job


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}, spread {min(values):.3f}-{max(values):.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the three variants (default 7)")
    parser.add_argument("--work-dir", type=Path, default=Path("results/bench-work"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    work = args.work_dir
    job = dict(job_for(work), noreuse_repeats=True)
    rounds = []
    for i in range(args.rounds):
        job["store"]["tiers"][0]["path"] = str(work / "kv-noreuse")  # empty each time: nothing can hit
        shutil.rmtree(work / "kv-noreuse", ignore_errors=True)
        (work / "job-noreuse.json").write_text(json.dumps(job))
        got = {}
        for name in order(i):
            shutil.rmtree(work / "kv-noreuse", ignore_errors=True)
            got[name] = phase(work, name)
        rounds.append({"order": list(order(i)), **got})
        line = ", ".join(f"{LABELS[n]} {got[n]['throughput']:.0f} tokens/s (first TTFT {got[n]['first_ttft_s']:.2f} s)"
                         for n in VARIANTS)
        print(f"round {i + 1}/{args.rounds}: {line}", flush=True)
    result = summary(rounds)
    print(f"\nno reuse, {args.rounds} rounds of fresh engines, ratios to vLLM alone in the same round:")
    for row, values in result["rows"].items():
        print(f"  {row}: {spread(values)}")
    for name, r in result["repeats"].items():
        print(f"  {LABELS[name]}: a prompt asked again {r['first']:.3f} s, a third time {r['second']:.3f} s (medians)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": machine(),
                                         "commit": commit(), "profile": "full" if len(job["docs"]) == 4 else "quick",
                                         "rounds": rounds, **result,
                                         # kvtier / vLLM alone throughput, as the earlier files give it
                                         "ratios": result["rows"]["throughput, kvtier"],
                                         "median": statistics.median(result["rows"]["throughput, kvtier"])},
                                        indent=2))
    return 0


def summary(rounds: list[dict]) -> dict:
    """Per-round ratios to vLLM alone (throughput, first prompt's TTFT, start), by row, and the repeats' median
    TTFTs."""
    ratios: dict[str, list[float]] = {}
    for kind, key in (("throughput", "throughput"), ("first prompt TTFT", "first_ttft_s"), ("start", "start_s")):
        for name in VARIANTS[1:]:
            ratios[f"{kind}, {LABELS[name]}"] = [r[name][key] / r["noreuse_plain"][key] for r in rounds]
    repeats = {name: {"first": statistics.median(r[name]["repeat_ttft_s"][0] for r in rounds),
                      "second": statistics.median(r[name]["repeat_ttft_s"][1] for r in rounds)} for name in VARIANTS}
    return {"rows": ratios, "repeats": repeats}


if __name__ == "__main__":
    sys.exit(main())
