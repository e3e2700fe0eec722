"""``kvtier router``: a cache-aware OpenAI-compatible router in front of vLLM API servers (:mod:`kvtier.router`).

    kvtier router --config FILE [--log-level LEVEL]
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvtier.cli._common import refuse
from kvtier.errors import KVTierError

if TYPE_CHECKING:
    from kvtier.cli._common import Subcommands


def register(top: Subcommands) -> None:
    router = top.add_parser("router", help="a cache-aware OpenAI-compatible router in front of vLLM API servers")
    router.set_defaults(run=_router)
    router.add_argument("--config", required=True, help="router config (YAML; see the README's 'Running a fleet')")
    router.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="the least severe log lines printed")


def _router(args: argparse.Namespace) -> int:
    import logging

    from kvtier.router.config import load_router_config

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_router_config(args.config)
    except KVTierError as exc:
        return refuse(exc)
    try:
        from kvtier.router.app import serve
    except ImportError as exc:
        return refuse(f"the router needs its extras: pip install 'kvtier[router]' ({exc})")
    try:
        serve(config, args.config)
    except KVTierError as exc:  # the engines' key cannot be read (engine_api_key)
        return refuse(exc)
    return 0
