"""The kvtier worker of the peer benchmark: one group of timed operations through ``KVStore``, in its own process.

    python _kvtier_side.py --group {dram,filesystem,filesystem-restart,redis} --shape NAME --out FILE [--dir D]
                           [--url redis://...]

Every group warms up with one batch, then times a few rounds, each on a batch of its own, after dropping DRAM (so
the batch lands on pages already faulted in, as LMCache's does): ``store`` is ``put`` (DRAM) or ``put`` + ``flush``
(until the secondary tier holds every chunk); ``retrieve`` is ``get(out=...)``, from DRAM, or after ``drop_dram``
from the filesystem (page cache) or Redis. ``filesystem-restart`` opens a new store on the directory a
``filesystem`` run left and times a ``get`` of each batch it stored.
"""

from __future__ import annotations

import sys

import torch

from _common import SHAPES, WARMUP_BATCH, Result, Shape, batch_tokens, make_kv, parse_args, timed, timed_batches
from kvtier import KVStore, Namespace

GROUPS = ("dram", "filesystem", "filesystem-restart", "redis")
NS = Namespace(model="peers-bench", dtype="bfloat16")
DRAM_BYTES = 2**30  # LMCache's side gets the same (max_local_cpu_size 1.0 GiB)


def config(group: str, args) -> dict:
    tiers: list[dict] = []
    if group.startswith("filesystem"):
        tiers = [{"type": "filesystem", "path": str(args.dir)}]
    elif group == "redis":
        tiers = [{"type": "redis", "url": args.url}]
    return {"chunk_tokens": 256, "dram": {"capacity_bytes": DRAM_BYTES}, "tiers": tiers}


def retrieve(store: KVStore, shape: Shape, batch: int, out: torch.Tensor) -> int:
    got = store.get(NS, batch_tokens(batch, shape), out=out)
    return 0 if got is None else shape.tokens


def run(group: str, shape: Shape, args, result: Result) -> None:
    out = torch.zeros(shape.layers, 2, shape.kv_heads, shape.tokens, shape.head_dim, dtype=torch.bfloat16)
    kv = make_kv(shape)
    if group == "filesystem-restart":
        open_s, store = timed(lambda: KVStore.from_config(config(group, args)))
        result.samples["open"] = [open_s]
        with store:
            for batch in timed_batches():
                result.found("lookup", store.lookup(NS, batch_tokens(batch, shape)))
                out.zero_()
                found = result.time("retrieve", lambda: retrieve(store, shape, batch, out))  # noqa: B023 timed at once
                result.check("retrieve", out, kv, found, shape.tokens)
        return
    secondary = group != "dram"
    with KVStore.from_config(config(group, args)) as store:
        def store_batch(batch: int) -> None:
            held = store.put(NS, batch_tokens(batch, shape), kv)
            assert held == shape.tokens, f"kvtier stored {held} of {shape.tokens} tokens"
            if secondary:
                store.flush()  # the store ends when the tier holds every chunk

        store_batch(WARMUP_BATCH)
        if secondary:
            store.drop_dram()
        result.check("warmup", out, kv, retrieve(store, shape, WARMUP_BATCH, out), shape.tokens)
        for batch in timed_batches():
            store.drop_dram()  # the batch lands on DRAM pages already faulted in, as LMCache's freed ones are
            result.time("store", lambda: store_batch(batch))  # noqa: B023 timed at once
            if secondary:
                store.drop_dram()  # read the batch back from the tier, not from DRAM
            out.zero_()
            found = result.time("retrieve", lambda: retrieve(store, shape, batch, out))  # noqa: B023 timed at once
            result.check("retrieve", out, kv, found, shape.tokens)
        hits = {tier: int(v["hit_chunks_total"]) for tier, v in store.stats().items() if "hit_chunks_total" in v}
        result.notes.append(f"chunks served, by tier: {hits}")  # shows the timed reads came from the tier


def main() -> int:
    args = parse_args("kvtier", GROUPS)
    shape = SHAPES[args.shape]
    result = Result("kvtier", args.group, shape.name)
    run(args.group, shape, args, result)
    result.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
