"""Store benchmarks, each a ratio against a baseline measured in the same run.

    python benchmarks/bench_store.py [--quick] [--json PATH] [--dir DIR]

1. DRAM tier put/get bandwidth vs a plain torch copy of the same bytes (target >= 0.90); and a load from DRAM
   into vLLM's CPU paged blocks as the connector's worker does it, on one thread and split by layers over two
   (kvtier.integrations.copies), vs a plain one-thread copy of the same bytes (the engine computes on one core).
2. Filesystem tier write and page-cache read vs raw file I/O of the same bytes in the same directory
   (target >= 0.70). The tier's numbers include the checksum and header, written and verified.
3. Caller-side put latency (p50/p99) of one-chunk puts every 5 ms, with a secondary tier taking 200 ms per
   write attached, next to the same store with no secondary tier (target: p99 < 1 ms; the tier adds nothing).
4. Filesystem tier re-index time for 100,000 chunk files vs a bare directory walk with stat.

Prints a markdown table (pasted into the README) and the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvtier import KVStore, Namespace, TIERS
from kvtier.frame import ShardMeta, decode, encode_header
from kvtier.keys import HeadRange, ShardKey
from kvtier.tiers.filesystem import FilesystemTier

SHAPES = {  # name: (layers, kv_heads, head_dim)
    "SmolLM2-135M": (30, 3, 64),
    "70B-class": (80, 8, 128),
}
CHUNK = 256
PUT_INTERVAL_S = 0.005


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def paired(repeats: int, baseline: Callable[[], None], fn: Callable[[], None],
           setup: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """Median times of ``baseline`` and ``fn``, run alternately so that drift on a shared machine hits both.

    ``setup`` runs (untimed) before each timed call.
    """
    setup(), baseline(), setup(), fn()
    base, mine = [], []
    for _ in range(repeats):
        for f, out in ((baseline, base), (fn, mine)):
            setup()
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
    return statistics.median(base), statistics.median(mine)


def bench_dram(shape: str, chunks: int, repeats: int) -> list[dict]:
    layers, heads, dim = SHAPES[shape]
    tokens = list(range(chunks * CHUNK))
    kv = torch.randn(layers, 2, heads, len(tokens), dim).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    dst = torch.empty_like(kv)
    dst.copy_(kv)
    cfg = {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": 3 * nbytes + 2**24}}
    with KVStore.from_config(cfg) as store:
        counter = iter(range(10**9))

        def put() -> None:  # a fresh namespace each time, so every chunk is really stored
            store.put(Namespace(model=f"bench-{next(counter)}", dtype="bfloat16"), tokens, kv)

        copy_put, put_s = paired(repeats, lambda: dst.copy_(kv), put)
        ns = Namespace(model="bench-get", dtype="bfloat16")
        store.put(ns, tokens, kv)
        copy_get, get_s = paired(repeats, lambda: dst.copy_(kv), lambda: store.get(ns, tokens, out=dst))
        assert torch.equal(dst, kv)
    rows = []
    for op, secs, copy_s in (("put", put_s, copy_put), ("get", get_s, copy_get)):
        rows.append({"bench": "dram", "shape": shape, "op": op, "bytes": nbytes,
                     "gbps": nbytes / secs / 1e9, "baseline_gbps": nbytes / copy_s / 1e9,
                     "ratio": copy_s / secs, "target": 0.90})
    return rows


def bench_engine_load(shape: str, chunks: int, repeats: int) -> list[dict]:
    """A load of ``chunks`` chunks from DRAM into vLLM's CPU layout ([blocks, kv_heads, 128, 2 * head_dim] per
    layer, the blocks in one run), through :meth:`KVStore.load` and the layout's strided copies, on the calling
    thread alone and split by layers with one helper thread; against one thread's plain copy of the same bytes.
    Checked exact."""
    from kvtier.integrations.copies import LayerCopies
    from kvtier.integrations.layouts import gather_chunks, scatter_chunks

    layers, heads, dim = SHAPES[shape]
    block = 128
    blocks = chunks * CHUNK // block
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        caches = [torch.randn(2 * blocks, heads, block, 2 * dim).to(torch.bfloat16) for _ in range(layers)]
        src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
        tokens = list(range(chunks * CHUNK))
        ns = Namespace(model="bench-load", dtype="bfloat16")
        nbytes = layers * 2 * heads * dim * 2 * len(tokens)
        plain_src = torch.empty(nbytes, dtype=torch.uint8)
        plain_dst = torch.empty_like(plain_src)
        rows = []
        with KVStore.from_config({"chunk_tokens": CHUNK, "dram": {"capacity_bytes": 2 * nbytes + 2**24}}) as store:
            store.put_from(ns, tokens, lambda first, out: gather_chunks(
                caches, src[first * 2:(first + out.shape[0]) * 2], "cpu", out), layers=layers, head_dim=dim,
                dtype=torch.bfloat16, kv_heads=heads)
            for helpers, op in ((0, "load into vLLM's CPU blocks, 1 thread"),
                                (1, "load into vLLM's CPU blocks, split over 2 threads")):
                copies = LayerCopies(helpers)

                def sink(first: int, kv: torch.Tensor, copies: LayerCopies = copies) -> None:
                    ids = dst[first * CHUNK // block:(first + kv.shape[0]) * CHUNK // block]
                    copies.run(lambda s: scatter_chunks(kv[:, s], caches[s], ids, "cpu"), layers)

                def load(sink: Callable[[int, torch.Tensor], None] = sink) -> None:
                    store.load(ns, tokens, sink, layers=layers, head_dim=dim, dtype=torch.bfloat16, kv_heads=heads)

                copy_s, load_s = paired(repeats, lambda: plain_dst.copy_(plain_src), load)
                assert all(torch.equal(c[dst], c[src]) for c in caches), "the load is not what was stored"
                rows.append({"bench": "dram", "shape": shape, "op": op, "bytes": nbytes, "gbps": nbytes / load_s / 1e9,
                             "baseline_gbps": nbytes / copy_s / 1e9, "ratio": copy_s / load_s, "target": 0.90})
        return rows
    finally:
        torch.set_num_threads(threads)


def bench_filesystem(shape: str, files: int, repeats: int, root: Path) -> list[dict]:
    layers, heads, dim = SHAPES[shape]
    meta = ShardMeta(layers, CHUNK, dim, torch.bfloat16, HeadRange(0, heads, heads))
    payload = torch.randn(meta.shape).to(torch.bfloat16).view(torch.uint8).reshape(-1)
    views = [memoryview(payload.numpy())]
    raw_dir, tier_dir = root / "raw", root / "tier"
    rounds = iter(range(10**9))

    def keys(r: int) -> list[ShardKey]:
        return [ShardKey("ab" * 16, f"{r:016x}{i:016x}", meta.heads) for i in range(files)]

    def fresh(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)

    def raw_write() -> None:
        for i in range(files):
            with open(raw_dir / f"{i}.bin", "wb", buffering=0) as f:
                f.write(views[0])

    def raw_read() -> None:  # the fastest plain read: into an unzeroed buffer of the file's size
        for i in range(files):
            with open(raw_dir / f"{i}.bin", "rb", buffering=0) as f:
                f.readinto(np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8))

    tier_box: list[FilesystemTier] = []

    def tier_write() -> None:
        tier, r = tier_box[0], tier_box[1]
        for key in keys(r):  # type: ignore[arg-type]
            tier.put(key, [encode_header(key, meta, views), *views])

    def tier_read() -> None:
        tier, r = tier_box[0], tier_box[1]
        for key in keys(r):  # type: ignore[arg-type]
            blob = tier.get(key)
            assert blob is not None
            decode(blob, expected=key)

    def empty_dirs() -> None:  # untimed: both write into empty directories, the tier into a fresh instance
        fresh(raw_dir)
        fresh(tier_dir)
        tier_box[:] = [FilesystemTier("fs", FilesystemTier.Options(path=str(tier_dir))), next(rounds)]

    nbytes = files * meta.nbytes
    raw_w, tier_w = paired(repeats, raw_write, tier_write, setup=empty_dirs)
    empty_dirs()
    raw_write()
    tier_write()
    raw_r, tier_r = paired(repeats, raw_read, tier_read)
    shutil.rmtree(raw_dir, ignore_errors=True)
    shutil.rmtree(tier_dir, ignore_errors=True)
    return [{"bench": "filesystem", "shape": shape, "op": op, "bytes": nbytes, "gbps": nbytes / t / 1e9,
             "baseline_gbps": nbytes / b / 1e9, "ratio": b / t, "target": 0.70}
            for op, t, b in (("write", tier_w, raw_w), ("read (page cache)", tier_r, raw_r))]


class SlowFilesystemTier(FilesystemTier):
    """A filesystem tier that takes 200 ms per write, like a distant shared store."""

    def put(self, key: ShardKey, parts) -> None:  # type: ignore[override]
        time.sleep(0.2)
        super().put(key, parts)


def bench_put_latency(puts: int, root: Path) -> list[dict]:
    TIERS.register("slow_filesystem")(SlowFilesystemTier)
    layers, heads, dim = SHAPES["SmolLM2-135M"]
    kv = torch.randn(layers, 2, heads, CHUNK, dim).to(torch.bfloat16)
    tokens = list(range(CHUNK))
    results = {}
    for label, tiers in (("no secondary tier", []),
                         ("200 ms secondary tier", [{"type": "slow_filesystem", "path": str(root / "slow"),
                                                     "queue_depth": 8}])):
        cfg = {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": "1GiB"}, "tiers": tiers}
        with KVStore.from_config(cfg) as store:
            lat = []
            for i in range(puts + 20):  # paced like engine steps, so tier writes overlap many puts
                ns = Namespace(model=f"lat-{i}", dtype="bfloat16")
                start = time.perf_counter()
                store.put(ns, tokens, kv)
                lat.append(time.perf_counter() - start)
                time.sleep(max(0.0, PUT_INTERVAL_S - (time.perf_counter() - start)))
            lat = sorted(lat[20:])
            results[label] = (lat[len(lat) // 2], lat[int(len(lat) * 0.99) - 1])
    base_p50, base_p99 = results["no secondary tier"]
    slow_p50, slow_p99 = results["200 ms secondary tier"]
    return [{"bench": "put latency", "shape": "SmolLM2-135M", "op": "put, 1 chunk (5.9 MB)",
             "p50_ms": slow_p50 * 1e3, "p99_ms": slow_p99 * 1e3, "baseline_p50_ms": base_p50 * 1e3,
             "baseline_p99_ms": base_p99 * 1e3, "tier_cost_p99_ms": (slow_p99 - base_p99) * 1e3}]


def bench_reindex(files: int, root: Path) -> list[dict]:
    path = root / "reindex"
    meta = ShardMeta(1, 16, 8, torch.bfloat16, HeadRange(0, 1, 1))
    payload = [memoryview(bytes(meta.nbytes))]
    tier = FilesystemTier("fs", FilesystemTier.Options(path=str(path)))
    log(f"  writing {files} small chunk files for the re-index benchmark")
    step = max(files // 10, 1)
    for i in range(files):
        key = ShardKey("cd" * 16, f"{i * 2654435761 % 2**64:016x}{i:016x}", meta.heads)
        tier.put(key, [encode_header(key, meta, payload), *payload])
        if (i + 1) % step == 0:
            log(f"    {i + 1}/{files}")

    def walk() -> None:
        n = 0
        for dirpath, _, names in os.walk(path):
            for name in names:
                os.stat(os.path.join(dirpath, name))
                n += 1
        assert n >= files

    def reindex() -> None:
        assert len(list(FilesystemTier("fs", FilesystemTier.Options(path=str(path))).list())) == files

    walk_s, reindex_s = paired(3, walk, reindex)
    shutil.rmtree(path, ignore_errors=True)
    return [{"bench": "re-index", "files": files, "seconds": reindex_s, "baseline_seconds": walk_s,
             "files_per_s": files / reindex_s, "ratio": walk_s / reindex_s}]


def markdown(rows: list[dict]) -> str:
    out = ["| benchmark | shape | operation | kvtier | baseline | ratio | target |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["bench"] in ("dram", "filesystem"):
            out.append(f"| {r['bench']} | {r['shape']} | {r['op']} | {r['gbps']:.2f} GB/s | "
                       f"{r['baseline_gbps']:.2f} GB/s | {r['ratio']:.2f} | >= {r['target']:.2f} |")
        elif r["bench"] == "put latency":
            out.append(f"| put latency, 200 ms tier attached | {r['shape']} | {r['op']} | p50 {r['p50_ms']:.2f} ms, "
                       f"p99 {r['p99_ms']:.2f} ms | p50 {r['baseline_p50_ms']:.2f} ms, p99 "
                       f"{r['baseline_p99_ms']:.2f} ms (no tier) | tier cost at p99 {r['tier_cost_p99_ms']:+.2f} ms "
                       f"| < 1 ms |")
        else:
            out.append(f"| re-index | {r['files']:,} files | open the tier | {r['seconds']:.2f} s "
                       f"({r['files_per_s']:,.0f} files/s) | {r['baseline_seconds']:.2f} s (walk + stat) | "
                       f"{r['ratio']:.2f} | - |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and files (about a minute)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--dir", type=Path, help="directory for the filesystem benchmarks (default: a temp dir)")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir))
    rows: list[dict] = []
    try:
        for shape, chunks, files in (("SmolLM2-135M", 16, 16), ("70B-class", 4, 4)):
            log(f"DRAM tier, {shape}, {chunks} chunks")
            rows += bench_dram(shape, chunks, repeats)
            log(f"DRAM load into vLLM's CPU blocks, {shape}, {chunks} chunks")
            rows += bench_engine_load(shape, chunks, repeats)
            log(f"filesystem tier, {shape}, {files} files")
            rows += bench_filesystem(shape, files, repeats, root)
        log("put latency with a 200 ms secondary tier")
        rows += bench_put_latency(100 if args.quick else 400, root)
        log("re-index")
        rows += bench_reindex(20_000 if args.quick else 100_000, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"Machine: {machine()}; filesystem benchmarks in {args.dir or tempfile.gettempdir()}\n")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
