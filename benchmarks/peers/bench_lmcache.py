"""kvtier next to LMCache's storage layer: the same seeded KV, stored and retrieved by each, in processes of their own.

    bash benchmarks/peers/run.sh                      # setup, then this script (5 repetitions)
    benchmarks/peers/.venv/bin/python benchmarks/peers/bench_lmcache.py [--reps N] [--shapes A,B] [--out FILE]

Each repetition runs, for each shape, every worker once: kvtier's (``_kvtier_side.py``) and LMCache's
(``_lmcache_side.py``), alternating which goes first. A worker warms up with one batch of 256-token chunks, then
times three rounds, each on a batch of its own; its time for an operation is the rounds' median, and a row's is the
median over the repetitions. Rows (what each side calls is in the workers' docstrings):

1. DRAM: kvtier ``KVStore.put``/``get`` with DRAM only; LMCache ``LMCacheEngine.store``/``retrieve`` on its
   LocalCPUBackend, through a torch-copy connector (LMCache's own connectors need CUDA).
2. Filesystem: store until every chunk is on disk (kvtier: ``put`` + ``flush``; LMCache: LocalDiskBackend until it
   reports each write done), retrieve from the page cache (kvtier after ``drop_dram``; LMCache with
   ``local_cpu=False``), and retrieve from a new process opened on the same directory.
3. Redis, on a redis-server started here on a free loopback port: kvtier's redis tier vs LMCache's RemoteBackend
   with its redis-py connector (``redis://``) and with its C++ RESP client (``resp://``).

Prints medians and "kvtier speed vs LMCache" = LMCache seconds / kvtier seconds (above 1.0: kvtier is faster) and
writes every repetition, the load average around each worker, versions and the machine to
``benchmarks/results/peers-<date>.json``. A worker asserts that what it retrieved equals what it stored, byte for
byte; a run that fails that check fails, and its row says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import SHAPES
from _machine import describe, git_state, versions
from _redis_server import RedisServer

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER_TIMEOUT_S = 180  # a backstop: workers end themselves after _common.WORKER_DEADLINE_S
WORKER_ENV = {
    "LMCACHE_TRACK_USAGE": "false",  # no usage reports from LMCache
    "LMCACHE_LOG_LEVEL": "WARNING",
    # LMCache hashes tokens with Python's hash() when vLLM is absent: a fixed seed keeps keys stable across processes.
    "PYTHONHASHSEED": "0",
}
# Worker variants: (system label, script, group); the Redis ones differ in the URL they are given.
VARIANTS = {
    "kvtier-dram": ("kvtier", "_kvtier_side.py", "dram"),
    "kvtier-filesystem": ("kvtier", "_kvtier_side.py", "filesystem"),
    "kvtier-filesystem-restart": ("kvtier", "_kvtier_side.py", "filesystem-restart"),
    "kvtier-redis": ("kvtier", "_kvtier_side.py", "redis"),
    "lmcache-dram": ("LMCache", "_lmcache_side.py", "dram"),
    "lmcache-disk": ("LMCache", "_lmcache_side.py", "disk"),
    "lmcache-disk-restart": ("LMCache", "_lmcache_side.py", "disk-restart"),
    "lmcache-redis-py": ("LMCache", "_lmcache_side.py", "redis"),
    "lmcache-resp": ("LMCache", "_lmcache_side.py", "redis"),
}
# Table rows: (label, kvtier variant, LMCache variant, timed operation).
ROWS = [
    ("DRAM store", "kvtier-dram", "lmcache-dram", "store"),
    ("DRAM retrieve", "kvtier-dram", "lmcache-dram", "retrieve"),
    ("filesystem store, until on disk", "kvtier-filesystem", "lmcache-disk", "store"),
    ("filesystem retrieve, page cache", "kvtier-filesystem", "lmcache-disk", "retrieve"),
    ("filesystem retrieve, new process", "kvtier-filesystem-restart", "lmcache-disk-restart", "retrieve"),
    ("Redis store vs redis-py connector", "kvtier-redis", "lmcache-redis-py", "store"),
    ("Redis retrieve vs redis-py connector", "kvtier-redis", "lmcache-redis-py", "retrieve"),
    ("Redis store vs C++ resp:// client", "kvtier-redis", "lmcache-resp", "store"),
    ("Redis retrieve vs C++ resp:// client", "kvtier-redis", "lmcache-resp", "retrieve"),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_worker(variant: str, shape: str, rep: int, *, directory: Path | None = None, url: str | None = None) -> dict:
    """Run one worker to its end; its result, with the load average around it and any failure."""
    system, script, group = VARIANTS[variant]
    with tempfile.NamedTemporaryFile(prefix="peers-", suffix=".json", delete=False) as f:
        out = Path(f.name)
    argv = [sys.executable, str(HERE / script), "--group", group, "--shape", shape, "--out", str(out)]
    if directory is not None:
        argv += ["--dir", str(directory)]
    if url is not None:
        argv += ["--url", url]
    record: dict = {"variant": variant, "system": system, "shape": shape, "rep": rep,
                    "loadavg_before": list(os.getloadavg())}
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=HERE, env={**os.environ, **WORKER_ENV}, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_S)
        record["rc"] = proc.returncode
        if proc.returncode == 0:
            record.update(json.loads(out.read_text()))
        else:
            record["error"] = proc.stderr[-3000:]
    except subprocess.TimeoutExpired:  # subprocess.run has killed it (its own child, by PID)
        record["rc"] = None
        record["error"] = f"timed out after {WORKER_TIMEOUT_S} s"
    finally:
        out.unlink(missing_ok=True)
    record["wall_s"] = time.perf_counter() - start
    record["loadavg_after"] = list(os.getloadavg())
    status = "ok" if record["rc"] == 0 else f"FAILED: {record['error'].strip().splitlines()[-1:]}"
    log(f"  rep {rep} {shape:<13} {variant:<26} {record['wall_s']:5.1f} s  {record.get('seconds', {})}  {status}")
    return record


def repetition(rep: int, shape: str, redis: RedisServer | None, scratch: Path) -> list[dict]:
    """Every worker once for one shape; kvtier first on even repetitions, LMCache first on odd ones."""
    def ordered(*pairs: tuple) -> list[tuple]:
        return list(pairs if rep % 2 == 0 else reversed(pairs))

    records = []
    for steps in ordered(("kvtier-dram",), ("lmcache-dram",)):
        records += [run_worker(v, shape, rep) for v in steps]
    for store_variant, restart_variant in ordered(("kvtier-filesystem", "kvtier-filesystem-restart"),
                                                  ("lmcache-disk", "lmcache-disk-restart")):
        directory = scratch / f"{store_variant}-{shape}-{rep}"
        directory.mkdir()
        records.append(run_worker(store_variant, shape, rep, directory=directory))
        records.append(run_worker(restart_variant, shape, rep, directory=directory))
        shutil.rmtree(directory, ignore_errors=True)
    if redis is not None:
        urls = {"kvtier-redis": redis.url("redis"), "lmcache-redis-py": redis.url("redis"),
                "lmcache-resp": redis.url("resp")}
        for variant in ordered("kvtier-redis", "lmcache-redis-py", "lmcache-resp"):
            redis.flush()  # each worker starts on an empty server
            records.append(run_worker(variant, shape, rep, url=urls[variant]))
    return records


def summarize(records: list[dict], shapes: list[str]) -> list[dict]:
    """One entry per row and shape: medians, the ratio, its per-repetition range, spreads and load averages."""
    rows = []
    for shape in shapes:
        for label, kv_variant, lm_variant, op in ROWS:
            kv = sorted((r for r in records if r["variant"] == kv_variant and r["shape"] == shape),
                        key=lambda r: r["rep"])
            lm = sorted((r for r in records if r["variant"] == lm_variant and r["shape"] == shape),
                        key=lambda r: r["rep"])
            if not kv and not lm:
                continue
            row: dict = {"row": label, "shape": shape, "op": op, "kvtier_variant": kv_variant,
                         "lmcache_variant": lm_variant, "bytes": SHAPES[shape].batch_bytes}
            failed = [f"{r['variant']} rep {r['rep']}" for r in kv + lm if r["rc"] != 0]
            row["failed_runs"] = failed
            kv_s = [r["seconds"][op] for r in kv if r["rc"] == 0]
            lm_s = [r["seconds"][op] for r in lm if r["rc"] == 0]
            # A store finds nothing to count; a retrieve that found nothing (LMCache's disk after a restart) has no
            # ratio.
            lm_found = [r["found_tokens"].get(op, 0) if op == "retrieve" else SHAPES[shape].tokens
                        for r in lm if r["rc"] == 0]
            row["kvtier_seconds"], row["lmcache_seconds"] = kv_s, lm_s
            row["lmcache_found_tokens"] = lm_found
            row["lmcache_lookup_tokens"] = [r["found_tokens"].get("lookup") for r in lm if r["rc"] == 0]
            row["loadavg_1m"] = [x for r in kv + lm for x in (r["loadavg_before"][0], r["loadavg_after"][0])]
            if kv_variant == "kvtier-filesystem-restart":  # opening re-indexes the directory: not in the retrieve
                row["kvtier_open_seconds"] = [r["seconds"]["open"] for r in kv if r["rc"] == 0]
            row["kvtier"] = _stats(kv_s)
            row["lmcache"] = _stats(lm_s)
            if kv_s and lm_s and all(lm_found):
                row["ratio"] = row["lmcache"]["median"] / row["kvtier"]["median"]
                paired = {r["rep"]: r["seconds"][op] for r in kv if r["rc"] == 0}
                per_rep = [r["seconds"][op] / paired[r["rep"]] for r in lm if r["rc"] == 0 and r["rep"] in paired]
                row["ratio_per_rep"] = per_rep
            else:
                row["ratio"] = None
                row["ratio_note"] = (f"LMCache found {min(lm_found)} of {SHAPES[shape].tokens} tokens "
                                     f"(lookup {row['lmcache_lookup_tokens']})" if lm_s else "no successful runs")
            rows.append(row)
    return rows


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values), "spread": (max(values) - min(values)) / median}


def table(rows: list[dict]) -> str:
    out = ["| shape | row | kvtier s | LMCache s | kvtier speed vs LMCache (LMCache s / kvtier s; >1: kvtier "
           "faster) | per-rep ratio range | spread kvtier / LMCache | load 1m |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kv, lm = r["kvtier"], r["lmcache"]
        kv_s = f"{kv['median']:.4f}" if kv else "-"
        lm_s = f"{lm['median']:.4f}" if lm else "-"
        if r["ratio"] is not None:
            ratio = f"**{r['ratio']:.2f}x**"
            per_rep = f"{min(r['ratio_per_rep']):.2f}-{max(r['ratio_per_rep']):.2f}"
        else:
            ratio, per_rep = f"n/a: {r['ratio_note']}", "-"
        spread = f"{kv['spread']:.0%} / {lm['spread']:.0%}" if kv and lm else "-"
        load = f"{min(r['loadavg_1m']):.1f}-{max(r['loadavg_1m']):.1f}"
        failed = f" (failed: {', '.join(r['failed_runs'])})" if r["failed_runs"] else ""
        out.append(f"| {r['shape']} | {r['row']}{failed} | {kv_s} | {lm_s} | {ratio} | {per_rep} | {spread} | "
                   f"{load} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions (default 5; 1 for a smoke run)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/peers-<date>.json, "
                                                 "peers-<date>-smoke.json with --reps 1)")
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    today = datetime.date.today().isoformat()
    out = args.out or REPO / "benchmarks" / "results" / f"peers-{today}{'-smoke' if args.reps == 1 else ''}.json"
    notes = []
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-peers-"))
    redis = RedisServer.start(scratch / "redis")
    if redis is None:
        notes.append("redis-server not found on PATH: the Redis rows were skipped")
    records: list[dict] = []
    try:
        for rep in range(args.reps):
            for shape in shapes:
                records += repetition(rep, shape, redis, scratch)
    finally:
        if redis is not None:
            notes.append(f"redis-server {redis.version}, --save '' --appendonly no, on 127.0.0.1:{redis.port}")
            redis.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    rows = summarize(records, shapes)
    report = {
        "date": today, "started": started,
        "finished": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git": git_state(REPO), "machine": describe(), "versions": versions(),
        "repetitions": args.reps, "chunk_tokens": 256,
        "shapes": {name: {"layers": s.layers, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "chunks": s.chunks,
                          "tokens": s.tokens, "chunk_bytes": s.chunk_bytes, "batch_bytes": s.batch_bytes,
                          "note": s.note} for name, s in SHAPES.items() if name in shapes},
        "ratio_definition": "LMCache median seconds / kvtier median seconds (> 1.0: kvtier is faster)",
        "notes": notes, "rows": rows, "runs": records,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nkvtier vs LMCache {report['versions'].get('lmcache')}, {args.reps} repetitions, medians; "
          f"machine: {report['machine']['summary']}\n")
    print(table(rows))
    for r in rows:
        if r.get("kvtier_open_seconds"):
            print(f"\nnote: {r['shape']}, new process: kvtier's KVStore.from_config (re-indexing the directory) took "
                  f"median {statistics.median(r['kvtier_open_seconds']):.3f} s, outside the retrieve time")
    for n in notes:
        print(f"\nnote: {n}")
    print(f"\nwrote {out}")
    failed = [r for r in records if r["rc"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
