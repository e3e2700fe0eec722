"""The ``kvtier`` command line: inspect and maintain the secondary tiers of a configured store.

    kvtier cache stats  --config FILE
    kvtier cache ls     --config FILE [--namespace NS] [--tier NAME]
    kvtier cache verify --config FILE [--tier NAME] [--repair]
    kvtier cache purge  --config FILE (--namespace NS | --older-than AGE | --all) [--tier NAME]
    kvtier cache retain --config FILE [--tier NAME]
    kvtier cache rekey  --config FILE [--tier NAME]
    kvtier tenant forget --config FILE (SALT | - | --unsalted)
    kvtier keygen FILE
    kvtier bench [--quick] [--json PATH] [--shared-tier redis|redis-cluster|s3|mooncake] [--prefix-tokens N]
    kvtier router --config FILE
    kvtier calibrate [--quick] [--out FILE] [--model DIR] [--config FILE]
    kvtier validate --trace FILE --deployment FILE --calibration FILE [--model DIR] [--out DIR]
    kvtier simulate --trace FILE [--block-tokens N] [--capacities N,N,...] [--policies P,P] [--out DIR]
    kvtier simulate --scenario preemption --calibration FILE [--out DIR]
    kvtier decide --card FILE --facts FILE --calibration FILE [--out DIR]
    kvtier serve MODEL [--dram SIZE] [--disk PATH] [--redis URL] [--config FILE] [--dry-run] [vLLM options...]
    kvtier doctor [--config FILE]

The cache commands open the tiers only (no DRAM pool), so they are safe to run beside a serving process.

One module per command group, each adding its own parsers (``register``) with the function that runs them as
the ``run`` default: :mod:`~kvtier.cli.cache`, :mod:`~kvtier.cli.encryption` (keygen, cache rekey, tenant
forget), :mod:`~kvtier.cli.bench`, :mod:`~kvtier.cli.fleet`, :mod:`~kvtier.cli.router`, :mod:`~kvtier.cli.sim`
(calibrate, validate, simulate, decide), :mod:`~kvtier.cli.serve` and :mod:`~kvtier.cli.doctor`; what they share is
in :mod:`kvtier.cli._common`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import kvtier
from kvtier.cli import bench, cache, doctor, encryption, fleet, router, serve, sim


def build_parser() -> argparse.ArgumentParser:
    """Every command, in the order ``kvtier --help`` lists them."""
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvtier.__version__}")
    top = parser.add_subparsers(dest="group", required=True)
    encryption.register(top, cache.register(top))
    bench.register(top)
    fleet.register(top)
    router.register(top)
    sim.register(top)
    serve.register(top)
    doctor.register(top)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)

