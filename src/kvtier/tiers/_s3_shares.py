"""Per-tenant shares (quotas) of an S3 tier, kept from listings of the bucket. S3 counts nothing for us, so each
engine keeps a view of every share it writes to: the share's objects with their sizes and last use, listed from
the bucket and kept up to date between listings by the engine's own writes, reads and deletes.

    <prefix>shares/<id>/<namespace>   an empty object: <namespace> counts against the share <id>

``<id>`` is a digest of the store's share name (as in Redis, :func:`kvtier.tiers._redis_shares.share_id`), which
holds the tenant's salt: a salt is never written to the bucket (the share does group a tenant's namespaces). An
engine writes the object for each namespace it counts (again when a listing misses it: a lifecycle rule may
have expired it), so every engine's view finds every engine's namespaces.

A view is listed again (the share's members, then each member namespace's objects, in parallel: sizes and write
times) when it is older than the tier's ``share_refresh_seconds``; a listing that fails leaves the view as it was
(counted, logged) until the next one is due, as does a share object that cannot be written. A put is counted in the view before it is written, and stays
counted while it is under way whatever a listing finds. The rules are :mod:`kvtier.tiers._shares`'s: a new
object that the objects used in the last ``RECENT_SECONDS`` leave no room for is refused
(:class:`~kvtier.errors.QuotaFull`); otherwise, while the share is over its quota, the writing engine deletes its
least recently used objects (none of those recent ones) once its own write has succeeded, whichever engine wrote
them.

Times: S3 lists write times to the second, by the server's clock. A listed time is moved onto this engine's clock
by the offset between the two (from the listing's ``Date``, itself to the second), and counts as the end of its
second: an object never looks older than it is, and at most 2 s younger (this engine's own writes included: the
listing cannot tell them from another engine's write of the same object just after).

Limits, from S3 keeping no count and no read times:
- An object's last use is its write time or this engine's last write or read of it, whichever is later: another
  engine's reads do not count, so it may evict an object only that engine reads.
- Between listings an engine does not see the others' writes or deletes, so a share can hold more than its
  quota by what other engines wrote in the last ``share_refresh_seconds``; two engines may evict the same object
  (the second delete is a no-op). With ``share_refresh_seconds: 0`` every put lists the share first.
- A listing costs a LIST call per 1,000 objects of the share, each ``share_refresh_seconds`` per engine writing
  to it; while it runs, that share's writes wait.
- The ``shares/`` objects stay after the tenant's objects are purged or forgotten.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from kvtier.errors import TierError
from kvtier.keys import ShardKey
from kvtier.tiers import _shares as tenant_shares
from kvtier.tiers._redis_shares import share_id
from kvtier.tiers.base import StoredObject

log = logging.getLogger(__name__)

_KEPT = 65536  # namespaces whose share is remembered (the store tells the tier again when it meets one anew)
_HEX32 = re.compile(r"[0-9a-f]{32}")
_LISTED_SLACK = 1.0  # a listed write time (to the second) counts as the end of its second


@dataclasses.dataclass
class _Object:
    size: int
    used: float  # this engine's time.time(): the write time from the listing, or this engine's last write or read


@dataclasses.dataclass
class _View:
    objects: dict[ShardKey, _Object] = dataclasses.field(default_factory=dict)
    writing: dict[ShardKey, int] = dataclasses.field(default_factory=dict)  # counted puts under way: how many
    listed: float = -float("inf")  # time.monotonic() of the last listing (or failed one)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # objects, writing
    listing: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # one listing at a time


@dataclasses.dataclass(frozen=True)
class Counted:
    """What :meth:`S3Shares.account` decided for a write: refused, or go ahead, then delete ``victims``."""

    sid: str
    refused: bool
    victims: dict[ShardKey, _Object]
    before: _Object | None  # what the view held for the key (a write again), to restore if the write fails


Members = Callable[[str], tuple[list[str], float | None]]  # share id -> its namespaces, the server's time then


class S3Shares:
    """The share accounting of one S3 tier. ``members(id)`` lists the namespaces recorded for a share (with the
    server's time from the listing's ``Date``, None without one), ``objects(namespace)`` a namespace's objects,
    ``record(id, namespace)`` writes a namespace's share object, each raising :class:`~kvtier.errors.TierError`;
    ``map`` runs a function over several namespaces (the tier's listing threads)."""

    def __init__(self, members: Members, objects: Callable[[str], Iterable[StoredObject]],
                 record: Callable[[str, str], None], refresh_seconds: float,
                 map_: Callable[[Callable[[str], list[StoredObject]], list[str]], Iterator[list[StoredObject]]] = map,
                 ) -> None:
        self._members = members
        self._objects = objects
        self._record = record
        self._refresh = refresh_seconds
        self._map = map_
        self._lock = threading.Lock()  # the maps below
        self._share_of: OrderedDict[str, tuple[str, int]] = OrderedDict()  # namespace -> (share id, quota)
        self._count: dict[str, int] = {}  # share id -> its namespaces in _share_of; its view goes with the last
        self._views: dict[str, _View] = {}
        self._recorded: set[str] = set()  # namespaces whose share object this process has written
        self.evictions = 0
        self.refused = 0
        self.view_failures = 0  # listings and share records that failed

    # -- which namespaces count against which share ------------------------------------------------------------
    def set(self, namespace: str, share: str | None, quota_bytes: int) -> None:
        with self._lock:
            self._unset_locked(namespace)
            if share is None:
                return
            sid = share_id(share)
            self._share_of[namespace] = (sid, quota_bytes)
            self._count[sid] = self._count.get(sid, 0) + 1
            self._views.setdefault(sid, _View())
            while len(self._share_of) > _KEPT:
                self._unset_locked(next(iter(self._share_of)))

    def _unset_locked(self, namespace: str) -> None:
        old = self._share_of.pop(namespace, None)
        if old is None:
            return
        left = self._count[old[0]] - 1
        if left:
            self._count[old[0]] = left
        else:  # no namespace counts against it here any more: the view (all its objects) goes
            del self._count[old[0]], self._views[old[0]]

    def _found(self, namespace: str) -> tuple[str, int, _View] | None:
        with self._lock:
            found = self._share_of.get(namespace)
            return None if found is None else (*found, self._views[found[0]])

    # -- listings ----------------------------------------------------------------------------------------------
    def _refresh_if_due(self, sid: str, view: _View) -> None:
        if time.monotonic() - view.listed < self._refresh:
            return
        with view.listing:
            if time.monotonic() - view.listed < self._refresh:
                return  # listed by another thread meanwhile
            try:
                self._list(sid, view)
            except TierError as exc:  # the view as it was, until the next listing is due: writes go on
                self._failed("listing a share", exc)
            view.listed = time.monotonic()

    def _failed(self, what: str, exc: TierError) -> None:
        with self._lock:
            self.view_failures += 1
        log.warning("%s failed (the share is counted from this engine's view as it is): %s", what, exc)

    def _list(self, sid: str, view: _View) -> None:
        started = time.time()
        members, server_now = self._members(sid)
        offset = 0.0 if server_now is None else server_now - time.time()  # server's clock minus ours
        listed_ns = {ns for ns in members if _HEX32.fullmatch(ns)}
        with self._lock:
            mine = [ns for ns, (s, _) in self._share_of.items() if s == sid]
        for ns in mine:
            if ns not in listed_ns and ns in self._recorded:
                try:
                    self._record(sid, ns)  # its share object is gone (a lifecycle rule, a purge by hand): again
                except TierError as exc:
                    self._failed("recording a namespace in its share", exc)
        namespaces = sorted(listed_ns.union(mine))
        listed: dict[ShardKey, _Object] = {}
        for objects in self._map(lambda ns: list(self._objects(ns)), namespaces):
            for obj in objects:
                listed[obj.key] = _Object(obj.size, obj.created - offset + _LISTED_SLACK)
        with view.lock:
            for key, found in listed.items():
                known = view.objects.get(key)
                if known is not None:
                    found.used = max(found.used, known.used)  # this engine's reads count
            for key in view.writing:
                if key not in listed and key in view.objects:
                    listed[key] = view.objects[key]  # under way: its write may land after the listing
            for key, known in view.objects.items():
                if key not in listed and known.used >= started:
                    listed[key] = known  # counted (or written) by this engine while the listing ran
            view.objects = listed

    # -- a put -------------------------------------------------------------------------------------------------
    def account(self, key: ShardKey, size: int) -> Counted | None:
        """Count an object about to be written; None when its namespace has no share here. The caller ends
        with :meth:`done` whatever happens."""
        found = self._found(key.namespace)
        if found is None:
            return None
        sid, quota, view = found
        if key.namespace not in self._recorded:
            try:
                self._record(sid, key.namespace)
            except TierError as exc:  # tried again at the next put; the write goes on
                self._failed("recording a namespace in its share", exc)
            else:
                with self._lock:
                    if len(self._recorded) >= _KEPT:
                        self._recorded.clear()  # written again as they come: the same empty object
                    self._recorded.add(key.namespace)
        self._refresh_if_due(sid, view)
        now = time.time()
        since = now - tenant_shares.RECENT_SECONDS
        with view.lock:
            objects = view.objects
            before = objects.get(key)
            if before is None and size + sum(o.size for o in objects.values() if o.used >= since) > quota:
                with self._lock:
                    self.refused += 1
                return Counted(sid, True, {}, None)
            objects[key] = _Object(size, now)
            view.writing[key] = view.writing.get(key, 0) + 1
            over = sum(o.size for o in objects.values()) - quota
            victims = {}
            for other, obj in sorted(objects.items(), key=lambda item: item[1].used):
                if over <= 0:
                    break
                if obj.used < since and other not in view.writing:
                    victims[other] = obj
                    over -= obj.size
            for victim in victims:
                del objects[victim]
        return Counted(sid, False, victims, before)

    def done(self, key: ShardKey, counted: Counted, written: bool) -> list[ShardKey]:
        """The write :meth:`account` counted has ended: the victims to delete now (none when it failed: they are
        counted again, and the key as it was before)."""
        if counted.refused:
            return []
        with self._lock:
            view = self._views.get(counted.sid)
        if view is None:
            return list(counted.victims) if written else []
        with view.lock:
            left = view.writing.get(key, 0) - 1
            if left > 0:
                view.writing[key] = left
            else:
                view.writing.pop(key, None)
            if written:
                return list(counted.victims)
            for victim, obj in counted.victims.items():
                view.objects.setdefault(victim, obj)
            if counted.before is None:
                view.objects.pop(key, None)
            else:
                view.objects[key] = counted.before
        return []

    def evicted(self, n: int) -> None:
        with self._lock:
            self.evictions += n

    # -- reads and deletes -------------------------------------------------------------------------------------
    def used(self, key: ShardKey) -> None:
        """A read hit ``key``: it moves to its share's recent end (in this engine's view)."""
        found = self._found(key.namespace)
        if found is not None:
            with found[2].lock:
                obj = found[2].objects.get(key)
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
            view = self._views.get(sid)
        if view is None:
            return 0
        self._refresh_if_due(sid, view)
        with view.lock:
            return sum(o.size for o in view.objects.values())
