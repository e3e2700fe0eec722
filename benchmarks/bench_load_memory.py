"""Peak extra memory of one load: a 16,384-token prompt loaded into paged KV blocks, from each tier.

    python benchmarks/bench_load_memory.py [--tokens 16384] [--tiers dram,filesystem,redis] [--json PATH]

Each tier runs in a fresh process of its own. The engine's paged cache and the store's DRAM pool are faulted in
first (a load of another prompt of the same size), then the process's peak RSS is reset
(``/proc/self/clear_refs``) and the prompt is loaded the way the vLLM connector's worker loads it
(``KVStore.load`` handing chunk views to ``scatter_chunks``). What the load added at its peak is compared with
a chunk's size and with the whole prompt's KV (what a staging buffer of the whole prompt would cost).
SmolLM2-135M's shape: 30 layers, 3 KV heads, head dim 64, bf16, 256-token chunks (5.9 MB each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

LAYERS, HEADS, DIM, CHUNK, BLOCK = 30, 3, 64, 256, 128
KINDS = ("dram", "filesystem", "redis")


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(kind: str, tokens: int, root: Path, redis_url: str | None) -> dict:
    import torch

    from kvtier import KVStore, Namespace, load_config
    from kvtier.integrations.layouts import scatter_chunks
    from kvtier.testing import synthetic_tokens

    tiers = {"dram": [], "filesystem": [{"type": "filesystem", "path": str(root / "kv")}],
             "redis": [{"type": "redis", "url": redis_url}]}[kind]
    chunk_bytes = LAYERS * 2 * HEADS * CHUNK * DIM * 2
    prompt_bytes = tokens // CHUNK * chunk_bytes
    # DRAM holds one prompt and a bit: the second prompt's promotions evict the first's chunks.
    cfg = load_config({"chunk_tokens": CHUNK, "dram": {"capacity_bytes": prompt_bytes + 8 * chunk_bytes},
                       "tiers": tiers})
    ns = Namespace(model="bench-load-memory", dtype="bfloat16")
    blocks = tokens // BLOCK
    caches = [torch.zeros(blocks, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    prompts = [synthetic_tokens(seed, tokens) for seed in (1, 2)]
    with KVStore(cfg) as store:
        for p in prompts:  # stored piece by piece (a whole-prompt tensor here would be freed, not counted)
            for c in range(0, tokens, 16 * CHUNK):
                kv = torch.randn(LAYERS, 2, HEADS, 16 * CHUNK, DIM).to(torch.bfloat16)
                store.put(ns, p[:c + 16 * CHUNK], kv, offset=c)
                del kv
        store.flush()

        def load(p: list[int]) -> int:
            if kind != "dram":
                store.drop_dram()

            def sink(first: int, kv: torch.Tensor) -> None:
                per = CHUNK // BLOCK
                ids = list(range(first * per, (first + kv.shape[0]) * per))
                scatter_chunks(kv, caches, ids, "cpu")

            return store.load(ns, p, sink, layers=LAYERS, head_dim=DIM, dtype=torch.bfloat16)

        if kind == "dram":
            assert load(prompts[0]) == tokens  # faults in the caches; DRAM pages are resident since the puts
        else:
            assert load(prompts[0]) == tokens  # faults in caches, read buffers and the promoted DRAM pages
            assert load(prompts[1]) == tokens
            assert load(prompts[0]) == tokens
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        before = _kib("VmRSS")
        assert load(prompts[1]) == tokens
        peak = _kib("VmHWM")
    extra = (peak - before) * 1024
    return {"tier": kind, "tokens": tokens, "chunk_bytes": chunk_bytes, "prompt_bytes": prompt_bytes,
            "extra_peak_bytes": extra, "chunks_of_extra": round(extra / chunk_bytes, 2)}


@contextlib.contextmanager
def _redis(root: Path) -> Iterator[str]:
    from kvtier.testing.servers import RedisServer

    server = RedisServer(root / "redis", maxmemory="2gb").start()
    try:
        yield server.url
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--tiers", default=",".join(KINDS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "ROOT", "REDIS_URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokens % CHUNK or args.tokens < 16 * CHUNK:
        parser.error(f"--tokens: a multiple of {CHUNK}, at least {16 * CHUNK}")
    if args.child:
        kind, root, url = args.child
        print("RESULT " + json.dumps(child(kind, args.tokens, Path(root), None if url == "-" else url)))
        return 0
    kinds = [k.strip() for k in args.tiers.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--tiers: unknown {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-load-memory-") as tmp, contextlib.ExitStack() as stack:
        url = stack.enter_context(_redis(Path(tmp))) if "redis" in kinds else "-"
        for kind in kinds:
            print(f"load memory: {kind}, {args.tokens} tokens ...", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--child", kind,
                                   str(Path(tmp) / kind), url], capture_output=True, text=True, check=False)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(next(ln for ln in proc.stdout.splitlines()
                                        if ln.startswith("RESULT ")).removeprefix("RESULT ")))
    print("| tier | prompt | whole prompt's KV | peak extra RSS of its load | in chunks (5.9 MB) | target |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tier']} | {r['tokens']} tokens | {r['prompt_bytes'] / 1e6:.0f} MB | "
              f"{r['extra_peak_bytes'] / 1e6:.1f} MB | {r['chunks_of_extra']} | <= 2 chunks |")
    if args.json:
        args.json.write_text(json.dumps({"machine": os.uname().machine, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
