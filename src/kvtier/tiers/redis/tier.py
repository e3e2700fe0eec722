"""The Redis tier: shards in a Redis or Valkey server, or a Redis Cluster, shared by every engine that uses it.

The stored format is :mod:`.fields`'s. A shard is written by one HSET (in one MULTI/EXEC when it has several
segments), so a reader sees all of its segments or none; the server's own eviction (maxmemory) removes a whole
hash, so an evicted shard is a miss, never a partial read. In a cluster the chunks spread over the slots and the
client follows MOVED/ASK.

Any Redis error (refused, timed out, out of memory) is a :class:`TierError` (:mod:`.connection`). One bad key is
not an outage: a key of another type at a chunk's name (``WRONGTYPE``) has no shards for ``heads``, is an
:class:`ObjectError` for ``get`` and is removed by ``delete``; fields and keys that are not exactly kvtier's are
ignored.
"""

from __future__ import annotations

import builtins
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, TypeVar

from kvtier import quotas
from kvtier.errors import ObjectError, PartUnavailable, QuotaFull, TierError, WrongSize
from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas.redis import RedisShares
from kvtier.tiers.base import TIERS, Buffer, StoredObject, Tier
from kvtier.tiers.redis.connection import Client
from kvtier.tiers.redis.fields import HEX32, complete, escape_glob, parse_field, segments, wrong_type
from kvtier.tiers.redis.options import RedisOptions
from kvtier.tiers.redis.replies import Replies, Unexpected, stream

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@TIERS.register("redis")
class RedisTier(Tier):
    """Shards in Redis / Valkey (one server, or a Redis Cluster with ``cluster: true``)."""

    Options = RedisOptions
    persistent = True  # the data lives in the server, not in this process
    listed_times = False  # Redis keeps no creation time: a listing gives the last access (and ttl_seconds expires)
    shares = True  # counted in the server: every engine's writes count (kvtier.quotas.redis)
    # Each reply waits on the server's lookup and first bytes; reading ahead on other connections keeps it sending
    # while a shard is verified here (16 chunks of 5.9 MB from loopback: 1.67 -> 1.93 GB/s; one connection's raw
    # HGETs 2.3 GB/s). Pipelining a batch on one connection measured slower (1.35 GB/s): the server buffers it.
    read_ahead = True

    def __init__(self, name: str, options: RedisOptions) -> None:
        super().__init__(name, options)
        self._client = Client(name, options)
        self._lock = threading.Lock()
        self._own_key = re.compile(re.escape(options.key_prefix.encode()) + rb"([0-9a-f]{32}):([0-9a-f]{32})")
        self._wrong_type_keys = 0  # keys of another type met at a chunk's name (see counters())
        self._shares = RedisShares(options.key_prefix, self._call)

    def _call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        return self._client.call(what, fn)

    def _hash(self, namespace: str, chunk: str) -> str:
        return f"{self.options.key_prefix}{namespace}:{chunk}"

    @staticmethod
    def _replies(pipe: Any) -> list[Any]:
        """Execute a pipeline; a reply that is an error is raised as it came (WRONGTYPE unprefixed: see
        :meth:`Client.call`)."""
        replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return list(replies)

    # -- the tier interface ------------------------------------------------------------------------------------
    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        counted = self._shares.account(key, sum(memoryview(p).nbytes for p in parts))  # before: never uncounted
        try:
            if counted is not None and counted.refused:
                raise QuotaFull(f"{self.name}: not writing {key.name}: its tenant's share is full of shards used in "
                                f"the last {quotas.RECENT_SECONDS:g} s")
            self._put(key, parts)
        finally:
            if counted is not None and counted.victims:  # handed out for deletion: deleted whatever the write did
                self._evict(counted.share, counted.victims)

    def _evict(self, share: str, victims: list[ShardKey]) -> None:
        """Delete shards the share handed out, then take those deleted out of its count; one that fails stays
        counted (handed out again later)."""
        done = []
        for victim in victims:
            try:
                self._delete(victim)
                done.append(victim)
            except TierError as exc:  # ObjectError included: a key of another type at the chunk's name
                log.debug("tier %s: evicting %s from its share failed: %s", self.name, victim.name, exc)
        try:
            self._shares.deleted(share, done)
        except TierError as exc:  # they stay counted as handed out, and are handed out again (deleted: a no-op)
            log.debug("tier %s: confirming %d evictions failed: %s", self.name, len(done), exc)

    def _put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        name = self._hash(key.namespace, key.chunk)
        pieces = segments(parts, self.options.segment_bytes)
        n = len(pieces)
        heads = str(key.heads)

        def execute(client: Any) -> list[Any]:
            # One HSET of one field is atomic by itself; several segments need MULTI/EXEC (which a cluster
            # client runs more slowly).
            pipe = client.pipeline(transaction=n > 1)
            pipe.hset(name, mapping={f"{heads}:{i}/{n}": seg for i, seg in enumerate(pieces)})
            if self.options.ttl_seconds is not None:
                pipe.pexpire(name, int(self.options.ttl_seconds * 1000))
            pipe.hkeys(name)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            return replies

        def write(client: Any) -> None:
            replies = execute(client)
            if any(wrong_type(r) for r in replies):
                # A key of another type holds this chunk's name, which is ours (prefix, namespace, chunk): a
                # put replaces what is stored under its name.
                client.unlink(name)
                replies = execute(client)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            # Segments of this shard from an earlier write with another count would never be read; drop them.
            # (Until then a reader may pick either complete set: both are whole, verified objects.)
            stale = [f for f in replies[-1] if (p := parse_field(f)) and p[0] == key.heads and p[2] != n]
            if stale:
                client.hdel(name, *stale)

        self._call(f"put {key.name}", write)

    def get(self, key: ShardKey) -> Buffer | None:
        blob = self._get(key)
        if blob is not None:
            self._shares.touched(key)
        return blob

    def _get(self, key: ShardKey) -> Buffer | None:
        name = self._hash(key.namespace, key.chunk)

        def read(client: Any) -> Buffer | None:
            # One round trip for the usual one-segment shard: the field list, and that segment if it exists.
            single = f"{key.heads}:0/1"
            pipe = client.pipeline(transaction=False)
            pipe.hkeys(name)
            pipe.hget(name, single)
            names, value = self._replies(pipe)
            blob: bytes | None = value
            fields = complete(names).get(key.heads)
            if fields is None:
                return None
            if fields == [single.encode()]:
                return blob
            # One HGET per segment, pipelined: one round trip, and each reply is parsed on its own (a single
            # reply of many megabytes grows the parser's buffer by 1 MB steps, copying it each time).
            pipe = client.pipeline(transaction=False)
            for field in fields:
                pipe.hget(name, field)
            values = self._replies(pipe)
            if any(v is None for v in values):  # evicted or replaced between the two calls
                return None
            return b"".join(values)

        return self._call(f"get {key.name}", read)

    def get_into(self, key: ShardKey, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
        head = self._get_into(key, header_len, payload)
        if head is not None:
            self._shares.touched(key)
        return head

    def _get_into(self, key: ShardKey, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
        """The usual one-segment shard in one round trip (its field list and that segment, pipelined), read from
        the socket straight into ``payload`` (:mod:`.replies`). A shard in several segments, a cluster's
        redirection or an error reply other than WRONGTYPE goes through :meth:`get`."""
        name = self._hash(key.namespace, key.chunk)
        node = None
        try:
            pool, node = self._client.pool_for(name)
            conn = pool.get_connection()
        except self._client.errors as exc:
            self._client.node_failed(node, f"get {key.name}", exc)
        command = conn.pack_commands([("HKEYS", name), ("HGET", name, f"{key.heads}:0/1")])
        in_step = False  # whether the connection may serve the next call; otherwise it is dropped
        try:
            for attempt in range(2):
                try:
                    conn.send_packed_command(command)
                    replies = Replies(conn._sock)  # redis-py's own socket, connected by the send
                    header = stream(replies, key.heads, header_len, payload)
                    in_step = replies.drained
                    self._client.node_succeeded(node)
                    return header
                except (ConnectionError, self._client.redis.ConnectionError):
                    # A pooled connection the server closed (a restart): once more, on this connection anew. Not a
                    # timeout: the server is stalled, and a second wait would double the caller's.
                    conn.disconnect()
                    if attempt:
                        raise
        except Unexpected as exc:
            in_step = exc.in_step
        except WrongSize as exc:
            raise WrongSize(f"{self.name}: get {key.name}: {exc}", exc.size) from exc
        except ObjectError as exc:
            raise ObjectError(f"{self.name}: get {key.name}: {exc}") from exc
        except (OSError, *self._client.errors) as exc:
            self._client.node_failed(node, f"get {key.name}", exc)
        finally:
            if not in_step:
                conn.disconnect()  # a reply may be half read
            pool.release(conn)
        blob = self._get(key)
        return None if blob is None else self._split(key, blob, header_len, payload)

    def delete(self, key: ShardKey) -> bool:
        # Out of its share first (also when it is gone: the server may have evicted it, still counted): a shard
        # another engine writes again after this delete is counted by that write. One whose count that engine
        # made before the uncount, and whose write lands after this delete, ends stored but not counted.
        self._shares.removing(key)
        return self._delete(key)

    # -- tenant shares -----------------------------------------------------------------------------------------
    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        """Count ``namespace``'s shards against the tenant share ``share`` of ``quota_bytes`` (None: none), in the
        server (:mod:`kvtier.quotas.redis`): a put that takes the share past its quota deletes the
        share's least recently used shards, whichever engine wrote them."""
        self._shares.set(namespace, share, quota_bytes)

    def share_bytes(self, share: str) -> int:
        return self._shares.bytes(share)

    def remove_records(self, namespaces: Collection[str]) -> int:
        """Each namespace's record of its tenant share (``<prefix>shareof:<namespace>``)."""
        return self._shares.forget(namespaces)

    def _delete(self, key: ShardKey) -> bool:
        name = self._hash(key.namespace, key.chunk)

        def remove(client: Any) -> bool:
            try:
                names = client.hkeys(name)
            except self._client.redis.ResponseError as exc:
                if not wrong_type(exc):
                    raise
                # A key of another type at this chunk's name (ours: prefix, namespace, chunk) holds no shard;
                # the store deletes what get reported as malformed, so the key itself goes.
                return bool(client.unlink(name))
            fields = [f for f in names if (p := parse_field(f)) and p[0] == key.heads]
            return bool(fields) and client.hdel(name, *fields) > 0

        return self._call(f"delete {key.name}", remove)

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        if not chunks:
            return []

        def query(client: Any) -> list[list[HeadRange]]:
            pipe = client.pipeline(transaction=False)
            for chunk in chunks:
                pipe.hkeys(self._hash(namespace, chunk))
            out: list[list[HeadRange]] = []
            for chunk, reply in zip(chunks, pipe.execute(raise_on_error=False)):
                if wrong_type(reply):  # someone's key of another type: no shards of this chunk, the rest stand
                    self._met_wrong_type(namespace, chunk)
                    out.append([])
                elif isinstance(reply, PartUnavailable):  # its node is failing: nothing found, the rest stand
                    out.append([])
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    out.append(list(complete(reply)))
            return out

        return self._call(f"lookup of {len(chunks)} chunks", query)

    def _met_wrong_type(self, namespace: str, chunk: str) -> None:
        with self._lock:
            self._wrong_type_keys += 1
            first = self._wrong_type_keys == 1
        if first:  # then only counted: a lookup meets the same key again and again
            log.warning("tier %s: %s is not a hash (WRONGTYPE): not kvtier's, treated as holding no shards; "
                        "further ones are counted (tier event wrong_type_keys)", self.name,
                        self._hash(namespace, chunk))

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        if namespace is not None and not HEX32.fullmatch(namespace):
            return  # no namespace id looks like that (and no glob characters reach the SCAN pattern)
        # Exactly <prefix><32 hex>:<32 hex>: the glob narrows the scan by length, the regex decides. A shorter
        # prefix of another deployment (``kvtier:`` beside ``kvtier:staging:``) never lists its keys.
        pattern = escape_glob(self.options.key_prefix) + (namespace or "?" * 32) + ":" + "?" * 32
        scanned = self._call("listing", lambda c: list(c.scan_iter(match=pattern, count=1000)))
        names = [n for n in scanned if self._own_key.fullmatch(n)]
        now = time.time()
        for start in range(0, len(names), 256):
            yield from self._describe(names[start:start + 256], now)

    def _describe(self, batch: builtins.list[bytes], now: float) -> Iterator[StoredObject]:  # (`list`: the method)
        def fields_and_idle(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for n in batch:
                pipe.object("idletime", n)  # first: reading the fields is an access, and would zero it
                pipe.hkeys(n)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            return replies

        replies = self._call("listing", fields_and_idle)
        shards = [(name, heads, segs, idle) for name, idle, fields in zip(batch, replies[::2], replies[1::2])
                  if not isinstance(fields, Exception)  # not a hash: not ours to list
                  for heads, segs in complete(fields).items()]
        if not shards:
            return

        def lengths(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, _, segs, _ in shards:
                for seg in segs:
                    pipe.hstrlen(name, seg)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            return replies

        sizes = iter(self._call("listing", lengths))
        for name, heads, segs, idle in shards:
            seg_sizes = [next(sizes) for _ in segs]
            if not all(isinstance(s, int) for s in seg_sizes):
                continue  # replaced by another type since the first call
            match = self._own_key.fullmatch(name)
            assert match is not None  # names were filtered by it
            # Redis keeps no creation time; the last access stands for both.
            used = now - (idle if isinstance(idle, int) else 0)
            key = ShardKey(match[1].decode(), match[2].decode(), heads)
            yield StoredObject(key, sum(seg_sizes), used, used)

    def counters(self) -> dict[str, float]:
        return {"wrong_type_keys": float(self._wrong_type_keys), "share_evictions": float(self._shares.evictions),
                "share_refused_writes": float(self._shares.refused),
                "share_touch_failures": float(self._shares.touch_failures), **self._client.node_counters()}

    def close(self) -> None:
        self._client.drop()
