"""The cost of encryption at rest: a store's write and cold-read bandwidth through a secondary tier with its
objects sealed (AES-256-GCM, per-tenant keys), against the same store without encryption, in the same run.

    python benchmarks/bench_sealing.py [--quick] [--json PATH] [--dir DIR]

For the filesystem tier (a directory under --dir, in the page cache) and for Redis (a server started here on
loopback): write = put every chunk of a prompt and wait for the cascade write to the tier; read = drop DRAM, then
get the prompt back from the tier (into DRAM pages, verified or decrypted there). Runs alternate plain and sealed,
so drift on a shared machine hits both. Target: sealed / plain >= 0.80 for each. Prints a markdown table, and
what one core does per byte in the same run (AES-256-GCM decryption, xxh3-128, a copy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_store import SHAPES, log, machine, paired

from kvtier import KVStore, Namespace
from kvtier.sealing import write_key_file

CHUNK = 256
TARGET = 0.80


@contextlib.contextmanager
def tier_options(kind: str, root: Path) -> Iterator[dict]:
    if kind == "filesystem":
        yield {"type": "filesystem", "path": str(root / "fs"), "queue_depth": 4096, "queue_bytes": "4GiB"}
        return
    from kvtier.testing.servers import RedisServer

    server = RedisServer(root / "redis", maxmemory="6gb").start()
    try:
        yield {"type": "redis", **server.tier_options(), "queue_depth": 4096, "queue_bytes": "4GiB"}
    finally:
        server.stop()


def bench(kind: str, shape: str, chunks: int, repeats: int, root: Path) -> list[dict]:
    layers, heads, dim = SHAPES[shape]
    tokens = list(range(chunks * CHUNK))
    kv = torch.randn(layers, 2, heads, len(tokens), dim).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    out = torch.empty_like(kv)
    key = root / "master.key"
    if not key.exists():
        write_key_file(str(key))
    with tier_options(kind, root) as tier:
        def config(sealed: bool) -> dict:
            options = dict(tier)
            if kind == "filesystem":
                options["path"] = f"{options['path']}-{'sealed' if sealed else 'plain'}"
            else:
                options["key_prefix"] = f"{'sealed' if sealed else 'plain'}/"
            cfg = {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": 2 * nbytes + 2**26}, "tiers": [options]}
            if sealed:
                cfg["encryption"] = {"key": f"file:{key}", "keyring": str(root / "keyring")}
            return cfg

        with KVStore.from_config(config(False)) as plain, KVStore.from_config(config(True)) as sealed:
            counter = iter(range(10**9))

            def write(store: KVStore) -> None:  # a fresh namespace each time: every chunk is really written
                store.put(Namespace(model=f"bench-{next(counter)}", dtype="bfloat16", cache_salt="tenant"),
                          tokens, kv)
                store.flush()

            def drop() -> None:
                plain.drop_dram()
                sealed.drop_dram()

            plain_w, sealed_w = paired(repeats, lambda: write(plain), lambda: write(sealed), drop)
            ns = Namespace(model="bench-read", dtype="bfloat16", cache_salt="tenant")
            for store in (plain, sealed):
                store.put(ns, tokens, kv)
                store.flush()

            def read(store: KVStore) -> None:
                assert store.get(ns, tokens, out=out) is not None, "a cold read missed"

            plain_r, sealed_r = paired(repeats, lambda: read(plain), lambda: read(sealed), drop)
            assert torch.equal(out, kv)
            hits = sealed.stats()[sealed.tiers[0].name]["hit_chunks_total"]
            assert hits >= repeats * chunks, f"sealed reads hit {hits} chunks"
    rows = []
    for op, base, mine in (("write", plain_w, sealed_w), ("read", plain_r, sealed_r)):
        rows.append({"tier": kind, "shape": shape, "op": op, "bytes": nbytes, "plain_gbps": nbytes / base / 1e9,
                     "sealed_gbps": nbytes / mine / 1e9, "ratio": base / mine, "target": TARGET})
    return rows


def primitives(mib: int = 64, repeats: int = 5) -> dict[str, float]:
    """GB/s of one core for what a read does to every byte: AES-256-GCM decryption (a sealed read), xxh3-128 (a
    plain read's check), a copy (from the page cache into DRAM pages, or out of them)."""
    import time

    import xxhash
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    data = bytearray(os.urandom(2**20) * mib)
    out = bytearray(len(data))
    key, nonce = os.urandom(32), os.urandom(12)

    def decrypt() -> None:
        decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, b"\0" * 16)).decryptor()
        decryptor.update_into(data, out)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return len(data) / min(times) / 1e9

    return {"aes256gcm_decrypt_gbps": best(decrypt), "xxh3_128_gbps": best(lambda: xxhash.xxh3_128(data).digest()),
            "copy_gbps": best(lambda: memoryview(out).__setitem__(slice(None), data))}


def markdown(rows: list[dict]) -> str:
    lines = ["| tier | shape | op | plain GB/s | sealed GB/s | sealed / plain | target | met |", "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['tier']} | {r['shape']} ({r['bytes'] / 1e6:.0f} MB) | {r['op']} | {r['plain_gbps']:.2f} "
                     f"| {r['sealed_gbps']:.2f} | {r['ratio']:.2f} | >= {r['target']:.2f} | "
                     f"{'yes' if r['ratio'] >= r['target'] else 'no'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (about a minute)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--dir", type=Path, help="directory for the filesystem tier (default: a temp dir)")
    parser.add_argument("--torch-threads", type=int, metavar="N",
                        help="torch's intra-op threads in this process (default: torch's own, one per core); "
                             "the copies out of DRAM run on them, and their OpenMP spin-wait takes CPU from the "
                             "store's reading and decrypting threads")
    args = parser.parse_args()
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            parser.error(f"--torch-threads: must be at least 1, got {args.torch_threads}")
        torch.set_num_threads(args.torch_threads)
    repeats = 3 if args.quick else 7
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-sealing-", dir=args.dir))
    rows: list[dict] = []
    try:
        for kind in ("filesystem", "redis"):
            for shape, chunks in (("SmolLM2-135M", 16), ("70B-class", 2)):
                log(f"{kind} tier, {shape}, {chunks} chunks, plain and sealed")
                rows += bench(kind, shape, chunks, repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    speeds = primitives()
    print(f"Machine: {machine()}; torch intra-op threads {torch.get_num_threads()}; filesystem tier in "
          f"{args.dir or tempfile.gettempdir()}\n")
    print(markdown(rows))
    print("\nOne core: " + ", ".join(f"{name[:-5]} {value:.1f} GB/s" for name, value in speeds.items()))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "torch_threads": torch.get_num_threads(), "rows": rows,
                                    "one_core": speeds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
