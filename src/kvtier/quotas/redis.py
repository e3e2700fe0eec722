"""Per-tenant shares (quotas) of a Redis tier, counted in the server itself, so that the writes of every engine
that uses the server count against one share.

A share's keys carry one hash tag, so a Redis Cluster keeps them in one slot (each script below touches them all):

    <prefix>{share:<id>}:lru     sorted set: a live shard -> its last use, in the server's milliseconds
    <prefix>{share:<id>}:acct    hash: every counted shard -> its bytes; ``~total`` and ``~doomed`` byte sums
    <prefix>{share:<id>}:doomed  sorted set: a shard handed out for deletion -> when
    <prefix>shareof:<namespace>  the share <namespace> counts against (so that any process removes correctly)

A shard is named ``<namespace>:<chunk>:<heads>``; ``<id>`` is a digest of the store's share name, which holds the
tenant's salt: a salt is never written to a shared server (the share does group a tenant's namespaces).

A put is counted before it is written. A new shard is refused (:class:`~kvtier.errors.QuotaFull`, nothing
evicted for it) when the shards used in the last ``RECENT_SECONDS`` (:mod:`kvtier.quotas`) and it would
not fit the quota: a prompt's own chunks are put (and read) together, first chunk first, so evicting its first
ones would leave its last ones unreachable; a prompt larger than its share keeps its leading chunks. Otherwise,
while the share's live bytes are over its quota, its least recently used shards (none of those recent ones) are
handed out for deletion. They stay counted, as doomed, until the engine that deletes them confirms; one whose
deletion failed, or whose engine died, is handed out again after :data:`_STALE_MS`; a confirmation takes out
only what is still doomed (a shard another engine put back meanwhile is live again). A read that hits moves
its shard to the recent end; a delete takes it out of the count first (a shard put again while a command
deletes it can end stored but not counted, until it is put again). Shards the server removes by itself
(``maxmemory``, ``ttl_seconds``) stay counted until they are handed out: they are the least recently used. If
the server evicts one of the share's own keys, the share starts counting anew (the shards stored before are
then not counted). So a share holds more than its quota only by the writes in flight at one moment and the
shards handed out whose deletion has not succeeded yet, and after those two losses of its count.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from kvtier import quotas
from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas import Share, share_id
from kvtier.recent import RecentMap

log = logging.getLogger(__name__)

_STALE_MS = 30_000  # a shard handed out for deletion this long ago and still counted is handed out again
_MOST = 64  # shards one put hands out at most (one script call stays short); the rest at the next put
_KEPT = 65536  # namespaces whose share is remembered (the store tells the tier again when it meets one anew)
_RECORD_EVERY = 30.0  # seconds after which a put writes its namespace's shareof key again (a purge deletes it)
_FORGET_BATCH = 256  # members taken out of a share per script call
_MEMBER = re.compile(rb"([0-9a-f]{32}):([0-9a-f]{32}):([0-9]+-[0-9]+of[0-9]+)")

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function num(v) return tonumber(v) or 0 end
"""

# KEYS: lru, acct, doomed. ARGV: shard, its bytes, the quota, RECENT in ms, STALE in ms, at most this many out.
# Returns {refused (0/1), shards to delete...}.
_ACCOUNT = _NOW + """
local lru, acct, doomed = KEYS[1], KEYS[2], KEYS[3]
local member, size, quota, recent, most = ARGV[1], num(ARGV[2]), num(ARGV[3]), now - num(ARGV[4]), num(ARGV[6])
-- Every counted shard is live or doomed; the server evicting one of these keys alone breaks that: start anew.
if redis.call('HLEN', acct) - redis.call('HEXISTS', acct, '~total') - redis.call('HEXISTS', acct, '~doomed')
    ~= redis.call('ZCARD', lru) + redis.call('ZCARD', doomed) then
  redis.call('DEL', lru, acct, doomed)
end
local total, gone = num(redis.call('HGET', acct, '~total')), num(redis.call('HGET', acct, '~doomed'))
local out = {0}
for _, m in ipairs(redis.call('ZRANGEBYSCORE', doomed, '-inf', now - num(ARGV[5]), 'LIMIT', 0, most)) do
  redis.call('ZADD', doomed, now, m)  -- its deleter died: hand it out again
  out[#out + 1] = m
end
local old = redis.call('HGET', acct, member)
if not old then
  -- a new shard: refused, before anything is evicted for it, when the recent shards leave it no room
  local busy = size
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', lru, '(' .. recent, '+inf')) do
    busy = busy + num(redis.call('HGET', acct, m))
  end
  if busy > quota then
    out[1] = 1
    return out
  end
elseif redis.call('ZREM', doomed, member) == 1 then
  gone = gone - num(old)  -- handed out, and wanted again: live
end
total = total - num(old) + size
redis.call('HSET', acct, member, size)
redis.call('ZADD', lru, now, member)
local evicted = 0
while total - gone > quota and evicted < most do
  local first = redis.call('ZRANGE', lru, 0, 0, 'WITHSCORES')
  if #first == 0 or num(first[2]) > recent then break end  -- only recent shards left (a rewrite of one)
  redis.call('ZREM', lru, first[1])
  redis.call('ZADD', doomed, now, first[1])
  gone = gone + num(redis.call('HGET', acct, first[1]))
  out[#out + 1] = first[1]
  evicted = evicted + 1
end
redis.call('HSET', acct, '~total', total, '~doomed', gone)
return out
"""

# KEYS: lru, acct, doomed. ARGV: shards about to be deleted (live or doomed): out of the count.
# A share with nothing counted in it any more (its two sums only): its keys deleted; returns how many.
_DROP_EMPTY = """
local counted = redis.call('HLEN', KEYS[2]) - redis.call('HEXISTS', KEYS[2], '~total')
  - redis.call('HEXISTS', KEYS[2], '~doomed')
if counted == 0 and redis.call('ZCARD', KEYS[1]) == 0 and redis.call('ZCARD', KEYS[3]) == 0 then
  return redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
end
return 0
"""
_UNCOUNT = _NOW + """
local total, gone = num(redis.call('HGET', KEYS[2], '~total')), num(redis.call('HGET', KEYS[2], '~doomed'))
for _, m in ipairs(ARGV) do
  local size = redis.call('HGET', KEYS[2], m)
  if size then
    if redis.call('ZREM', KEYS[3], m) == 1 then gone = gone - num(size) end
    redis.call('ZREM', KEYS[1], m)
    redis.call('HDEL', KEYS[2], m)
    total = total - num(size)
  end
end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HSET', KEYS[2], '~total', total, '~doomed', gone) end
return 0
"""

# KEYS: lru, acct, doomed. ARGV: shards handed out and deleted since: out of the count if still doomed (one put
# back meanwhile by another engine is live again, and stays counted).
_CONFIRM = _NOW + """
local total, gone = num(redis.call('HGET', KEYS[2], '~total')), num(redis.call('HGET', KEYS[2], '~doomed'))
for _, m in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[3], m) == 1 then
    local size = num(redis.call('HGET', KEYS[2], m))
    redis.call('HDEL', KEYS[2], m)
    total, gone = total - size, gone - size
  end
end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HSET', KEYS[2], '~total', total, '~doomed', gone) end
return 0
"""

_TOUCH = _NOW + """
return redis.call('ZADD', KEYS[1], 'XX', 'GT', now, ARGV[1])
"""


@dataclasses.dataclass
class Counted:
    """What counting a put decided: its share, the shards to delete (then :meth:`RedisShares.deleted`), and
    whether the shard itself must not be written."""

    share: str
    victims: list[ShardKey]
    refused: bool = False


class RedisShares:
    """The share accounting of one Redis tier: ``call(what, fn)`` runs ``fn(client)`` as the tier runs its calls
    (raising :class:`~kvtier.errors.TierError`)."""

    def __init__(self, prefix: str, call: Callable[[str, Callable[[Any], Any]], Any]) -> None:
        self._prefix = prefix
        self._call = call
        self._lock = threading.Lock()
        self._share_of: RecentMap[str, Share] = RecentMap(_KEPT)  # namespace -> its share (by id)
        self._recorded: RecentMap[str, float] = RecentMap(_KEPT)  # namespace -> when this process last wrote its
        # shareof key (one forgotten is written again at its next put: an idempotent SET)
        self.evictions = 0
        self.refused = 0
        self.touch_failures = 0

    def _keys(self, sid: str) -> list[str]:
        base = f"{self._prefix}{{share:{sid}}}"
        return [f"{base}:lru", f"{base}:acct", f"{base}:doomed"]

    def _of_key(self, namespace: str) -> str:
        return f"{self._prefix}shareof:{namespace}"

    @staticmethod
    def _member(key: ShardKey) -> str:
        return f"{key.namespace}:{key.chunk}:{key.heads}"

    def set(self, namespace: str, share: str | None, quota_bytes: int) -> None:
        with self._lock:
            if share is None:
                self._share_of.pop(namespace)
            else:
                self._share_of[namespace] = Share(share_id(share), quota_bytes)

    def _of(self, namespace: str) -> Share | None:
        with self._lock:
            return self._share_of.get(namespace)

    def account(self, key: ShardKey, size: int) -> Counted | None:
        """Count a shard about to be written (before it is: a write that fails leaves a count, never a shard
        uncounted); None when its namespace has no share here."""
        found = self._of(key.namespace)
        if found is None:
            return None
        sid, quota = found

        def run(client: Any) -> Any:
            now = time.monotonic()
            if now - self._recorded.get(key.namespace, -math.inf) >= _RECORD_EVERY:
                client.set(self._of_key(key.namespace), sid)
                with self._lock:
                    self._recorded[key.namespace] = now
            return client.eval(_ACCOUNT, 3, *self._keys(sid), self._member(key), size, quota,
                               int(quotas.RECENT_SECONDS * 1000), _STALE_MS, _MOST)

        reply = self._call(f"share accounting of {key.name}", run)
        if not isinstance(reply, list) or not reply:
            return Counted(sid, [])  # not what the script returns: nothing to delete, the write goes ahead
        victims: list[ShardKey] = []
        junk: list[Any] = []  # (as the server replied)
        for raw in reply[1:]:
            parsed = _parse_member(raw)
            (junk if parsed is None else victims).append(raw if parsed is None else parsed)
        if junk:  # not a name kvtier writes: nothing of ours to delete, only to take out of the count
            self._call("share accounting", lambda c: c.eval(_CONFIRM, 3, *self._keys(sid), *junk))
        counted = Counted(sid, victims, reply[0] == 1)
        with self._lock:
            self.evictions += len(victims)
            self.refused += counted.refused
        return counted

    def deleted(self, sid: str, victims: list[ShardKey]) -> None:
        """``victims`` (handed out by :meth:`account`) were deleted: out of the count. A failure leaves them
        counted, to be handed out again."""
        if victims:
            self._call("share accounting", lambda c: c.eval(_CONFIRM, 3, *self._keys(sid),
                                                            *(self._member(v) for v in victims)))

    def touched(self, key: ShardKey) -> None:
        """A read hit ``key``: it moves to its share's recent end. A failure is counted (the order is a hint)."""
        found = self._of(key.namespace)
        if found is None:
            return
        try:
            self._call(f"share touch of {key.name}",
                       lambda c: c.eval(_TOUCH, 1, self._keys(found.name)[0], self._member(key)))
        except Exception as exc:  # noqa: BLE001 - the read itself succeeded
            with self._lock:
                self.touch_failures += 1
            log.debug("share touch of %s failed: %s", key.name, exc)

    def removing(self, key: ShardKey) -> None:
        """``key`` is about to be deleted: out of its share first (see the module's docstring), found by its
        namespace's ``shareof`` key when this process has not been told its share (a command)."""
        found = self._of(key.namespace)

        def run(client: Any) -> None:
            sid = found.name if found is not None else client.get(self._of_key(key.namespace))
            if sid is None:
                return
            sid = sid.decode() if isinstance(sid, bytes) else str(sid)
            if re.fullmatch(r"[0-9a-f]{32}", sid):
                client.eval(_UNCOUNT, 3, *self._keys(sid), self._member(key))

        self._call(f"share accounting of {key.name}", run)

    def forget(self, namespaces: Collection[str]) -> int:
        """Once the shards of ``namespaces`` are deleted (each taken out of its share first: :meth:`removing`),
        what still names them: members of their share the server dropped by itself or that were written
        meanwhile (taken out of its count), the share's keys once nothing is left in them, and their ``shareof``
        keys; how many of these there were. A put writes ``shareof`` again within :data:`_RECORD_EVERY`."""
        removed = 0
        for namespace in namespaces:
            def run(client: Any, ns: str = namespace) -> int:
                count = 0
                sid = client.get(self._of_key(ns))
                sid = sid.decode() if isinstance(sid, bytes) else sid
                if isinstance(sid, str) and re.fullmatch(r"[0-9a-f]{32}", sid):
                    keys = self._keys(sid)
                    members = [m for m, _ in client.hscan_iter(keys[1], match=f"{ns}:*")]
                    for i in range(0, len(members), _FORGET_BATCH):
                        client.eval(_UNCOUNT, 3, *keys, *members[i:i + _FORGET_BATCH])
                    count += len(members) + int(client.eval(_DROP_EMPTY, 3, *keys) or 0)
                return count + int(client.delete(self._of_key(ns)) or 0)

            removed += self._call("share records", run)
            with self._lock:
                self._recorded.pop(namespace, None)
        return removed

    def bytes(self, share: str) -> int:
        """Bytes counted against ``share``, live and doomed."""
        raw = self._call("share size", lambda c: c.hget(self._keys(share_id(share))[1], "~total"))
        try:
            return max(0, int(raw or 0))
        except ValueError:
            return 0


def _parse_member(raw: object) -> ShardKey | None:
    match = _MEMBER.fullmatch(raw if isinstance(raw, bytes) else str(raw).encode())
    if match is None:
        return None  # not a name kvtier writes: nothing of ours to delete
    try:
        return ShardKey(match[1].decode(), match[2].decode(), HeadRange.parse(match[3].decode()))
    except ValueError:
        return None
