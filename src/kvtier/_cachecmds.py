"""What the cache commands of :mod:`kvtier.cli` and :mod:`kvtier.keycmds` share: the store config's audit log,
removing objects and the records about namespaces (with progress, and on record), and sizes as they are printed.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from tqdm import tqdm

from kvtier.errors import ConfigError
from kvtier.tiers.base import StoredObject, Tier

if TYPE_CHECKING:
    from kvtier.audit import AuditLog


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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
    print(f"tier {tier.name}: removed {removed} objects ({human(size)})")


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
