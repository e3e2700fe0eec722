"""Shared-tier bandwidth, each a ratio against the same server's own client measured in the same run.

    python benchmarks/bench_shared.py [--quick] [--json PATH] [--tiers redis,redis-cluster,s3,mooncake]

For each tier, real servers start on loopback (kvtier.testing.servers). For chunks of realistic sizes (one
256-token chunk of SmolLM2-135M, 5.9 MB, and of an 8B-class model, 33.6 MB) it times:
- put: the tier writing header + payload, vs the raw client writing one value of the same size
  (redis-py SET, boto3 put_object, Mooncake put);
- get: the tier reading and kvtier verifying the object (checksum, header), vs the raw client's plain read;
- get_into: the same read as a hit makes it, into preallocated pages (as DRAM's), verified there.
For Redis, the raw client's GETs of all objects in one pipeline are also timed against one at a time. For a tier
that batches its reads (Mooncake), a load of all the objects through the store (an empty DRAM each time, as a
hit after a restart) is timed with batched reads against one get_into a shard.
For Redis, the get is also timed with a 1 MiB socket read size (the tier's default is redis-py's 64 KiB) to
show what a larger read size buys. Prints a markdown table (pasted into the README) and the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench_store import log, machine, paired  # run as a script from benchmarks/
from kvtier import TIERS
from kvtier.frame import HEADER_LEN, ShardMeta, decode, encode_header, verify
from kvtier.keys import HeadRange, ShardKey
from kvtier.testing import servers
from kvtier.tiers.base import Tier

SHAPES = {"SmolLM2-135M": (30, 3, 64), "8B-class": (32, 8, 128)}  # layers, kv_heads, head_dim
CHUNK = 256
KINDS = ("redis", "redis-cluster", "s3", "mooncake")


def start(kind: str, root: Path) -> tuple[Any, dict, Callable[[], Any]]:
    """The server, the tier's type and options, and a factory for the raw client with put(name, bytes)/get(name)."""
    if kind in ("redis", "redis-cluster"):
        import redis
        from redis.cluster import RedisCluster

        if kind == "redis":
            server: Any = servers.RedisServer(root / kind, maxmemory="3gb").start()
        else:
            server = servers.RedisCluster(root / kind, maxmemory="1gb").start()

        def raw() -> Any:
            client = RedisCluster.from_url(server.url) if kind == "redis-cluster" else redis.Redis.from_url(server.url)
            return _Raw(lambda k, v: client.set(k, v), lambda k: client.get(k), client.close, client)

        return server, {"type": "redis", **server.tier_options()}, raw
    if kind == "s3":
        import boto3
        from botocore.config import Config

        server = servers.S3Server(root / kind).start()
        o = server.tier_options()

        def raw() -> Any:
            s3 = boto3.client("s3", endpoint_url=o["endpoint_url"], aws_access_key_id=o["access_key_id"],
                              aws_secret_access_key=o["secret_access_key"], region_name=o["region"],
                              config=Config(s3={"addressing_style": "path"}, request_checksum_calculation=
                                            "when_required", response_checksum_validation="when_required"))
            bucket = o["bucket"]
            return _Raw(lambda k, v: s3.put_object(Bucket=bucket, Key=f"raw/{k}", Body=v),
                        lambda k: s3.get_object(Bucket=bucket, Key=f"raw/{k}")["Body"].read(), s3.close)

        return server, {"type": "s3", **o}, raw
    from mooncake.store import MooncakeDistributedStore

    server = servers.MooncakeServer(root / kind, segment="3GB").start()

    def raw() -> Any:
        store = MooncakeDistributedStore()
        store.setup("127.0.0.1", server.metadata_server, 0, 256 * 2**20, "tcp", "", server.master)
        return _Raw(lambda k, v: store.upsert(f"raw/{k}", v), lambda k: store.get(f"raw/{k}"), store.close)

    return server, {"type": "mooncake", **server.tier_options()}, raw


class _Raw:
    def __init__(self, put: Callable[[str, bytes], Any], get: Callable[[str], Any], close: Callable[[], Any],
                 client: Any = None):
        self.put, self.get, self.close, self.client = put, get, close, client


def bench_tier(kind: str, shape: str, objects: int, repeats: int, root: Path) -> list[dict]:
    layers, heads, dim = SHAPES[shape]
    meta = ShardMeta(layers, CHUNK, dim, torch.bfloat16, HeadRange(0, heads, heads))
    payload = torch.randn(meta.shape).to(torch.bfloat16).view(torch.uint8).reshape(-1)
    views = [memoryview(payload.numpy())]
    keys = [ShardKey("cd" * 16, f"{i:032x}", meta.heads) for i in range(objects)]
    frames = {k: [encode_header(k, meta, views), *views] for k in keys}
    value = bytes(frames[keys[0]][0]) + payload.numpy().tobytes()  # the raw client writes the same bytes
    server, options, raw_factory = start(kind, root)
    try:
        kind_options = {k: v for k, v in options.items() if k != "type"}
        tier: Tier = TIERS.resolve(options["type"], "type").from_config(kind, kind_options, "tiers[0]")
        raw = raw_factory()

        def tier_put() -> None:
            for k in keys:
                tier.put(k, frames[k])

        def raw_put() -> None:
            for i in range(objects):
                raw.put(f"{shape}-{i}", value)

        def tier_get(t: Tier = tier) -> None:
            for k in keys:
                blob = t.get(k)
                assert blob is not None
                decode(blob, expected=k)

        def raw_get() -> None:
            for i in range(objects):
                assert len(raw.get(f"{shape}-{i}")) == len(value)

        # As a hit reads a shard: into reserved pages (here, one buffer per object, as scattered as DRAM's
        # extents: two each), verified there.
        pages = [[memoryview(bytearray(n)) for n in (len(payload) // 2, len(payload) - len(payload) // 2)]
                 for _ in keys]

        def tier_get_into() -> None:
            for k, into in zip(keys, pages):
                header = tier.get_into(k, HEADER_LEN, into)
                assert header is not None
                verify(header, into, expected=k)

        nbytes = objects * len(value)
        raw_w, tier_w = paired(repeats, raw_put, tier_put)
        raw_r, tier_r = paired(repeats, raw_get, tier_get)
        raw_r2, into_r = paired(repeats, raw_get, tier_get_into)
        rows = [{"tier": kind, "shape": shape, "op": op, "bytes": nbytes, "gbps": nbytes / t / 1e9,
                 "baseline_gbps": nbytes / b / 1e9, "ratio": b / t}
                for op, t, b in (("put", tier_w, raw_w), ("get + verify", tier_r, raw_r),
                                 ("get_into pages + verify", into_r, raw_r2))]
        if kind in ("redis", "redis-cluster"):
            # Whether a load's reads would gain from one pipeline across chunks: the raw client's GETs of every
            # object in one round trip, against one at a time.
            client = raw.client

            def pipelined() -> None:
                pipe = client.pipeline(transaction=False)
                for i in range(objects):
                    pipe.get(f"{shape}-{i}")
                assert all(len(v) == len(value) for v in pipe.execute())

            one_r, piped_r = paired(repeats, raw_get, pipelined)
            rows.append({"tier": kind, "shape": shape, "op": "raw GETs, all in one pipeline (baseline: one at a "
                         "time)", "bytes": nbytes, "gbps": nbytes / piped_r / 1e9,
                         "baseline_gbps": nbytes / one_r / 1e9, "ratio": one_r / piped_r})
        if tier.batch_reads:
            rows.append(store_load(kind, shape, options, objects, repeats))
        if options["type"] == "redis":
            wide = TIERS.resolve("redis", "type").from_config(kind, {**kind_options, "socket_read_bytes": 2**20},
                                                                 "tiers[0]")
            raw_r, small_r = paired(repeats, raw_get, lambda: tier_get(wide))
            rows.append({"tier": kind, "shape": shape, "op": "get + verify, 1 MiB socket reads", "bytes": nbytes,
                         "gbps": nbytes / small_r / 1e9, "baseline_gbps": nbytes / raw_r / 1e9,
                         "ratio": raw_r / small_r})
            wide.close()
        raw.close()
        tier.close()
        for r in rows:
            log(f"  {kind} {shape} {r['op']}: {r['gbps']:.2f} GB/s vs raw {r['baseline_gbps']:.2f} "
                f"({r['ratio']:.2f})")
        return rows
    finally:
        server.stop()


def store_load(kind: str, shape: str, options: dict, objects: int, repeats: int) -> dict:
    """A load of ``objects`` chunks through the store from a tier that batches reads, DRAM dropped before each:
    batched reads (several shards a call, several calls in flight) against one get_into a shard, inline."""
    from kvtier import KVStore, Namespace

    layers, heads, dim = SHAPES[shape]
    tokens = list(range(objects * CHUNK))
    kv = torch.randn(layers, 2, heads, len(tokens), dim).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    ns = Namespace(model=f"bench-load-{shape}", dtype="bfloat16")
    cfg = {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": 2 * nbytes + 2**24},
           "tiers": [{**options, "name": kind}]}
    with KVStore.from_config(cfg) as store:
        store.put(ns, tokens, kv)
        store.flush()
        tier = store.tiers[0]

        def load(batched: bool) -> None:
            tier.batch_reads = batched  # type: ignore[misc]
            assert store.load(ns, tokens, lambda first, got: None, layers=layers, head_dim=dim,
                              dtype=torch.bfloat16) == len(tokens)

        one_s, batched_s = paired(repeats, lambda: load(False), lambda: load(True), setup=store.drop_dram)
    return {"tier": kind, "shape": shape, "op": "store load, batched reads (baseline: one get_into a shard)",
            "bytes": nbytes, "gbps": nbytes / batched_s / 1e9, "baseline_gbps": nbytes / one_s / 1e9,
            "ratio": one_s / batched_s}


def markdown(rows: list[dict]) -> str:
    out = ["| tier | chunk | operation | kvtier | server's own client | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['tier']} | {r['shape']} ({r['bytes'] / r['objects'] / 1e6:.1f} MB) | {r['op']} | "
                   f"{r['gbps']:.2f} GB/s | {r['baseline_gbps']:.2f} GB/s | {r['ratio']:.2f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and objects")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--tiers", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.tiers.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--tiers: unknown {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    repeats = 3 if args.quick else 5
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-shared-"))
    rows: list[dict] = []
    try:
        for kind in kinds:
            for shape, objects in (("SmolLM2-135M", 8 if args.quick else 16), ("8B-class", 2 if args.quick else 4)):
                log(f"{kind}, {shape}, {objects} objects")
                for row in bench_tier(kind, shape, objects, repeats, root):
                    rows.append({**row, "objects": objects})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"Machine: {machine()}; every server on loopback on the same machine\n")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
