"""``kvtier fleet``: a whole fleet on this host from one YAML file (:mod:`kvtier.fleet`).

    kvtier fleet up   --config FILE [--interval SECONDS]
    kvtier fleet down --config FILE
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvtier.cli._common import refuse
from kvtier.errors import ConfigError, KVTierError

if TYPE_CHECKING:
    from kvtier.cli._common import Subcommands


def register(top: Subcommands) -> None:
    fleet = top.add_parser("fleet", help="a whole fleet on this host from one YAML file: Redis, vLLM API servers "
                                         "with kvtier, the router, Prometheus")
    fleet.set_defaults(run=_fleet)
    fleet_sub = fleet.add_subparsers(dest="command", required=True)
    up = fleet_sub.add_parser("up", help="start the fleet, wait until each part is healthy, print its status until "
                                         "Ctrl-C, then stop everything it started")
    up.add_argument("--config", required=True, help="fleet config (YAML; see the README's 'Operating')")
    up.add_argument("--interval", type=float, default=10.0, help="seconds between status tables (default 10)")
    fleet_sub.add_parser("down", help="stop a fleet started with this config from another shell").add_argument(
        "--config", required=True, help="the fleet config it was started with")


def _fleet(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvtier.fleet.config import load_fleet_config, preflight
    from kvtier.fleet.run import Fleet, down

    try:
        config = load_fleet_config(args.config)
        if args.command == "down":
            return down(config, sys.stdout)
        if not 0.5 <= args.interval <= 3600:
            raise ConfigError(f"--interval: must be in [0.5, 3600] seconds, got {args.interval}")
        preflight(config)
    except KVTierError as exc:
        return refuse(exc)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, lambda *_: stop.set())
    return Fleet(config).up(sys.stdout, args.interval, stop)
