"""``kvtier bench``: TTFT of repeated long prefixes on vLLM (CPU), with and without kvtier
(:mod:`kvtier.bench.ttft`).

    kvtier bench [--quick] [--json PATH] [--shared-tier redis|redis-cluster|s3|mooncake] [--prefix-tokens N]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.cli._common import Subcommands


def register(top: Subcommands) -> None:
    bench = top.add_parser("bench", help="TTFT of repeated long prefixes on vLLM (CPU), with and without kvtier")
    bench.set_defaults(run=_bench)
    bench.add_argument("--quick", action="store_true", help="a smaller workload that finishes in a few minutes")
    bench.add_argument("--json", type=Path, help="also write the results as JSON here")
    bench.add_argument("--work-dir", type=Path, help="scratch directory (default: ./results/bench-work)")
    bench.add_argument("--shared-tier", choices=["redis", "redis-cluster", "s3", "mooncake"],
                       help="use this shared tier (a server started on loopback) as the only secondary tier "
                            "instead of the local disk, and report TTFT for hits served from it")
    bench.add_argument("--prefix-tokens", type=_prefix_tokens, metavar="N",
                       help="documents of N tokens (a multiple of 64, 1024 to 32768; e.g. 8192, 16384, or 4032: "
                            "15 chunks and a tail) instead of 4096: the hit phases only, 3 documents asked twice")
    bench.add_argument("--chunk-tokens", type=int, choices=(128, 256, 512), default=256,
                       help="kvtier's chunk size (default 256; 128 is vLLM-CPU's block size: twice the chunks "
                            "of 256)")
    bench.add_argument("--no-tails", action="store_true",
                       help="store whole chunks only, not also a prompt's whole blocks after them (its tail): to "
                            "measure what tails gain")


def _prefix_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value % 64 or not 1024 <= value <= 32768:
        raise argparse.ArgumentTypeError(f"{value}: must be a multiple of 64 from 1024 to 32768")
    return value


def _bench(args: argparse.Namespace) -> int:
    from kvtier.bench.ttft import run

    return run(args.quick, args.json, args.work_dir, args.shared_tier, args.prefix_tokens, args.chunk_tokens,
               tails=not args.no_tails)
