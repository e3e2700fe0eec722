"""Per-tenant shares (quotas) of a tier that counts nothing itself but can be listed: S3 (a bucket) and Mooncake
Store (its master's key list). Each engine keeps a view of every share it writes to: the share's objects with
their sizes and last use, listed from the tier and kept up to date between listings by the engine's own writes,
reads and deletes.

    <prefix>shares/<id>/<namespace>   a small object: <namespace> counts against the share <id>

``<id>`` is a digest of the store's share name (:func:`kvtier.quotas.share_id`, as in Redis), which
holds the tenant's salt: a salt is never written to the tier (the share does group a tenant's namespaces). An
engine writes the object for each namespace it counts (again when a listing misses it: a lifecycle rule or the
store's own eviction may have removed it), so every engine's view finds every engine's namespaces.

A view is listed again (the share's members, then each member namespace's objects: sizes, and on S3 write times,
its namespaces listed in parallel) when it is older than the tier's ``share_refresh_seconds``; a listing that
fails leaves the view as it was (counted as ``share_view_failures``) until the next one is due, as does a share
object that cannot be written.
A put is counted in the view before it is written; a listing keeps it while it is under way and once it has
landed, whatever the listing found, and never counts again an object chosen for deletion whose delete has not
ended. The rules are :mod:`kvtier.quotas`'s: a new object that the objects used in the last
``RECENT_SECONDS`` leave no room for is refused (:class:`~kvtier.errors.QuotaFull`); otherwise, while the share
is over its quota, the writing engine deletes its least recently used objects (none of those recent ones, none
being written) once its own write has succeeded, whichever engine wrote them. A view no put or read used for
10 minutes is dropped, and listed anew when it is needed again.

Times. S3 lists write times to the second, by the server's clock (``times=True``): a listed time is moved onto
this engine's clock by the offset between the two (the listing's ``Date``, itself to the second, against this
engine's clock when the answer came), and counts as the end of its second: an object never looks older than it
is, and at most 2 s (plus the listing's round trip) younger, this engine's own writes included (the listing
cannot tell them from another engine's write of the same object just after). Mooncake lists no times
(``times=False``): an object this engine neither wrote nor read since its view was made counts as used when the
view first listed it, so after a view's first listing its whole share counts as recent for ``RECENT_SECONDS``,
and another engine's objects age from when this engine first saw them.

Limits, from the tier keeping no count and no read times:
- An object's last use is this engine's last write or read of it, or its write time as listed (first listing,
  for Mooncake), whichever is later: another engine's reads do not count, so it may evict an object only that
  engine reads.
- Between listings an engine does not see the others' writes or deletes, so a share can hold more than its
  quota by what other engines wrote in the last ``share_refresh_seconds``; two engines may evict the same object
  (both count it in ``share_evictions``). With ``share_refresh_seconds: 0`` every put lists the share first.
- A listing costs, on S3, a LIST call per namespace of the share and per 1,000 of its objects; on Mooncake one
  key list of the whole store from the master and a size query per object of the share; each
  ``share_refresh_seconds`` per engine writing to the share, which waits for it meanwhile.
- Without times, an object this engine knew that the store evicted by itself and another engine wrote again
  between two of its listings keeps its old time: it may be evicted first though it was just written.
- A namespace's ``shares/`` objects are deleted when it is purged or forgotten (``Tier.remove_records``); an
  engine still writing to it records it again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Protocol

from kvtier import quotas
from kvtier.errors import QuotaFull, TierError
from kvtier.health import FirstOfKind
from kvtier.keys import ShardKey
from kvtier.quotas import Share, refuses, share_id, victims
from kvtier.recent import RecentMap

log = logging.getLogger(__name__)

_KEPT = 65536  # namespaces whose share is remembered (the store tells the tier again when it meets one anew)
_IDLE_SECONDS = 600.0  # a view no put or read used this long is dropped (listed anew when it is needed again)
_SWEEP_EVERY = 60.0  # seconds between looks for such views
_HEX32 = re.compile(r"[0-9a-f]{32}")
_LISTED_SLACK = 1.0  # a listed write time (to the second) counts as the end of its second


class Listed(Protocol):
    """What a tier's listing tells of one object (a :class:`kvtier.tiers.base.StoredObject`)."""

    @property
    def key(self) -> ShardKey: ...
    @property
    def size(self) -> int: ...
    @property
    def created(self) -> float: ...


@dataclasses.dataclass
class _Object:
    size: int
    used: float  # this engine's time.time(): the write time from the listing, or this engine's last write or read


@dataclasses.dataclass
class _View:
    objects: dict[ShardKey, _Object] = dataclasses.field(default_factory=dict)
    writing: dict[ShardKey, int] = dataclasses.field(default_factory=dict)  # counted puts under way: how many
    evicting: set[ShardKey] = dataclasses.field(default_factory=set)  # chosen for deletion, not deleted yet
    listed: float = -math.inf  # time.monotonic() when the last listing (or failed one) ended
    listed_from: float = -math.inf  # ... and when it started
    touched: float = dataclasses.field(default_factory=time.monotonic)  # the last put or read that used it
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # everything above
    listing: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # one listing at a time


@dataclasses.dataclass(frozen=True)
class Counted:
    """What :meth:`ListedShares.account` decided for a write: refused, or go ahead (``entry`` counted for it, in place
    of ``before``), then delete ``victims``."""

    view: _View
    refused: bool
    entry: _Object | None = None
    before: _Object | None = None
    victims: dict[ShardKey, _Object] = dataclasses.field(default_factory=dict)


# share id -> its namespaces, and the server's clock minus this engine's (from the listing's Date; None: unknown)
Members = Callable[[str], tuple[list[str], float | None]]


class ListedShares:
    """The share accounting of one tier. ``members(id)`` lists the namespaces recorded for a share,
    ``objects(namespace)`` a namespace's objects, ``record(id, namespace)`` writes a namespace's share object,
    each raising :class:`~kvtier.errors.TierError`; ``map_`` runs a listing over several namespaces at once;
    ``times``: whether listed objects carry their write times; ``record_every``: seconds after which this process
    writes a namespace's share object again (a store that evicts objects by itself evicts it too)."""

    def __init__(self, members: Members, objects: Callable[[str], Iterable[Listed]],
                 record: Callable[[str, str], None], refresh_seconds: float, *, times: bool = True,
                 record_every: float = math.inf,
                 map_: Callable[[Callable[[str], list[Listed]], list[str]], Iterator[list[Listed]]] = map,
                 ) -> None:
        self._members = members
        self._objects = objects
        self._record = record
        self._refresh = refresh_seconds
        self._times = times
        self._record_every = record_every
        self._map = map_
        self._lock = threading.Lock()  # the maps below and the counters
        # namespace -> its share (by id); the least recently told are forgotten (the store tells them again)
        self._share_of: RecentMap[str, Share] = RecentMap(_KEPT, lambda _, old: self._release_locked(old))
        self._count: dict[str, int] = {}  # share id -> its namespaces in _share_of; its view goes with the last
        self._views: dict[str, _View] = {}
        self._recorded: RecentMap[str, float] = RecentMap(_KEPT)  # namespace -> when this process last wrote
        # its share object (one forgotten is written again at its next put: the same small object)
        self._swept = time.monotonic()
        self._logged = FirstOfKind()  # the first failed view is a warning, the rest debug lines
        self.evictions = 0  # deletions of objects this engine chose (another engine may delete one too)
        self.refused = 0
        self.view_failures = 0  # listings and share records that failed

    # -- which namespaces count against which share ------------------------------------------------------------
    def set(self, namespace: str, share: str | None, quota_bytes: int) -> None:
        sid = None if share is None else share_id(share)
        with self._lock:
            if sid is not None and self._share_of.get(namespace) == Share(sid, quota_bytes):
                self._share_of.touch(namespace)  # told again: its view stays as it is
                return
            old = self._share_of.pop(namespace)
            if old is not None:
                self._release_locked(old)
            if sid is None:
                return
            self._count[sid] = self._count.get(sid, 0) + 1  # (first: a namespace forgotten next keeps the view)
            self._share_of[namespace] = Share(sid, quota_bytes)

    def _release_locked(self, old: Share) -> None:
        """A namespace no longer counts against ``old`` here."""
        left = self._count[old.name] - 1
        if left:
            self._count[old.name] = left
        else:  # no namespace counts against it here any more: the view (all its objects) goes
            del self._count[old.name]
            self._views.pop(old.name, None)

    def _found(self, namespace: str) -> tuple[str, int, _View] | None:
        with self._lock:
            found = self._share_of.get(namespace)
            if found is None:
                return None
            view = self._views.setdefault(found[0], _View())
            view.touched = time.monotonic()  # here, under the lock the sweep takes: never swept while in use
            return (*found, view)

    def _sweep(self) -> None:
        """Drop views no put or read used for :data:`_IDLE_SECONDS` (each holds its share's whole listing)."""
        now = time.monotonic()
        with self._lock:
            if now - self._swept < _SWEEP_EVERY:
                return
            self._swept = now
            idle = [sid for sid, view in self._views.items()
                    if now - view.touched > _IDLE_SECONDS and not view.writing and not view.evicting]
            for sid in idle:
                del self._views[sid]

    # -- listings ----------------------------------------------------------------------------------------------
    def _refresh_if_due(self, sid: str, view: _View) -> None:
        arrived = time.monotonic()
        if arrived - view.listed < self._refresh:
            return
        with view.listing:
            if view.listed_from >= arrived or time.monotonic() - view.listed < self._refresh:
                return  # listed by another thread meanwhile, from after this one asked
            began = time.monotonic()
            try:
                self._list(sid, view)
            except TierError as exc:  # the view as it was, until the next listing is due: writes go on
                self._failed("listing a share", exc)
            view.listed_from, view.listed = began, time.monotonic()

    def _record_member(self, sid: str, namespace: str) -> None:
        try:
            self._record(sid, namespace)
        except TierError as exc:  # tried again at the next put; the write goes on
            self._failed("recording a namespace in its share", exc)
            return
        with self._lock:
            self._recorded[namespace] = time.monotonic()

    def _failed(self, what: str, exc: TierError) -> None:
        with self._lock:
            self.view_failures += 1
        first = self._logged.first("view")
        log.log(logging.WARNING if first else logging.DEBUG, "%s failed (the share is counted from this engine's "
                "view as it is; further failures are counted as share_view_failures): %s", what, exc)

    def _list(self, sid: str, view: _View) -> None:
        started = time.time()
        members, offset = self._members(sid)
        offset = offset or 0.0  # the server's clock minus ours
        listed_ns = {ns for ns in members if _HEX32.fullmatch(ns)}
        with self._lock:
            mine = [ns for ns, share in self._share_of.items() if share.name == sid]
        for ns in mine:
            if ns not in listed_ns and ns in self._recorded:
                self._record_member(sid, ns)  # its share object is gone (a lifecycle rule, an eviction): again
        listed: dict[ShardKey, _Object] = {}
        for objects in self._map(lambda ns: list(self._objects(ns)), sorted(listed_ns.union(mine))):
            for obj in objects:  # (without times: first listed now, unless the view knew it)
                listed[obj.key] = _Object(obj.size, obj.created - offset + _LISTED_SLACK if self._times else started)
        with view.lock:
            for key in view.evicting:
                listed.pop(key, None)  # chosen for deletion already: not counted, not chosen twice
            for key, found in listed.items():
                known = view.objects.get(key)
                if known is not None:  # this engine's writes and reads count; without times, they are all it has
                    found.used = max(found.used, known.used) if self._times else known.used
            for key, known in view.objects.items():
                if key not in listed and (key in view.writing or known.used >= started):
                    listed[key] = known  # under way, or landed (or read) while the listing ran
            view.objects = listed

    # -- a put -------------------------------------------------------------------------------------------------
    def write(self, tier: str, key: ShardKey, size: int, write: Callable[[], None],
              delete: Callable[[ShardKey], bool]) -> None:
        """A tier's put of ``key`` (``write()``, ``size`` bytes), counted against its namespace's share:
        :class:`~kvtier.errors.QuotaFull` when the share is full of recent objects; once it is written, the
        share's victims deleted (``delete(victim)``: whether it is gone)."""
        counted = self.account(key, size)  # before: a concurrent put sees it
        if counted is None:
            write()
            return
        if counted.refused:
            raise QuotaFull(f"{tier}: not writing {key.name}: its tenant's share is full of objects used in the "
                            f"last {quotas.RECENT_SECONDS:g} s")
        written = False
        try:
            write()
            written = True
        finally:
            victims = self.done(key, counted, written)  # none when the write failed: nothing to make room for
        deleted = []
        try:
            for victim in victims:
                if not self._still_victim(counted.view, victim):
                    continue  # put again since it was chosen: deleting it would take the new object
                try:
                    if delete(victim):
                        deleted.append(victim)
                except Exception as exc:  # noqa: BLE001 - this put's own write succeeded; the victim is counted again
                    log.debug("%s: evicting %s from its share failed: %s", tier, victim.name, exc)
        finally:
            self.evicted(counted, deleted)

    @staticmethod
    def _still_victim(view: _View, victim: ShardKey) -> bool:
        with view.lock:
            return victim not in view.writing and victim not in view.objects

    def account(self, key: ShardKey, size: int) -> Counted | None:
        """Count an object about to be written; None when its namespace has no share here. Unless refused, the
        caller ends with :meth:`done`, then :meth:`evicted`, whatever happens."""
        self._sweep()  # first: never the view this put is about to use
        found = self._found(key.namespace)
        if found is None:
            return None
        sid, quota, view = found
        if time.monotonic() - self._recorded.get(key.namespace, -math.inf) >= self._record_every:  # (never yet: inf)
            self._record_member(sid, key.namespace)
        self._refresh_if_due(sid, view)
        now = time.time()
        since = now - quotas.RECENT_SECONDS
        with view.lock:
            objects = view.objects
            before = objects.get(key)
            if before is None and refuses(size, quota, (o.size for o in objects.values() if o.used >= since)):
                with self._lock:
                    self.refused += 1
                return Counted(view, True)
            entry = objects[key] = _Object(size, now)
            view.writing[key] = view.writing.get(key, 0) + 1
            chosen, _ = victims(sorted(objects, key=lambda k: objects[k].used),
                                sum(o.size for o in objects.values()) - quota, lambda k: objects[k].size,
                                lambda k: objects[k].used < since and k not in view.writing)
            out = {victim: objects.pop(victim) for victim in chosen}
            view.evicting.update(out)
        return Counted(view, False, entry, before, out)

    def done(self, key: ShardKey, counted: Counted, written: bool) -> list[ShardKey]:
        """The write :meth:`account` counted has ended: the victims to delete now (none when it failed: they are
        counted again, and the key as it was before, unless another put of it counted since)."""
        view = counted.view
        with view.lock:
            left = view.writing.get(key, 0) - 1
            if left > 0:
                view.writing[key] = left
            else:
                view.writing.pop(key, None)
            if written:
                assert counted.entry is not None
                counted.entry.used = time.time()  # landed now: a listing that began before keeps it
                view.objects.setdefault(key, counted.entry)
                return list(counted.victims)
            for victim, obj in counted.victims.items():
                view.evicting.discard(victim)
                view.objects.setdefault(victim, obj)
            if view.objects.get(key) is counted.entry:
                if counted.before is None:
                    del view.objects[key]
                else:
                    view.objects[key] = counted.before
        return []

    def evicted(self, counted: Counted, deleted: Collection[ShardKey]) -> None:
        """The victims :meth:`done` gave were deleted, those in ``deleted`` (the others failed: counted again as
        they were, to be chosen again)."""
        view = counted.view
        with view.lock:
            view.evicting.difference_update(counted.victims)
            for victim, obj in counted.victims.items():
                if victim not in deleted:
                    view.objects.setdefault(victim, obj)
        with self._lock:
            self.evictions += len(deleted)

    # -- reads and deletes -------------------------------------------------------------------------------------
    def used(self, key: ShardKey) -> None:
        """A read hit ``key``: it moves to its share's recent end (in this engine's view)."""
        found = self._found(key.namespace)
        if found is not None:
            view = found[2]
            with view.lock:
                obj = view.objects.get(key)
                if obj is not None:
                    obj.used = max(obj.used, time.time())

    def removed(self, key: ShardKey) -> None:
        found = self._found(key.namespace)
        if found is not None:
            with found[2].lock:
                found[2].objects.pop(key, None)

    def bytes(self, share: str) -> int:
        """Bytes of ``share``'s objects, as this engine's view has them (listed again when it is due); 0 for a
        share no namespace counts against here."""
        sid = share_id(share)
        with self._lock:
            view = self._views.setdefault(sid, _View()) if sid in self._count else None
        if view is None:
            return 0
        self._refresh_if_due(sid, view)
        with view.lock:
            return sum(o.size for o in view.objects.values())
