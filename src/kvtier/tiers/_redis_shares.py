"""Per-tenant shares (quotas) of a Redis tier, counted in the server itself, so that the writes of every engine
that uses the server count against one share.

A share's keys carry one hash tag, so a Redis Cluster keeps them in one slot (the scripts below touch all three):

    <prefix>{share:<id>}:lru     sorted set: shard -> its last use, in the server's milliseconds
    <prefix>{share:<id>}:size    hash: shard -> bytes
    <prefix>{share:<id>}:bytes   the share's total
    <prefix>shareof:<namespace>  the share <namespace> counts against (so that any process removes correctly)

A shard is named ``<namespace>:<chunk>:<heads>``; ``<id>`` is a digest of the store's share name, which holds the
tenant's salt: a salt is never written to a shared server. A put is counted before it is written (a script:
the shard's size replaces its old one, then the share's least recently used shards are taken out of it while it
is over its quota); the writer then deletes those shards. A read that hits moves its shard to the recent end; a
delete takes it out. Shards the server removes by itself (``maxmemory`` eviction, ``ttl_seconds``) stay counted
until the share next evicts: they are its least recently used, so they go first, and those past the tier's ttl
are taken out at every put. A count is never below what the share holds, so no share holds more than its quota
(within one put's racing writers).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvtier.keys import HeadRange, ShardKey

log = logging.getLogger(__name__)

_KEPT = 65536  # namespaces whose share is remembered (the store tells the tier again when it meets one anew)
_MEMBER = re.compile(rb"([0-9a-f]{32}):([0-9a-f]{32}):([0-9]+-[0-9]+of[0-9]+)")

_DROP = """
local function drop(m)
  local size = tonumber(redis.call('HGET', KEYS[2], m)) or 0
  redis.call('ZREM', KEYS[1], m)
  redis.call('HDEL', KEYS[2], m)
  return redis.call('DECRBY', KEYS[3], size)
end
"""

# KEYS: lru, size, total. ARGV: shard, its bytes, the quota, the tier's ttl in ms (0: none). Returns the shards
# taken out of the share to bring it under its quota (the caller deletes them).
_ACCOUNT = _DROP + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[4])
if ttl > 0 then  -- last used before now - ttl: put before then too, so expired already
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - ttl), 'LIMIT', 0, 64)) do
    drop(m)
  end
end
local old = tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
local used = redis.call('INCRBY', KEYS[3], tonumber(ARGV[2]) - old)
local quota = tonumber(ARGV[3])
local out = {}
while used > quota do
  local first = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not first then
    redis.call('SET', KEYS[3], 0)  -- nothing left to count: a total drifted by hand starts again
    break
  end
  used = drop(first)
  out[#out + 1] = first
end
return out
"""

_REMOVE = _DROP + """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then drop(ARGV[1]) end
return 0
"""

_TOUCH = """
local t = redis.call('TIME')
return redis.call('ZADD', KEYS[1], 'XX', 'GT', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
"""


def share_id(share: str) -> str:
    """The name a share has in the server: a digest of the store's (which holds the tenant's salt)."""
    return hashlib.sha256(b"kvtier share/" + share.encode()).hexdigest()[:32]


class RedisShares:
    """The share accounting of one Redis tier: ``call(what, fn)`` runs ``fn(client)`` as the tier runs its calls
    (raising :class:`~kvtier.errors.TierError`)."""

    def __init__(self, prefix: str, call: Callable[[str, Callable[[Any], Any]], Any], ttl_seconds: float | None) \
            -> None:
        self._prefix = prefix
        self._call = call
        self._ttl_ms = 0 if ttl_seconds is None else max(1, int(ttl_seconds * 1000))
        self._lock = threading.Lock()
        self._share_of: OrderedDict[str, tuple[str, int]] = OrderedDict()  # namespace -> (share id, quota)
        self._recorded: set[str] = set()  # namespaces whose shareof key this process has written
        self.evictions = 0

    def _keys(self, sid: str) -> list[str]:
        base = f"{self._prefix}{{share:{sid}}}"
        return [f"{base}:lru", f"{base}:size", f"{base}:bytes"]

    def _of_key(self, namespace: str) -> str:
        return f"{self._prefix}shareof:{namespace}"

    @staticmethod
    def _member(key: ShardKey) -> str:
        return f"{key.namespace}:{key.chunk}:{key.heads}"

    def set(self, namespace: str, share: str | None, quota_bytes: int) -> None:
        with self._lock:
            if share is None:
                self._share_of.pop(namespace, None)
                return
            self._share_of[namespace] = (share_id(share), quota_bytes)
            self._share_of.move_to_end(namespace)
            while len(self._share_of) > _KEPT:
                self._share_of.popitem(last=False)

    def _of(self, namespace: str) -> tuple[str, int] | None:
        with self._lock:
            return self._share_of.get(namespace)

    def account(self, key: ShardKey, size: int) -> list[ShardKey]:
        """Count a shard about to be written (before it is: a write that fails then leaves a count, never a shard
        uncounted); the shards to delete to bring its share back under its quota, maybe itself."""
        found = self._of(key.namespace)
        if found is None:
            return []
        sid, quota = found
        keys = self._keys(sid)

        def run(client: Any) -> list[bytes]:
            if key.namespace not in self._recorded:
                client.set(self._of_key(key.namespace), sid)
                with self._lock:
                    if len(self._recorded) >= _KEPT:
                        self._recorded.clear()  # written again as they come: an idempotent SET
                    self._recorded.add(key.namespace)
            return list(client.eval(_ACCOUNT, 3, *keys, self._member(key), size, quota, self._ttl_ms))

        out = []
        for raw in self._call(f"share accounting of {key.name}", run):
            match = _MEMBER.fullmatch(raw if isinstance(raw, bytes) else str(raw).encode())
            if match is None:
                continue  # not a name kvtier writes: nothing of ours to delete
            try:
                out.append(ShardKey(match[1].decode(), match[2].decode(), HeadRange.parse(match[3].decode())))
            except ValueError:
                continue
        with self._lock:
            self.evictions += len(out)
        return out

    def touched(self, key: ShardKey) -> None:
        """A read hit ``key``: it moves to its share's recent end. A failure is only logged (the order is a hint)."""
        found = self._of(key.namespace)
        if found is None:
            return
        try:
            self._call(f"share touch of {key.name}",
                       lambda c: c.eval(_TOUCH, 1, self._keys(found[0])[0], self._member(key)))
        except Exception as exc:  # noqa: BLE001 - the read itself succeeded
            log.debug("share touch of %s failed: %s", key.name, exc)

    def removed(self, key: ShardKey) -> None:
        """``key`` was deleted: out of its share, found by its namespace's ``shareof`` key when this process has
        not been told its share (a command)."""
        found = self._of(key.namespace)

        def run(client: Any) -> None:
            sid = found[0] if found is not None else client.get(self._of_key(key.namespace))
            if sid is None:
                return
            sid = sid.decode() if isinstance(sid, bytes) else str(sid)
            if re.fullmatch(r"[0-9a-f]{32}", sid):
                client.eval(_REMOVE, 3, *self._keys(sid), self._member(key))

        self._call(f"share accounting of {key.name}", run)

    def bytes(self, share: str) -> int:
        raw = self._call("share size", lambda c: c.get(self._keys(share_id(share))[2]))
        try:
            return max(0, int(raw or 0))
        except ValueError:
            return 0
