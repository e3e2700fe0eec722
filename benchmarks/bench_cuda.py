"""DRAM tier on a CUDA machine: exactness of put/get from and to GPU tensors, and transfer bandwidth.

    python benchmarks/bench_cuda.py [--json PATH]

With CUDA present the DRAM pool is pinned host memory. ``put`` of a GPU tensor is measured against one plain
``torch`` device-to-host copy of the same bytes into pinned memory, ``get(out=gpu_tensor)`` against one
host-to-device copy (target >= 0.90 each). Exactness is checked across TP degrees before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier import KVStore, Namespace

SHAPES = {"SmolLM2-135M": (30, 3, 64, 16), "70B-class": (80, 8, 128, 4)}  # layers, kv heads, head dim, chunks
CHUNK = 256


def timed(repeats: int, fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_exact(store: KVStore, kv: torch.Tensor, tokens: list[int], heads: int) -> None:
    ns = Namespace(model="exact", dtype="bfloat16")
    for write_tp in (1, 2) if heads % 2 == 0 else (1,):
        ns_w = Namespace(model=f"exact-tp{write_tp}", dtype="bfloat16")
        per = heads // write_tp
        for rank in range(write_tp):
            store.put(ns_w, tokens, kv[:, :, rank * per:(rank + 1) * per], tp_rank=rank, tp_size=write_tp)
        for read_tp in (1, 2, 4) if heads % 4 == 0 else (1, heads):
            per_r = heads // read_tp
            for rank in range(read_tp):
                out = torch.empty_like(kv[:, :, rank * per_r:(rank + 1) * per_r])
                assert store.get(ns_w, tokens, tp_rank=rank, tp_size=read_tp, out=out) is out
                assert torch.equal(out, kv[:, :, rank * per_r:(rank + 1) * per_r]), (write_tp, read_tp, rank)
    store.put(ns, tokens, kv)
    store.drop_dram()
    assert store.lookup(ns, tokens) == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device", file=sys.stderr)
        return 2
    rows = []
    for shape, (layers, heads, dim, chunks) in SHAPES.items():
        tokens = list(range(chunks * CHUNK))
        kv = torch.randn(layers, 2, heads, len(tokens), dim, device="cuda").to(torch.bfloat16)
        nbytes = kv.numel() * kv.element_size()
        cfg = {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": 4 * nbytes + 2**26}}
        with KVStore.from_config(cfg) as store:
            assert store.dram._arena.is_pinned(), "with CUDA present the pool must be pinned"
            check_exact(store, kv, tokens, heads)
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            d2h = timed(args.repeats, lambda: host.copy_(kv))  # noqa: B023 timed() runs it now
            counter = iter(range(10**9))
            put = timed(args.repeats, lambda: store.put(
                Namespace(model=f"p{next(counter)}", dtype="bfloat16"), tokens, kv))  # noqa: B023 timed() runs it now
            ns = Namespace(model="get", dtype="bfloat16")
            store.put(ns, tokens, kv)
            out = torch.empty_like(kv)
            h2d = timed(args.repeats, lambda: out.copy_(host))  # noqa: B023 timed() runs it now
            get = timed(args.repeats, lambda: store.get(ns, tokens, out=out))  # noqa: B023 timed() runs it now
            assert torch.equal(out, kv)
        for op, secs, base in (("put from GPU", put, d2h), ("get to GPU", get, h2d)):
            rows.append({"shape": shape, "op": op, "bytes": nbytes, "gbps": nbytes / secs / 1e9,
                         "baseline_gbps": nbytes / base / 1e9, "ratio": base / secs})
    print(f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}; exactness checked across TP 1/2/4\n")
    print("| shape | operation | kvtier | plain torch copy (pinned) | ratio | target |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['op']} | {r['gbps']:.1f} GB/s | {r['baseline_gbps']:.1f} GB/s | "
              f"{r['ratio']:.2f} | >= 0.90 |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
