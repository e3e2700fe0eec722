"""Placement rules: which secondary tiers a tenant's (or a namespace's) KV may reach.

A policy, not a transfer: the store asks :meth:`Placement.tiers_for` before it queues a put's chunks, or a
promoted chunk, for the secondary tiers, and queues them only for the tiers allowed. DRAM is always allowed (the
engine loads through it); a rule with ``tiers: []`` keeps that KV in DRAM only.

    placement:
      - salt: "bank-*"          # cache_salt glob (fnmatch, case-sensitive): these tenants' KV stays in DRAM
        tiers: []
      - salt: "internal-*"      # local disk, never a shared tier
        tiers: [disk]
      - namespace: 0123456789abcdef0123456789abcdef   # one namespace id (kvtier cache ls shows them)
        tiers: [disk, redis]

      - salt: "team-a"          # one share of DRAM and of the disk for all the KV this rule matches: past it, its
        tiers: [disk]           # own least recently used chunks are evicted first (an isolated LRU), never another's
        quota: {dram: 2GiB, disk: 50GiB}

      - tiers: [disk]           # last, with neither: the default for all other KV (unsalted requests too)

Reads follow the same rules: a lookup or a get asks only the tiers the namespace's KV may reach, so a tenant kept
in DRAM sends none of its keys to any tier, and one placed on the disk none to a shared one. KV that an earlier
placement left in a tier the rules now withhold is not looked for there: it is served no more, and goes with the
tier's eviction or TTL, ``kvtier cache purge --namespace``, or the tenant's ``forget`` (the commands list every
tier, whatever the rules).

Rules are tried in order; the first that matches decides. KV no rule matches may reach every tier. A salt comes
from the client: a request without one (or with another) is placed by the default. Salts are matched as globs
(``*``, ``?``, ``[...]``; write ``[[]`` for a literal ``[``). A ``quota`` is per rule: every salt and namespace
the rule matches counts against one share of that size in each tier named (a glob's salts together: a client
picks its salts, so a share per salt would cap nothing; give each tenant a rule of its own): DRAM, filesystem
tiers (counted from the directory, over every process's writes), Redis tiers (counted in the server, over every
engine's writes), S3 and Mooncake tiers (each engine counts from listings of the bucket or of the master's keys).
A share is named by what its rule matches (a digest of the salt glob and namespace id: :attr:`PlacementRule.share`),
not by the rule's position or quota: rules inserted above it, reordered or given another quota keep every share's
KV in its own share (the tiers' ledgers outlive the config), and two rules that match alike are one share.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvtier._config_values import parse_size, unknown_key
from kvtier.errors import ConfigError
from kvtier.recent import RecentMap
from kvtier.units import size_label

if TYPE_CHECKING:
    from kvtier.keys import Namespace

_KEPT = 4096  # namespaces whose decision is remembered (one per tenant salt, model and settings)


@dataclasses.dataclass(frozen=True)
class PlacementRule:
    tiers: tuple[str, ...] = dataclasses.field(metadata={
        "help": "the secondary tiers the rule's KV may reach, by name (empty: DRAM only)"})
    salt: str | None = dataclasses.field(default=None, metadata={
        "help": "a glob on the request's cache_salt (a request without a salt never matches)"})
    namespace: str | None = dataclasses.field(default=None, metadata={
        "help": "a namespace id (32 hex digits); only the last rule may give neither salt nor namespace"})
    # (tier, bytes) all the KV it matches may hold there together
    quota: tuple[tuple[str, int], ...] = dataclasses.field(default=(), metadata={
        "yaml": "mapping of tier name to byte size",
        "help": "one share for all the rule matches, per tier ({dram: 2GiB, disk: 50GiB}): past it, its own least "
                "recently used chunks go first"})

    def matches(self, ns: Namespace) -> bool:
        if self.namespace is not None and ns.id != self.namespace:
            return False
        return self.salt is None or (ns.cache_salt is not None and fnmatch.fnmatchcase(ns.cache_salt, self.salt))

    @property
    def share(self) -> str:
        """The name of the rule's share: a digest of what it matches (never its position or its quota)."""
        selector = f"salt={self.salt!r} namespace={self.namespace!r}".encode("utf-8", "surrogatepass")
        return "rule-" + hashlib.blake2b(selector, digest_size=8).hexdigest()

    def describe(self) -> str:
        who = " and ".join(part for part in (f"salt {self.salt!r}" if self.salt is not None else "",
                                             f"namespace {self.namespace}" if self.namespace else "") if part)
        who = who or "all other KV"
        shares = ", ".join(f"{size_label(n, digits=None)} in {t}" for t, n in self.quota)
        quota = f"; together at most {shares} (share {self.share})" if self.quota else ""
        return f"{who}: {', '.join(('dram',) + self.tiers)}{quota}"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the rules say of one namespace: the secondary tiers it may reach (None: all), and its tenant's share
    (an id, and bytes per tier) where its rule sets a quota."""

    allowed: frozenset[str] | None
    share: str | None = None
    quota: tuple[tuple[str, int], ...] = ()

    def admits(self, tier: str) -> bool:
        """Whether the namespace's KV may be in secondary tier ``tier``: written there, so looked up and read there
        (and nowhere else: see the module's docstring)."""
        return self.allowed is None or tier in self.allowed


def parse_placement(raw: object, tier_names: Sequence[str]) -> tuple[PlacementRule, ...]:
    """Validate the ``placement`` list of a store config (errors name the field) against its tiers' names."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"placement: expected a list of rules (salt or namespace, and tiers), got "
                          f"{type(raw).__name__}")
    rules = []
    for i, item in enumerate(raw):
        field = f"placement[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{field}: expected a mapping with 'tiers' and 'salt' or 'namespace'")
        unknown = sorted(map(str, set(item) - {"salt", "namespace", "tiers", "quota"}))
        if unknown:
            raise ConfigError(unknown_key(field, unknown[0], ("namespace", "quota", "salt", "tiers")))
        salt, namespace = item.get("salt"), item.get("namespace")
        if salt is None and namespace is None and i != len(raw) - 1:
            raise ConfigError(f"{field}: give 'salt' (a cache_salt glob) or 'namespace' (an id); only the last rule "
                              "may give neither (the default, for all other KV, unsalted requests included)")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ConfigError(f"{field}.salt: a non-empty cache_salt glob such as 'tenant-*', got {salt!r}")
        if namespace is not None and (not isinstance(namespace, str) or not re.fullmatch(r"[0-9a-f]{32}", namespace)):
            raise ConfigError(f"{field}.namespace: a namespace id (32 lowercase hex digits), got {namespace!r}")
        tiers = item.get("tiers")
        if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
            raise ConfigError(f"{field}.tiers: required, a list of tier names (empty: DRAM only), got {tiers!r}")
        for name in tiers:
            if name != "dram" and name not in tier_names:
                raise ConfigError(f"{field}.tiers: no tier is named {name!r}; the tiers are "
                                  f"{', '.join(['dram', *tier_names])}")
        allowed = tuple(t for t in dict.fromkeys(tiers) if t != "dram")
        rules.append(PlacementRule(allowed, salt, namespace, _parse_quota(item.get("quota"), allowed, field)))
    return tuple(rules)


def _parse_quota(raw: object, allowed: tuple[str, ...], field: str) -> tuple[tuple[str, int], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"{field}.quota: a mapping of tier name to bytes per tenant, e.g. {{dram: 1GiB, disk: "
                          f"20GiB}}, got {raw!r}")
    quota = []
    for name, size in raw.items():
        if name != "dram" and name not in allowed:
            raise ConfigError(f"{field}.quota.{name}: not a tier this rule allows; a quota may name dram or "
                              f"{', '.join(allowed) or '(no other tier here)'}")
        quota.append((name, parse_size(size, f"{field}.quota.{name}")))
        if quota[-1][1] < 1:
            raise ConfigError(f"{field}.quota.{name}: must be at least 1 byte, got {size!r}")
    return tuple(quota)


class Placement:
    """The rules of one store, with each namespace's decision remembered (a rule is matched once per tenant)."""

    def __init__(self, rules: Sequence[PlacementRule]) -> None:
        self.rules = tuple(rules)
        self._decided: RecentMap[str, Decision] = RecentMap(_KEPT)
        self._lock = threading.Lock()

    def tiers_for(self, ns: Namespace) -> frozenset[str] | None:
        """The secondary tiers ``ns``'s KV may reach; None for every tier (no rule matches)."""
        return self.decide(ns).allowed

    def decide(self, ns: Namespace) -> Decision:
        if not self.rules:
            return _ANYWHERE
        with self._lock:
            known = self._decided.get(ns.id)
            if known is not None:
                self._decided.touch(ns.id)
                return known
        rule = next((r for r in self.rules if r.matches(ns)), None)
        if rule is None:
            decision = _ANYWHERE
        elif not rule.quota:
            decision = Decision(frozenset(rule.tiers))
        else:  # one share per rule, however many salts match it: clients choose salts, so a share per salt
            decision = Decision(frozenset(rule.tiers), rule.share, rule.quota)  # would be no cap at all
        with self._lock:
            self._decided[ns.id] = decision
        return decision


_ANYWHERE = Decision(None)
