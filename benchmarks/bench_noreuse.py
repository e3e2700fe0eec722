"""No reuse at all (every prompt unique): vLLM's throughput with kvtier against without it, as alternating pairs.

Each phase is a fresh engine process (``kvtier.bench.phase``), so run-to-run noise on a shared machine shows as
the spread between pairs; the figure is the median ratio. Uses the job that ``kvtier bench`` wrote (its model,
documents and engine settings; run ``kvtier bench`` first). Usage:

    python benchmarks/bench_noreuse.py [--pairs 5] [--work-dir results/bench-work] [--json PATH]
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

from kvtier.bench.server import server_env


def phase(work: Path, name: str) -> float:
    out = work / f"{name}.json"
    with open(work / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "kvtier.bench.phase", str(work / "job.json"), name, str(out)],
                       stdout=log, check=True, env={**server_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                     "VLLM_LOGGING_LEVEL": "WARNING"})
    return float(json.loads(out.read_text())["throughput"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--work-dir", type=Path, default=Path("results/bench-work"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = args.work_dir
    if not (work / "job.json").exists():
        print(f"no {work / 'job.json'}: run `kvtier bench` first", file=sys.stderr)
        return 2
    job = json.loads((work / "job.json").read_text())
    ratios, pairs = [], []
    for i in range(args.pairs):
        job["store"]["tiers"][0]["path"] = str(work / "kv-noreuse")  # empty each time: nothing can hit
        shutil.rmtree(work / "kv-noreuse", ignore_errors=True)
        (work / "job.json").write_text(json.dumps(job))
        order = ("noreuse_plain", "noreuse_kvtier") if i % 2 == 0 else ("noreuse_kvtier", "noreuse_plain")
        got = {name: phase(work, name) for name in order}
        ratios.append(got["noreuse_kvtier"] / got["noreuse_plain"])
        pairs.append(got)
        print(f"pair {i + 1}/{args.pairs}: vLLM {got['noreuse_plain']:.0f} tokens/s, with kvtier "
              f"{got['noreuse_kvtier']:.0f} ({ratios[-1]:.3f})", flush=True)
    median = statistics.median(ratios)
    print(f"\nno reuse, kvtier / vLLM alone: median {median:.3f} of {len(ratios)} alternating pairs, "
          f"spread {min(ratios):.3f}-{max(ratios):.3f} (target >= 0.99)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "pairs": pairs,
                                         "ratios": ratios, "median": median}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
