"""The commands that handle encryption keys (:mod:`kvtier.sealing`): a new master key, re-sealing every object
under the current key after a rotation, and forgetting a tenant.

    kvtier keygen FILE
    kvtier cache rekey     --config FILE [--tier NAME]
    kvtier tenant forget   --config FILE (SALT | - | --unsalted)

Like the other cache commands they open the tiers only (no DRAM pool), so they run beside serving engines.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from kvtier import frame
from kvtier.cli._common import on_tiers, open_audit, refuse, remove_objects, remove_records, sealer_for
from kvtier.errors import TierError
from kvtier.store import open_tiers
from kvtier.tiers.base import Tier

if TYPE_CHECKING:
    from kvtier.audit import AuditLog
    from kvtier.cli._common import Subcommands
    from kvtier.sealing import Sealer


def cmd_keygen(args: argparse.Namespace) -> int:
    from kvtier.sealing import write_key_file

    try:
        write_key_file(args.file)
    except FileExistsError:
        return refuse(f"{args.file} exists; a key file is never overwritten")
    except OSError as exc:
        return refuse(f"cannot write {args.file}: {exc.strerror}")
    print(f"wrote a new 256-bit key to {args.file} (mode 0600); name it in the config as "
          f"`encryption: {{key: file:{args.file}}}`")
    return 0


def cmd_rekey(tiers: list[Tier], args: argparse.Namespace) -> int:
    """Every object sealed under an older master key is opened and sealed again under its tenant's current key,
    in place: each write replaces the object atomically, so readers holding both keys keep hitting throughout.
    Plain objects are never sealed (anyone who can write a tier could have made them)."""
    sealer = sealer_for(args, "kvtier cache rekey")
    failed_total = 0
    try:
        for tier in tiers:
            counts = dict.fromkeys(("resealed", "current", "plain", "no_tenant", "unknown_key", "bad", "gone"), 0)
            objects = list(tier.list())
            for o in tqdm(objects, desc=f"rekey {tier.name}", unit="obj", file=sys.stderr, disable=None):
                counts[_rekey_one(tier, o.key, sealer)] += 1
            print(f"tier {tier.name}: {counts['resealed']} re-sealed, {counts['current']} already under the current "
                  f"key, {counts['plain']} plain (never sealed: left to purge), {counts['no_tenant']} of namespaces "
                  f"no tenant in the keyring used, {counts['unknown_key']} "
                  f"under keys not configured, {counts['bad']} bad (left for `kvtier cache verify --repair`), "
                  f"{counts['gone']} gone or replaced during the walk (not written back)")
            failed_total += counts["unknown_key"] + counts["bad"]
    finally:
        sealer.close()
    return 1 if failed_total else 0


def _rekey_one(tier: Tier, key: frame.ShardKey, sealer: Sealer) -> str:
    want = sealer.current_key_id(key.namespace)
    if want is None:
        return "no_tenant"
    blob = tier.get(key)
    if blob is None:
        return "gone"
    try:
        header = frame.decode_header(memoryview(blob))
        if header.sealing is None:
            # Never sealed here: a plain object's checksum is unkeyed, so whoever can write the tier could have made
            # it, and sealing it would make forged KV trusted. Engines refuse it; purge it.
            return "plain"
        if header.sealing.key_id == want:
            return "current"
        header, payload = frame.decode(blob, expected=key, opener=sealer)
    except frame.UnknownKey:
        return "unknown_key"
    except frame.FrameError as exc:
        print(f"bad: {tier.name} {key.name}: {exc}")
        return "bad"
    sealed = sealer.seal(key, header.meta, [payload], header.created, header.codec)
    # Read again right before the write: an object deleted meanwhile (a purge, a forget, an eviction) is not written
    # back, nor one replaced (its header holds a random nonce: another write's differs). A delete landing between
    # this read and the write is still undone: tiers offer no conditional write.
    now = tier.get(key)
    if now is None or bytes(memoryview(now)[:frame.SEALED_HEADER_LEN]) != bytes(
            memoryview(blob)[:frame.SEALED_HEADER_LEN]):
        return "gone"
    tier.put(key, sealed)
    return "resealed"


def _salt(text: str) -> str:
    """A salt given on the command line, or read from standard input for ``-``."""
    if text != "-":
        return text
    salt = sys.stdin.readline().rstrip("\n")
    if not salt:
        raise argparse.ArgumentTypeError("no salt on standard input")
    return salt


def cmd_forget(tiers: list[Tier], args: argparse.Namespace) -> int:
    """Destroy the tenant's secret (its KV can no longer be opened anywhere, Mooncake included), wait for running
    processes to drop the keys they derived, then remove its objects from every tier that can list them, as
    listed after the wait (a process that had not noticed yet may have written more meanwhile)."""
    if (args.salt is None) == (not args.unsalted):
        return refuse("tenant forget: give the tenant's SALT (or - to read it from standard input), or --unsalted for "
                      "the requests without a salt; not both")
    sealer = sealer_for(args, "kvtier tenant forget")
    try:
        audit = open_audit(args)
        keyring = sealer.keyring
        tenant = keyring.tenant_id(None if args.unsalted else args.salt)
        namespaces = keyring.forget(tenant)
        if namespaces is None:
            return _nothing_to_forget(keyring.forgotten_at(tenant), tenant)
        if audit is not None:
            audit.record("forget", tenant=tenant, namespaces=len(namespaces))
        print(f"tenant {tenant}: key destroyed; its KV in {len(namespaces)} namespaces cannot be opened any more")
        wait = 2 * sealer.config.refresh_seconds
        print(f"waiting {wait:.1f} s for running processes to drop its keys and DRAM entries")
        time.sleep(wait)
        unlisted = 0
        fresh = open_tiers(args.store_config)  # listed anew: an index built before the wait misses later writes
        try:
            for tier in fresh:
                if tier.name in {t.name for t in tiers}:
                    unlisted += _remove(tier, namespaces, tenant, audit)
        finally:
            for tier in fresh:
                tier.close()
        if not unlisted:
            keyring.forgotten(tenant)
        return 0
    finally:
        sealer.close()


def _nothing_to_forget(forgotten_at: float | None, tenant: str) -> int:
    """What a forget of a tenant with no secret says: forgotten already (0: done), or never seen (1: a salt
    mistyped, most likely)."""
    if forgotten_at is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(forgotten_at))
        print(f"tenant {tenant}: forgotten already (its last forget ended {when}); nothing to do")
        return 0
    print(f"tenant {tenant}: never seen in this keyring (no secret, no forget); check the salt (--unsalted for "
          "requests without one); nothing to do")
    return 1


def _remove(tier: Tier, namespaces: list[str], tenant: str, audit: AuditLog | None) -> int:
    """Remove the tenant's objects from one tier (as a purge does, recorded as ``forget-remove``); 1 if the tier
    could not list or delete them (they stay, and no key opens them)."""
    try:
        objects = [o for namespace in namespaces for o in tier.list(namespace)]
    except TierError as exc:
        if audit is not None:
            audit.record("forget-remove", tier=tier.name, tenant=tenant, objects=0, bytes=0, failed=True)
        return _cannot(tier, exc)
    try:
        remove_objects(tier, objects, audit, "forget-remove", {"tenant": tenant})
    except TierError as exc:  # recorded as failed part-way by remove_objects
        return _cannot(tier, exc)
    try:
        remove_records(tier, namespaces, audit, "forget-remove", {"tenant": tenant})
    except TierError as exc:  # recorded as failed by remove_records
        print(f"tier {tier.name}: removed the objects, but not every record naming the tenant's namespaces ({exc}); "
              "run the command again to retry")
        return 1
    return 0


def _cannot(tier: Tier, exc: TierError) -> int:
    print(f"tier {tier.name}: cannot remove the objects ({exc}); they stay, and no key opens them; run the command "
          "again to retry")
    return 1


def register(top: Subcommands, cache: Subcommands) -> None:
    """``kvtier keygen`` and ``kvtier tenant forget`` on ``top``, ``kvtier cache rekey`` on ``cache``."""
    keygen = top.add_parser("keygen", help="write a new random 256-bit master key to a new file (mode 0600)")
    keygen.add_argument("file", help="the key file to create (never overwritten)")
    keygen.set_defaults(run=cmd_keygen)
    rekey = cache.add_parser("rekey", help="seal every object under its tenant's current key (after a master key "
                                           "rotation); safe while engines serve")
    rekey.add_argument("--config", required=True, help="store config (YAML) with an encryption section")
    rekey.add_argument("--tier", help="only this tier (by name)")
    rekey.set_defaults(func=cmd_rekey)
    tenant = top.add_parser("tenant", help="per-tenant operations on stored KV")
    tenant.set_defaults(run=on_tiers)
    tenant_sub = tenant.add_subparsers(dest="command", required=True)
    forget = tenant_sub.add_parser("forget", help="destroy a tenant's key (its KV becomes unreadable on every "
                                                  "tier at once), then remove its objects where tiers can list")
    forget.add_argument("salt", type=_salt, nargs="?", help="the tenant's cache_salt, or - to read it from standard "
                                                            "input (keeps it out of the process list and shell "
                                                            "history)")
    forget.add_argument("--unsalted", action="store_true", help="forget the tenant of the requests without a "
                                                                "cache_salt")
    forget.add_argument("--config", required=True, help="store config (YAML) with an encryption section")
    forget.set_defaults(func=cmd_forget, tier=None)
