"""What kvtier's DRAM allows on bench_router's ``prefix_repetition``, routing aside: the workload's request order
replayed through the DRAM's own eviction policy (``prefix_lru``) at page granularity, for one engine of two.

- ``partitioned``: the engine gets every request of six of the twelve documents (cache-aware routing at its best);
- ``round-robin``: the engine gets every other request, of all twelve documents.

A hit is a request that finds its whole document resident. A document is four 256-token chunks of SmolLM2-135M
(5.6 MiB: 6 pages of 1 MiB), and every request stores its own 128-token tail after it (3 pages), a child of the
document's last chunk: the tails written between two requests of a document are what pushes it out. Each
document's first request misses, so the most ``partitioned`` can reach is 42 of 48 (0.875).

    python benchmarks/bench_router_capacity.py [--seeds N]

Prints the hit share per DRAM capacity (MiB), averaged over ``--seeds`` shuffles (200) of the workload's 96
requests (8 per document, shuffled as vLLM's dataset does); about 5 seconds.
"""

from __future__ import annotations

import argparse
import random

from kvtier.eviction import PrefixLRUPolicy

DOCUMENTS = 12
PER_DOCUMENT = 8
CHUNKS = 4  # 1,024 tokens in chunks of 256
CHUNK_PAGES = 6  # 256 tokens x 23,040 bytes = 5.625 MiB, in pages of 1 MiB
TAIL_PAGES = 3  # 128 tokens: 2.8 MiB


def hits(capacity_pages: int, seed: int, partitioned: bool) -> tuple[int, int]:
    """(hits, requests) on one engine for one shuffle of the workload."""
    order = [d for d in range(DOCUMENTS) for _ in range(PER_DOCUMENT)]
    random.Random(seed).shuffle(order)
    mine = [d for d in order if d < DOCUMENTS // 2] if partitioned else order[::2]
    policy = PrefixLRUPolicy()
    pages: dict[tuple[int, int], int] = {}
    used = found = 0

    def store(key: tuple[int, int], size: int, parent: tuple[int, int] | None) -> None:
        nonlocal used
        while used + size > capacity_pages:
            victim = policy.victim(lambda k: k not in chunks)  # never the prompt's own chunks
            assert victim is not None, "a request's own chunks fill the DRAM"
            used -= pages.pop(victim)
            policy.remove(victim)
        pages[key] = size
        used += size
        policy.insert(key, key, parent)

    for n, doc in enumerate(mine):
        chunks = [(doc, c) for c in range(CHUNKS)]
        found += all(c in pages for c in chunks)
        for c, chunk in enumerate(chunks):
            if chunk in pages:
                policy.touch(chunk)
            else:
                store(chunk, CHUNK_PAGES, chunks[c - 1] if c else None)
        store((-1, n), TAIL_PAGES, chunks[-1])
    return found, len(mine)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    args = parser.parse_args()
    print("| DRAM (MiB) | partitioned | round-robin |")
    print("|---|---|---|")
    for mib in (128, 160, 176, 192, 224):
        shares = []
        for partitioned in (True, False):
            total = [hits(mib, seed, partitioned) for seed in range(args.seeds)]
            shares.append(sum(h for h, _ in total) / sum(n for _, n in total))
        print(f"| {mib} | {shares[0]:.3f} | {shares[1]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
