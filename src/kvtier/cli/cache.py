"""``kvtier cache``: inspect and maintain the stored KV of a configured store's secondary tiers.

    kvtier cache stats  --config FILE [--codecs]
    kvtier cache ls     --config FILE [--namespace NS] [--tier NAME] [--codecs]
    kvtier cache verify --config FILE [--tier NAME] [--repair]
    kvtier cache audit  --config FILE
    kvtier cache purge  --config FILE (--namespace NS | --older-than AGE | --all) [--tier NAME]
    kvtier cache retain --config FILE [--tier NAME]

(``kvtier cache rekey`` is in :mod:`kvtier.cli.encryption`.) Each command runs through
:func:`kvtier.cli._common.on_tiers`: the tiers only, no DRAM pool.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from kvtier import frame
from kvtier.codecs import CodecError
from kvtier.cli._common import on_tiers, open_audit, remove_objects, remove_records, sealer_for
from kvtier.errors import ConfigError, TierError
from kvtier.tiers.base import StoredObject, Tier
from kvtier.units import size_fixed

if TYPE_CHECKING:
    from kvtier.audit import AuditLog
    from kvtier.cli._common import Subcommands
    from kvtier.sealing import Sealer

_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` (a bare number is seconds)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"bad age {text!r}: use a number with s, m, h, d or w (e.g. 7d)")
    return float(match.group(1)) * _AGE_UNITS[match.group(2) or "s"]


def namespace_id(text: str) -> str:
    """A namespace id as ``kvtier cache ls`` prints it: 32 hex digits. Nothing else is accepted: an empty string
    or a glob would widen a purge to every namespace."""
    if not re.fullmatch(r"[0-9a-fA-F]{32}", text):
        raise argparse.ArgumentTypeError(f"expected a namespace id: 32 hex digits, as `kvtier cache ls` prints "
                                         f"them; got {text!r}")
    return text.lower()


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _objects(tier: Tier, namespace: str | None = None) -> list[StoredObject]:
    return list(tier.list(namespace))


def cmd_stats(tiers: list[Tier], args: argparse.Namespace) -> int:
    now = time.time()
    for tier in tiers:
        objs = _objects(tier)
        size = sum(o.size for o in objs)
        namespaces = {o.key.namespace for o in objs}
        cap = getattr(tier.options, "capacity_bytes", None)
        print(f"tier {tier.name} ({type(tier).__name__})")
        print(f"  objects:    {len(objs)}")
        print(f"  bytes:      {size_fixed(size)}"
              + (f" of {size_fixed(cap)} ({100 * size / cap:.1f}%)" if cap else ""))
        print(f"  namespaces: {len(namespaces)}")
        if objs:
            print(f"  oldest:     {_age(now - min(o.created for o in objs))} ago")
            print(f"  last used:  {_age(now - max(o.last_used for o in objs))} ago")
        for event, value in sorted(tier.counters().items()):
            print(f"  {event}: {value:.0f}")
        if args.codecs:
            _print_codecs(tier, objs)
    rules = args.store_config.placement
    if rules:
        print("placement (first match decides; other KV may reach every tier):")
        for rule in rules:
            print(f"  {rule.describe()}")
    return 0


def _codec_of(tier: Tier, o: StoredObject) -> tuple[str, int] | None:
    """(its codec's name, its size before the codec) from an object's header; None when it has none readable."""
    try:
        head = tier.head(o.key, frame.MAX_HEADER_LEN)
        header = None if head is None else frame.decode_header(head)
    except (TierError, frame.FrameError):
        return None
    return None if header is None else (header.codec.name, header.length + header.meta.nbytes)


def _print_codecs(tier: Tier, objs: list[StoredObject]) -> None:
    by: dict[str, list[int]] = {}  # codec -> [objects, stored bytes, bytes before the codec]
    for o in tqdm(objs, desc=f"{tier.name}: headers", unit="obj", disable=not sys.stderr.isatty(), leave=False):
        got = _codec_of(tier, o)
        name, raw = ("unreadable", o.size) if got is None else got
        row = by.setdefault(name, [0, 0, 0])
        row[0] += 1
        row[1] += o.size
        row[2] += raw
    for name, (count, stored, raw) in sorted(by.items()):
        saved = f", {size_fixed(raw - stored)} saved ({1 - stored / raw:.0%})" if raw > stored else ""
        print(f"  codec {name}: {count} objects, {size_fixed(stored)} stored of {size_fixed(raw)}{saved}")


def cmd_ls(tiers: list[Tier], args: argparse.Namespace) -> int:
    now = time.time()
    extra = f" {'codec':<10} {'raw':>10}" if args.codecs else ""
    print(f"{'tier':<12} {'namespace':<32} {'chunk':<32} {'heads':<10} {'size':>10} {'age':>7} {'idle':>7}{extra}")
    for tier in tiers:
        for o in sorted(_objects(tier, args.namespace), key=lambda o: o.created):
            if args.codecs:
                name, raw = _codec_of(tier, o) or ("unreadable", o.size)
                extra = f" {name:<10} {size_fixed(raw):>10}"
            print(f"{tier.name:<12} {o.key.namespace:<32} {o.key.chunk:<32} {o.key.heads!s:<10} "
                  f"{size_fixed(o.size):>10} {_age(now - o.created):>7} {_age(now - o.last_used):>7}{extra}")
    return 0


def cmd_verify(tiers: list[Tier], args: argparse.Namespace) -> int:
    bad_total = 0
    audit = open_audit(args) if args.repair else None
    sealer = None if args.store_config.encryption is None else sealer_for(args, "kvtier cache verify")
    try:
        for tier in tiers:
            bad_total += _verify(tier, args, audit, sealer)
    finally:
        if sealer is not None:
            sealer.close()
    return 1 if bad_total and not args.repair else 0


def _verify(tier: Tier, args: argparse.Namespace, audit: AuditLog | None, sealer: Sealer | None) -> int:
    """Verify one tier's objects (opening sealed ones with ``sealer``); how many are bad."""
    objs = _objects(tier)
    ok = bad = missing = unopened = 0
    repaired: list[int] = []
    for o in tqdm(objs, desc=f"verify {tier.name}", unit="obj", file=sys.stderr, disable=None):
        try:
            blob = tier.get(o.key)
        except TierError as exc:
            print(f"unreadable: {tier.name} {o.key.name}: {exc}")
            bad += 1
            continue
        if blob is None:
            missing += 1  # removed since the listing: not an error
            continue
        try:
            header, payload = frame.decode(blob, expected=o.key, opener=sealer)
            frame.decoded(header, payload)  # (stored with a codec: it must decode to the shard)
            ok += 1
        except (frame.UnknownKey, frame.RefusedCodec):
            # not bad: a key this config lacks (a forgotten tenant's, another engine's newer), or a codec a later
            # release stored
            unopened += 1
        except (frame.FrameError, CodecError) as exc:
            bad += 1
            action = "removed" if args.repair else "bad"
            if args.repair and tier.delete(o.key):
                repaired.append(len(blob))
            print(f"{action}: {tier.name} {o.key.name}: {exc}")
    print(f"tier {tier.name}: {ok} ok, {bad} bad{' (removed)' if args.repair and bad else ''}, "
          f"{missing} gone during the walk" + (f", {unopened} under keys this config lacks or of codecs this "
                                               "release does not know (left)" if unopened else ""))
    if audit is not None and repaired:
        audit.record("repair", tier=tier.name, objects=len(repaired), bytes=sum(repaired))
    return bad


def cmd_purge(tiers: list[Tier], args: argparse.Namespace) -> int:
    now = time.time()
    audit = open_audit(args)
    selector: dict[str, object] = ({"namespace": args.namespace} if args.namespace else
                                   {"older_than_s": args.older_than} if args.older_than is not None else
                                   {"all": True})
    for tier in tiers:
        objs = _objects(tier, args.namespace)
        if args.older_than is not None:
            objs = [o for o in objs if now - o.created > args.older_than]
        remove_objects(tier, objs, audit, "purge", selector)
        if args.namespace:
            remove_records(tier, [args.namespace], audit, "purge", selector)
    return 0


def cmd_retain(tiers: list[Tier], args: argparse.Namespace) -> int:
    """A retention run: each tier's ``ttl_seconds`` applied by listing it (for tiers that do not expire objects
    themselves, such as S3; on the others it removes what their own expiry has not reached yet)."""
    now = time.time()
    audit = open_audit(args)
    for tier in tiers:
        ttl = getattr(tier.options, "ttl_seconds", None)
        if ttl is None:
            print(f"tier {tier.name}: no ttl_seconds; nothing to do")
        elif not tier.listed_times:
            print(f"tier {tier.name}: its listing has no write times; objects past ttl_seconds are refused as they "
                  "are read, and left to the tier's own expiry and eviction")
        else:
            remove_objects(tier, [o for o in _objects(tier) if now - o.created > ttl], audit, "retain",
                           {"ttl_seconds": ttl})
    return 0


def cmd_audit(tiers: list[Tier], args: argparse.Namespace) -> int:
    from kvtier.audit import verify

    path = args.store_config.audit_log
    if path is None:
        raise ConfigError("audit_log: not set in this config; nothing to check")
    verdict = verify(path)
    for note in verdict.notes:
        print(f"audit log {path}: note: {note}")
    if verdict.broken is not None:
        print(f"audit log {path}: BROKEN after {verdict.records} records: {verdict.broken}")
        return 1
    print(f"audit log {path}: " + (f"{verdict.records} records, chain intact" if verdict.records else
                                   "no records yet"))
    return 0


def register(top: Subcommands) -> Subcommands:
    """Add ``kvtier cache`` and its commands to ``top``; its own subcommands, for the groups that add more."""
    cache = top.add_parser("cache", help="inspect and maintain stored KV")
    cache.set_defaults(run=on_tiers)
    sub = cache.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", required=True, help="store config (YAML)")
        p.add_argument("--tier", help="only this tier (by name)")
        return p

    codecs_help = ("read each object's header for its codec and its size before the codec (a read of every object: "
                   "slow on a large remote tier)")
    stats = add("stats", "objects, bytes and namespaces per tier")
    stats.add_argument("--codecs", action="store_true", help=f"{codecs_help}; objects and bytes saved per codec")
    stats.set_defaults(func=cmd_stats)
    ls = add("ls", "list stored chunks (namespace, chunk key, heads, size, age; never tokens)")
    ls.add_argument("--namespace", type=namespace_id, metavar="ID", help="only this namespace id (32 hex digits)")
    ls.add_argument("--codecs", action="store_true", help=codecs_help)
    ls.set_defaults(func=cmd_ls)
    verify = add("verify", "read every object and check its checksum; exit 1 if any is bad")
    verify.add_argument("--repair", action="store_true", help="remove bad objects (then exit 0)")
    verify.set_defaults(func=cmd_verify)
    add("audit", "check the audit log's chain (audit_log in the config): exit 1 if a record was edited, removed "
                 "or inserted").set_defaults(func=cmd_audit)
    purge = add("purge", "remove stored chunks")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", type=namespace_id, metavar="ID",
                       help="every chunk of this namespace id (32 hex digits)")
    which.add_argument("--older-than", type=parse_age, metavar="AGE", help="chunks written more than AGE ago")
    which.add_argument("--all", action="store_true", help="everything")
    purge.set_defaults(func=cmd_purge)
    add("retain", "a retention run: remove what is older than each tier's ttl_seconds (S3 has no expiry of its own; "
                  "run it from cron), recorded in the audit log").set_defaults(func=cmd_retain)
    return sub
