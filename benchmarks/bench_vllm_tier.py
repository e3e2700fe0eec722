"""kvtier's tiers under vLLM's native offloading, beside vLLM's own ``fs`` tier: a 4K-token prompt stored and loaded
through vLLM's ``TieringOffloadingManager`` (its own code, driven on CPU by :mod:`kvtier.testing.vllm_tiering`).

    python benchmarks/bench_vllm_tier.py [--quick] [--repeats N] [--json PATH] [--dir DIR]

SmolLM2-135M's KV (23,040 bytes a token), offloaded in chunks of 256 tokens (16 blocks of 16): 16 rows of
5.9 MB, 94 MB. Three secondary tiers, each under its own manager: vLLM's ``fs`` tier, kvtier's filesystem tier
and kvtier's Redis tier (a server started here on loopback). In each round, every tier in turn:

- store: the rows into the primary tier, cascaded to the secondary tier. ``released`` is when every store job has
  ended (vLLM may reuse the primary's slots); ``in tier`` when the secondary tier holds every row (for vLLM's fs
  tier the two are the same; kvtier's jobs end in its DRAM, and its cascade writes the tier after);
- load: the primary tier emptied (``reset_cache``) and kvtier's DRAM too, then every row looked up, promoted
  into the primary tier and copied out, as the scheduler and worker do (each row checked byte for byte,
  untimed).

Rounds alternate the tiers, so drift on a shared machine hits all. Printed: medians, and each kvtier tier's time
over vLLM's fs tier's per round (median and range; below 1: kvtier faster). Files live under --dir, in the page
cache unless vLLM's fs tier can use O_DIRECT there (recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_store import log, machine

from kvtier.testing.vllm_tiering import Tiering, chunk_names, offloading_config, row_bytes

TOKENS = 4096
BLOCK, BLOCKS = 16, 16  # tokens a block, blocks a chunk: 256-token rows
LAYERS, KV_BYTES = 30, 768  # SmolLM2-135M: 30 layers, 768 bytes of K and V a token and layer (bf16)
SYSTEMS = ("vllm-fs", "kvtier-fs", "kvtier-redis")


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).parent)
    return out.stdout.strip() or "unknown"


@contextlib.contextmanager
def managers(root: Path) -> Iterator[dict[str, Tiering]]:
    from kvtier.testing.servers import RedisServer

    server = RedisServer(root / "redis", maxmemory="4gb").start()
    made: dict[str, Tiering] = {}
    try:
        def kvtier(*tiers: dict[str, Any]) -> list[dict[str, Any]]:
            config = {"dram": {"capacity_bytes": "512MiB", "page_bytes": "6MiB"}, "tiers": list(tiers)}
            return [{"type": "KVTierSecondaryTier", "module_path": "kvtier.integrations.vllm_tier",
                     "config": config, "model_fingerprint": "bench-smollm2", "workers": 2}]

        entries = {
            "vllm-fs": [{"type": "fs", "root_dir": str(root / "vllm-fs"), "n_read_threads": 4,
                         "n_write_threads": 4}],
            "kvtier-fs": kvtier({"type": "filesystem", "name": "disk", "path": str(root / "kvtier-fs"),
                                 "queue_bytes": "1GiB", "workers": 4}),
            "kvtier-redis": kvtier({"type": "redis", "name": "redis", **server.tier_options(),
                                    "queue_bytes": "1GiB", "workers": 4}),
        }
        for name in SYSTEMS:
            made[name] = Tiering(offloading_config(entries[name], model="bench-smollm2", layers=LAYERS,
                                                   kv_bytes_per_token_layer=KV_BYTES, tokens_per_block=BLOCK,
                                                   blocks_per_chunk=BLOCKS, cpu_bytes=256 << 20))
        yield made
    finally:
        for tiering in made.values():
            tiering.close()
        server.stop()


def _kvtier_store(t: Tiering) -> Any:
    return getattr(t.tiers[0], "store", None)  # kvtier's tier has a store; vLLM's fs tier has none


def round_of(name: str, t: Tiering, prompt: str) -> dict[str, float]:
    keys = chunk_names(prompt, TOKENS // (BLOCK * BLOCKS))
    data = [row_bytes(key, t.row_bytes) for key in keys]  # made before the clock starts
    start = time.perf_counter()
    assert len(t.store(keys, data)) == len(keys)
    t.settle()
    released = time.perf_counter() - start
    store = _kvtier_store(t)
    if store is not None:
        store.flush()
    in_tier = time.perf_counter() - start
    t.evict_primary()
    if store is not None:
        store.drop_dram()
    start = time.perf_counter()
    rows = t.load(keys)
    load = time.perf_counter() - start
    assert len(rows) == len(keys), f"{name}: loaded {len(rows)} of {len(keys)} rows"
    assert all(np.array_equal(r, d) for r, d in zip(rows, data)), f"{name}: wrong bytes"
    t.evict_primary()  # the next round starts empty
    return {"store_released_s": released, "store_in_tier_s": in_tier, "load_s": load}


def summarize(rounds: list[dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    rows = []
    for measure in ("store_released_s", "store_in_tier_s", "load_s"):
        base = [r["vllm-fs"][measure] for r in rounds]
        row: dict[str, Any] = {"measure": measure, "vllm_fs_s": statistics.median(base)}
        for name in SYSTEMS[1:]:
            ratios = [r[name][measure] / r["vllm-fs"][measure] for r in rounds]
            key = name.replace("-", "_")
            row[f"{key}_s"] = statistics.median(r[name][measure] for r in rounds)
            row[f"{key}_ratio"] = statistics.median(ratios)
            row[f"{key}_ratio_range"] = [min(ratios), max(ratios)]
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], nbytes: int) -> str:
    names = {"store_released_s": "store (jobs ended)", "store_in_tier_s": "store (in the tier)", "load_s": "load"}
    lines = ["| 4K tokens, " + f"{nbytes / 1e6:.0f} MB | vLLM fs | kvtier filesystem | / vLLM fs | kvtier Redis "
             "| / vLLM fs |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['vllm_fs_s'] * 1e3:.0f} ms"]
        for key in ("kvtier_fs", "kvtier_redis"):
            lo, hi = r[f"{key}_ratio_range"]
            cells += [f"{r[f'{key}_s'] * 1e3:.0f} ms", f"{r[f'{key}_ratio']:.2f} ({lo:.2f}-{hi:.2f})"]
        lines.append(f"| {names[r['measure']]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds (a smoke run)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--dir", type=Path, help="where the tiers' files go (default: a temporary directory)")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, managers(Path(tmp)) as made:
        o_direct = bool(getattr(made["vllm-fs"].tiers[0], "_use_o_direct", False))
        rounds = []
        for i in range(repeats + 1):  # the first round warms up (threads, connections, file-system metadata)
            order = SYSTEMS if i % 2 == 0 else tuple(reversed(SYSTEMS))
            got = {name: round_of(name, made[name], f"round {i}") for name in order}
            log(f"round {i}{' (warm-up)' if i == 0 else ''}: " +
                ", ".join(f"{n} store {g['store_in_tier_s'] * 1e3:.0f} ms, load {g['load_s'] * 1e3:.0f} ms"
                          for n, g in got.items()))
            if i:
                rounds.append(got)
        nbytes = made["vllm-fs"].row_bytes * (TOKENS // (BLOCK * BLOCKS))
    rows = summarize(rounds)
    print(markdown(rows, nbytes))
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "commit": _commit(),
              "tokens": TOKENS, "chunk_tokens": BLOCK * BLOCKS, "bytes": nbytes, "rounds": repeats,
              "vllm_fs_o_direct": o_direct, "rows": rows, "raw": rounds}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
