"""Before/after: one benchmark run on two trees of kvtier (a base commit and the working tree), alternately.

    python benchmarks/ab.py --base REV [--rounds N] [--json PATH] store [--quick]
    python benchmarks/ab.py --base REV [--rounds N] [--json PATH] ttft [--quick]

``store`` is ``benchmarks/bench_store.py`` (each row's ratio to the baseline it measured in the same run),
``ttft`` is ``kvtier bench`` (each hit's TTFT over vLLM's own prefix-cache hit, measured in the same run). Both
trees run on this machine in one process environment (the same interpreter and packages), in ABBA order, so
drift on a shared machine hits both. For each number: the median of each side, the change, the spread of the
rounds, and whether it is within ``--tolerance`` (default 3%) of the base. The base tree is a ``git worktree``
under the temp directory, removed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_once(kind: str, tree: Path, quick: bool, out: Path) -> dict[str, float]:
    """One run of the benchmark on ``tree``'s source; its numbers, each named, with higher better."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    if kind == "store":
        cmd = [sys.executable, str(tree / "benchmarks" / "bench_store.py"), "--json", str(out)]
    else:
        cmd = [sys.executable, "-m", "kvtier.cli", "bench", "--json", str(out), "--work-dir", str(out.parent / "w")]
    cmd += ["--quick"] if quick else []
    subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    if kind == "store":  # each row's ratio to its in-run baseline (latency rows: lower is better, inverted)
        rows = {}
        for row in data["rows"]:
            name = "/".join(str(row[k]) for k in ("bench", "shape", "op") if k in row)
            if "ratio" in row:
                rows[name] = float(row["ratio"])
            for key in ("p50_ms", "p99_ms"):
                if key in row:
                    rows[f"{name} {key} (inverted)"] = 1.0 / max(float(row[key]), 1e-9)
        return rows
    return {f"{name} (engine hit / this)": 1.0 / ratio for name, ratio in data["vs_engine_hit"].items()}


def compare(base: list[dict[str, float]], head: list[dict[str, float]], tolerance: float) -> list[dict[str, Any]]:
    rows = []
    for name in sorted(set(base[0]) & set(head[0])):
        b = [r[name] for r in base if name in r]
        h = [r[name] for r in head if name in r]
        mb, mh = statistics.median(b), statistics.median(h)
        change = mh / mb - 1 if mb else 0.0
        rows.append({"name": name, "base": mb, "head": mh, "change": change, "base_spread": [min(b), max(b)],
                     "head_spread": [min(h), max(h)], "within": change >= -tolerance})
    return rows


def worktree(rev: str, where: Path) -> Path:
    path = where / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare against (e.g. main~5)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree (default 3)")
    parser.add_argument("--tolerance", type=float, default=0.03, help="allowed slowdown (default 0.03)")
    parser.add_argument("--json", type=Path, help="also write the comparison as JSON here")
    parser.add_argument("kind", choices=["store", "ttft"])
    parser.add_argument("--quick", action="store_true", help="the benchmark's quick profile")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    head_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    base_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], check=True,
                              capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"], check=True,
                                capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory(prefix="kvtier-ab-") as tmp:
        where = Path(tmp)
        base_tree = worktree(args.base, where)
        try:
            results: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
            for i in range(args.rounds):
                order = ("base", "head") if i % 2 == 0 else ("head", "base")
                for side in order:
                    tree = base_tree if side == "base" else ROOT
                    log(f"round {i + 1}/{args.rounds}: {side}")
                    results[side].append(run_once(args.kind, tree, args.quick, where / f"{side}-{i}.json"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)
    rows = compare(results["base"], results["head"], args.tolerance)
    print(f"| {args.kind} (higher is better) | base {base_rev} | head {head_rev}{' + changes' if dirty else ''} "
          f"| change | base spread | head spread |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mark = "" if r["within"] else " **slower**"
        print(f"| {r['name']} | {r['base']:.3f} | {r['head']:.3f} | {r['change']:+.1%}{mark} | "
              f"{r['base_spread'][0]:.3f}-{r['base_spread'][1]:.3f} | {r['head_spread'][0]:.3f}-"
              f"{r['head_spread'][1]:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": _cpu(), "base": base_rev,
            "head": head_rev + (" + uncommitted changes" if dirty else ""), "kind": args.kind, "quick": args.quick,
            "rounds": args.rounds, "tolerance": args.tolerance, "rows": rows, "raw": results,
            "python": platform.python_version()}, indent=1))
    return 0 if all(r["within"] for r in rows) else 1


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"unknown CPU, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
