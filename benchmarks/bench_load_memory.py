"""Peak extra memory of one load: a 16,384-token prompt loaded into paged KV blocks, from each tier.

    python benchmarks/bench_load_memory.py [--tokens 16384] [--tiers dram,filesystem,redis,s3] [--json PATH]

Each tier runs in a fresh process of its own. The engine's paged cache (zeroed) and the store's DRAM pool (by
the puts of two prompts) are resident first; then the process's peak RSS is reset (``/proc/self/clear_refs``)
and the prompt is loaded, once, in a process that has loaded one chunk of the other prompt before (the clients'
setup is not the load's), the way the vLLM connector's worker loads it (``KVStore.load`` handing chunk views to
``scatter_chunks``). What the load added at its peak is compared with a chunk's size and with the whole prompt's
KV (what a staging buffer of the whole prompt costs).
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
KINDS = ("dram", "filesystem", "redis", "s3")


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(kind: str, tokens: int, root: Path, server: str | None) -> dict:
    import torch

    from kvtier import KVStore, Namespace, load_config
    from kvtier.integrations.layouts import scatter_chunks
    from kvtier.testing import synthetic_tokens

    tiers = {"dram": list, "filesystem": lambda: [{"type": "filesystem", "path": str(root / "kv")}],
             "redis": lambda: [{"type": "redis", "url": server}],
             "s3": lambda: [{"type": "s3", **json.loads(server or "{}")}]}[kind]()
    chunk_bytes = LAYERS * 2 * HEADS * CHUNK * DIM * 2
    prompt_bytes = tokens // CHUNK * chunk_bytes
    # With a tier behind it DRAM holds one prompt and a bit: a load's promotions evict the other prompt's chunks.
    capacity = (2 if kind == "dram" else 1) * prompt_bytes + 32 * chunk_bytes
    cfg = load_config({"chunk_tokens": CHUNK, "dram": {"capacity_bytes": capacity},
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
                store.flush()  # a slow tier's bounded queue would drop writes put faster than it takes them

        def load(p: list[int]) -> int:
            if kind != "dram":
                store.drop_dram()

            def sink(first: int, kv: torch.Tensor) -> None:
                per = CHUNK // BLOCK
                ids = list(range(first * per, (first + kv.shape[0]) * per))
                scatter_chunks(kv, caches, ids, "cpu")

            return store.load(ns, p, sink, layers=LAYERS, head_dim=DIM, dtype=torch.bfloat16)

        # One chunk of the other prompt first: what a client sets up once (botocore's parsers for GetObject, the
        # store's reading threads) is not a cost of the load.
        assert load(prompts[0][:CHUNK]) == CHUNK
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        before = _kib("VmRSS")
        assert load(prompts[1]) == tokens
        peak = _kib("VmHWM")
    extra = (peak - before) * 1024
    return {"tier": kind, "tokens": tokens, "chunk_bytes": chunk_bytes, "prompt_bytes": prompt_bytes,
            "extra_peak_bytes": extra, "chunks_of_extra": round(extra / chunk_bytes, 2)}


@contextlib.contextmanager
def _server(kind: str, root: Path) -> Iterator[str]:
    """What the child needs to reach the tier's server (started here): Redis's URL, S3's tier options."""
    from kvtier.testing.servers import RedisServer, S3Server

    if kind not in ("redis", "s3"):
        yield "-"
        return
    server = RedisServer(root, maxmemory="2gb") if kind == "redis" else S3Server(root)
    server.start()
    try:
        yield server.url if isinstance(server, RedisServer) else json.dumps(server.tier_options())
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--tiers", default=",".join(KINDS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "ROOT", "SERVER"), help=argparse.SUPPRESS)
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
    with tempfile.TemporaryDirectory(prefix="kvtier-load-memory-") as tmp:
        for kind in kinds:
            print(f"load memory: {kind}, {args.tokens} tokens ...", file=sys.stderr, flush=True)
            (Path(tmp) / kind).mkdir()
            with _server(kind, Path(tmp) / kind / "server") as server:
                proc = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--child", kind,
                                       str(Path(tmp) / kind), server], capture_output=True, text=True, check=False)
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
