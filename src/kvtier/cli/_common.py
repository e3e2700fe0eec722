"""What the command groups of :mod:`kvtier.cli` share: running a command on a store config's tiers, refusing with
exit 2, the config's sealer and audit log, and removing objects and the records about namespaces (with progress,
and on record).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TypeAlias

from tqdm import tqdm

from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierError
from kvtier.store import open_tiers
from kvtier.tiers.base import StoredObject, Tier
from kvtier.units import size_fixed

if TYPE_CHECKING:
    from kvtier.audit import AuditLog
    from kvtier.sealing import Sealer

    # what ``add_subparsers`` returns: each group module adds its parsers to it
    Subcommands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def refuse(message: object) -> int:
    """Say why a command cannot run (``kvtier: ...`` on standard error); its exit status, 2."""
    print(f"kvtier: {message}", file=sys.stderr)
    return 2


def on_tiers(args: argparse.Namespace) -> int:
    """Run a cache or tenant command (``args.func``) on the tiers of the store config ``args.config`` (those
    ``--tier`` names), with the config as ``args.store_config``. Tiers only, no DRAM pool: safe beside a serving
    process."""
    try:
        args.store_config = load_config(args.config)
        # the audit log is a local file: checked even while a tier is down
        tiers = [] if args.command == "audit" else open_tiers(args.store_config)
    except KVTierError as exc:
        return refuse(exc)
    try:
        return args.func(_select(tiers, args.tier), args)
    except KVTierError as exc:
        return refuse(exc)
    finally:
        for tier in tiers:
            tier.close()


def _select(tiers: list[Tier], name: str | None) -> list[Tier]:
    if name is None:
        return tiers
    chosen = [t for t in tiers if t.name == name]
    if not chosen:
        raise KVTierError(f"--tier: no tier named {name!r}; configured: {', '.join(t.name for t in tiers)}")
    return chosen


def sealer_for(args: argparse.Namespace, command: str) -> Sealer:
    """The config's sealer, with every tenant of its keyring attached (a command meets namespaces, not salts)."""
    from kvtier.sealing import Sealer

    config = args.store_config.encryption
    if config is None:
        raise ConfigError(f"encryption: not set in this config; `{command}` needs the master key and the keyring")
    sealer = Sealer(config, create=False)
    sealer.load_keyring()
    return sealer


def open_audit(args: argparse.Namespace) -> AuditLog | None:
    """The store config's audit log, checked writable before anything is removed (None when not configured)."""
    from kvtier.audit import AuditLog

    path = args.store_config.audit_log
    if path is None:
        return None
    try:
        return AuditLog(path)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; nothing was removed") from None


def remove_objects(tier: Tier, objs: list[StoredObject], audit: AuditLog | None, action: str,
                   selector: dict[str, object]) -> None:
    """Remove ``objs`` from ``tier``, with progress; with an audit log, ``<action>-start`` before (a removal that
    fails part-way is on record) and ``<action>`` after (what was removed, even when it stopped part-way)."""
    if audit is not None:
        audit.record(f"{action}-start", tier=tier.name, **selector, objects=len(objs), bytes=sum(o.size for o in objs))
    removed = size = 0
    failed = True
    try:
        for o in tqdm(objs, desc=f"{action} {tier.name}", unit="obj", file=sys.stderr, disable=None):
            if tier.delete(o.key):
                removed += 1
                size += o.size
        failed = False
    finally:
        if audit is not None:
            audit.record(action, tier=tier.name, **selector, objects=removed, bytes=size, failed=failed)
    print(f"tier {tier.name}: removed {removed} objects ({size_fixed(size)})")


def remove_records(tier: Tier, namespaces: list[str], audit: AuditLog | None, action: str,
                   selector: dict[str, object]) -> None:
    """After their objects: what ``tier`` keeps about whole ``namespaces`` beside them (:meth:`Tier.remove_records`:
    share records, a namespace's directory), so nothing names them any more; with an audit log, recorded as
    ``<action>-records`` (failed, when it raised)."""
    removed, failed = 0, True
    try:
        removed = tier.remove_records(namespaces)
        failed = False
    finally:
        if audit is not None:
            audit.record(f"{action}-records", tier=tier.name, **selector, records=removed, failed=failed)
    if removed:
        print(f"tier {tier.name}: removed {removed} records of the namespaces (tenant share records, directories, "
              "markers)")
