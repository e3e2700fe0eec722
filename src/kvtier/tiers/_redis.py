"""The Redis tier: shards in a Redis or Valkey server, or a Redis Cluster, shared by every engine that uses it.

Each chunk is one Redis hash, ``<key_prefix><namespace>:<chunk>``; each shard is stored in that hash under
fields ``<heads>:<i>/<n>``, the object cut into ``n`` segments of at most ``segment_bytes`` (the server's
bulk-length limit is 512 MB by default). A shard is written by one HSET (in one MULTI/EXEC when it has
several segments), so a reader sees all of its segments or none; the server's own eviction (maxmemory)
removes a whole hash, so an evicted shard is a miss, never a partial read. In a cluster the chunks spread over
the slots and the client follows MOVED/ASK.

Calls run on the caller's thread with the configured socket timeouts; any Redis error (refused, timed out,
out of memory) is a :class:`TierError`, and the client reconnects by itself on the next call once the server
answers again. A call to a stalled server fails after ``socket_timeout`` (a timeout is not retried). One bad
key is not an outage: a key of another type at a chunk's name (``WRONGTYPE``) has no shards for ``heads``, is an
:class:`ObjectError` for ``get`` and is removed by ``delete``; fields and keys that are not exactly kvtier's are
ignored. Messages show the URL with its password replaced by ``***``.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import math
import re
import threading
import time
import urllib.parse
from collections.abc import Collection, Iterator, Sequence
from typing import Any, NoReturn

from kvtier.config import check_url_port, redact_url
from kvtier.errors import ConfigError, ObjectError, QuotaFull, TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier import quotas
from kvtier.quotas.redis import RedisShares
from kvtier.tiers.base import TIERS, Buffer, StoredObject, Tier

log = logging.getLogger(__name__)

# The server's default proto-max-bulk-len; a segment above it is refused by the server.
_MAX_BULK = 512 * 2**20
_MAX_CONNECTIONS = 1024  # per process; more is a typo, and each one is a socket and a buffer
# A shard's field: ``<heads>:<i>/<n>`` in ASCII digits (``int()`` alone would also take " 1", "+1" or "١").
_FIELD = re.compile(rb"([0-9]+-[0-9]+of[0-9]+):([0-9]{1,9})/([0-9]{1,9})")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_FIELD_MAX = 64  # bytes of a field name get_into reads itself; one of ours is ``<a>-<b>of<n>:<i>/<n>``


@dataclasses.dataclass(frozen=True)
class RedisOptions:
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    key_prefix: str = "kvtier:"
    ttl_seconds: float | None = None
    segment_bytes: int = 256 * 2**20
    socket_timeout: float = 5.0
    connect_timeout: float = 1.0
    socket_read_bytes: int = 65536
    max_connections: int = 32
    # A file holding the password (e.g. a mounted Kubernetes Secret): the config itself then holds no secret.
    password_file: str | None = None

    def check(self, field: str) -> None:
        shown = redact_url(self.url)
        if self.password_file is not None:
            if not self.password_file.startswith("/"):
                raise ConfigError(f"{field}.password_file: an absolute path, got {self.password_file!r}")
            parts = urllib.parse.urlsplit(self.url)
            if parts.password is not None or "password=" in parts.query:
                raise ConfigError(f"{field}.password_file: the url holds a password too; give it in one place")
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"{field}.url: expected a redis://, rediss:// or unix:// URL, got {shown!r}")
        if self.cluster and self.url.startswith("unix://"):
            raise ConfigError(f"{field}.url: a Redis Cluster is reached over TCP, got {shown!r}")
        if self.cluster and ("{" in self.key_prefix or "}" in self.key_prefix):
            # a hash tag in the prefix would decide every key's slot: all of kvtier's keys on one node, or a
            # tenant share's keys (one tag of their own) over several slots, which its scripts cannot reach
            raise ConfigError(f"{field}.key_prefix: no '{{' or '}}' in a cluster (kvtier places its keys in slots "
                              f"itself), got {self.key_prefix!r}")
        if not self.url.startswith("unix://"):
            self._check_tcp_url(field, shown)
        if self.ttl_seconds is not None and not (self.ttl_seconds > 0 and math.isfinite(self.ttl_seconds)):
            raise ConfigError(f"{field}.ttl_seconds: must be a positive number of seconds, got {self.ttl_seconds}")
        if not 0 < self.segment_bytes <= _MAX_BULK:
            raise ConfigError(f"{field}.segment_bytes: must be in (0, 512MiB], got {self.segment_bytes}")
        for name in ("socket_timeout", "connect_timeout"):
            value = getattr(self, name)
            # inf or nan would reach socket.settimeout() only on the first call, and fail every call after.
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{field}.{name}: must be a positive number of seconds, got {value}")
        if self.socket_read_bytes < 4096:
            raise ConfigError(f"{field}.socket_read_bytes: must be at least 4096, got {self.socket_read_bytes}")
        if not 1 <= self.max_connections <= _MAX_CONNECTIONS:
            raise ConfigError(f"{field}.max_connections: must be in [1, {_MAX_CONNECTIONS}], "
                              f"got {self.max_connections}")
        self._check_with_redis(field, shown)

    def _check_tcp_url(self, field: str, shown: str) -> None:
        check_url_port(self.url, f"{field}.url", shown)
        parts = urllib.parse.urlsplit(self.url)
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ConfigError(f"{field}.url: the path must be a database number (e.g. /0), in {shown!r}")
        if self.cluster and db not in ("", "0"):
            raise ConfigError(f"{field}.url: a Redis Cluster has only database 0, in {shown!r}")

    def _check_with_redis(self, field: str, shown: str) -> None:
        """Let redis-py parse the URL now: it raises for a bad query option only when it first connects, on
        every call after that, and not as a RedisError."""
        try:
            import redis
        except ImportError:
            return  # the tier's constructor says which package is missing
        try:
            pool = redis.Redis.from_url(self.url).connection_pool
            pool.connection_class(**pool.connection_kwargs)  # builds a connection object; connects nowhere
        except (TypeError, ValueError, redis.RedisError) as exc:  # RedisError: e.g. a bad ssl_cert_reqs
            raise ConfigError(f"{field}.url: redis-py cannot use {shown!r}: {exc}") from None


def _segments(parts: Sequence[Buffer], size: int) -> list[bytes | memoryview]:
    """Cut the concatenation of ``parts`` into pieces of at most ``size`` bytes, copying only where parts join."""
    out: list[bytes | memoryview] = []
    pending: list[memoryview] = []
    pending_len = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            take = min(len(view), size - pending_len)
            pending.append(view[:take])
            pending_len += take
            view = view[take:]
            if pending_len == size:
                out.append(pending[0] if len(pending) == 1 else b"".join(pending))
                pending, pending_len = [], 0
    if pending or not out:
        out.append(pending[0] if len(pending) == 1 else b"".join(pending))
    return out


def _parse_field(field: bytes) -> tuple[HeadRange, int, int] | None:
    """``(heads, i, n)`` of a shard's field name, or None for a field that is not exactly one of ours."""
    match = _FIELD.fullmatch(field)
    if match is None:
        return None
    i, n = int(match[2]), int(match[3])
    if not 0 <= i < n:  # else a set of n fields could miss segment 0..n-1 and still count as complete
        return None
    try:
        return HeadRange.parse(match[1].decode("ascii")), i, n
    except ValueError:
        return None


def _wrong_type(reply: object) -> bool:
    """Whether a reply is the server's WRONGTYPE error: the key holds a string, list, ... not a hash."""
    return isinstance(reply, Exception) and str(reply).startswith("WRONGTYPE")


def _complete(fields: Sequence[bytes]) -> dict[HeadRange, list[bytes]]:
    """The shards whose every segment is present: head range -> field names in segment order."""
    seen: dict[tuple[HeadRange, int], dict[int, bytes]] = {}
    for field in fields:
        parsed = _parse_field(field)
        if parsed is not None:
            heads, i, n = parsed
            seen.setdefault((heads, n), {})[i] = field
    return {heads: [segs[i] for i in range(n)] for (heads, n), segs in seen.items() if len(segs) == n}


def _packer() -> Any:
    """redis-py's own command packer. hiredis's copies every argument into one buffer: 10 ms for a 5.9 MB
    chunk, three times the transfer itself; this one sends large arguments as they are."""
    from redis.connection import Encoder, PythonRespSerializer

    return PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


def _connection_class(tls: bool) -> type:
    """A connection class that packs commands with :func:`_packer` (for cluster clients)."""
    from redis.connection import Connection, SSLConnection

    base = SSLConnection if tls else Connection

    class PackingConnection(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("command_packer", _packer())
            super().__init__(**kwargs)

    return PackingConnection


class _Unexpected(Exception):
    """A reply :meth:`RedisTier.get_into` does not read itself (a redirection, a shard in several segments):
    redis-py's own path reads the shard. ``in_step``: both replies were read whole, the connection may serve the
    next call; otherwise it is dropped."""

    def __init__(self, reason: str, *, in_step: bool = False) -> None:
        super().__init__(reason)
        self.in_step = in_step


class _Replies:
    """Reads the RESP replies of a pipelined call straight from a connection's socket: reply lines through a small
    buffer, a bulk string's bytes straight into the caller's buffers (redis-py parses a reply into a bytes object
    of its own, at about 1 GB/s here, to be copied again). Any surprise leaves the connection unusable: the
    caller drops it."""

    _LINE_MAX = 1 << 16

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()

    @property
    def drained(self) -> bool:
        """Nothing read beyond the replies taken: the connection is in step for its next call."""
        return not self._buf

    def _fill(self) -> None:
        data = self._sock.recv(self._LINE_MAX)
        if not data:
            raise ConnectionError("the server closed the connection")
        self._buf += data

    def line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > self._LINE_MAX:
                raise _Unexpected("a reply line longer than 64 KiB")
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[:end + 2]
        return line

    def bulk(self, limit: int) -> bytes | None:
        """A bulk string, or None for a null or one longer than ``limit`` bytes (read past: not one of ours);
        an error reply is raised."""
        size = self.length(self.line(), b"$")
        if size is None:
            return None
        if size > limit:
            self._skip(size)
            return None
        while len(self._buf) < size + 2:
            self._fill()
        value = bytes(self._buf[:size])
        self._end(size)
        return value

    def _skip(self, size: int) -> None:
        scratch = memoryview(bytearray(min(size, self._LINE_MAX)))
        left = size - min(size, len(self._buf))
        del self._buf[:size - left]
        while left:
            got = self._sock.recv_into(scratch[:min(left, len(scratch))])
            if not got:
                raise ConnectionError("the server closed the connection")
            left -= got
        self.end()

    def length(self, line: bytes, kind: bytes) -> int | None:
        """The length a reply line announces (``$`` bulk, ``*`` array), None for a null (RESP2 or RESP3)."""
        if line.startswith(b"-"):
            reply = line[1:].decode("utf-8", "replace")
            if reply.startswith("WRONGTYPE"):
                raise ObjectError(reply)
            raise _Unexpected(reply)  # MOVED, ASK, LOADING, ...: redis-py's path knows what to do
        if line == b"_" or line == kind + b"-1":
            return None
        if not line.startswith(kind) or not line[1:].isdigit():
            raise _Unexpected(f"an unexpected reply {line[:40]!r}")
        return int(line[1:])

    def into(self, parts: Sequence[memoryview]) -> None:
        """Fill each of ``parts`` in turn from the reply: what the line buffer holds, then the socket."""
        for part in parts:
            part = part.cast("B")  # counted in bytes, as the reply's length is
            take = min(len(part), len(self._buf))
            part[:take] = self._buf[:take]
            del self._buf[:take]
            while take < len(part):
                got = self._sock.recv_into(part[take:])
                if not got:
                    raise ConnectionError("the server closed the connection")
                take += got

    def _end(self, size: int) -> None:
        if self._buf[size:size + 2] != b"\r\n":
            raise _Unexpected("a bulk reply not ended by CRLF")
        del self._buf[:size + 2]

    def end(self) -> None:
        while len(self._buf) < 2:
            self._fill()
        self._end(0)


def _escape_glob(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@TIERS.register("redis")
class RedisTier(Tier):
    """Shards in Redis / Valkey (one server, or a Redis Cluster with ``cluster: true``)."""

    Options = RedisOptions
    persistent = True  # the data lives in the server, not in this process
    listed_times = False  # Redis keeps no creation time: a listing gives the last access (and ttl_seconds expires)
    shares = True  # counted in the server: every engine's writes count (kvtier.quotas.redis)

    def __init__(self, name: str, options: RedisOptions) -> None:
        super().__init__(name, options)
        try:
            import redis
        except ImportError as exc:
            raise ConfigError(f"{name}: the redis tier needs the 'redis' package (pip install 'kvtier[redis]')") \
                from exc
        self._redis = redis
        # RedisClusterException (no slots, no reachable node) is not a RedisError in redis-py.
        self._errors = (redis.RedisError, redis.exceptions.RedisClusterException)
        self._lock = threading.Lock()
        self._client_obj: Any = None
        self._own_key = re.compile(re.escape(options.key_prefix.encode()) + rb"([0-9a-f]{32}):([0-9a-f]{32})")
        self._password: str | None = None
        if options.password_file is not None:
            try:  # read once, at start: a rotated Secret takes a restart, as a changed url does
                with open(options.password_file, encoding="utf-8") as f:
                    self._password = f.read().rstrip("\r\n")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{name}.password_file: cannot read {options.password_file}: "
                                  f"{type(exc).__name__}") from None
        self._wrong_type_keys = 0  # keys of another type met at a chunk's name (see counters())
        self._shares = RedisShares(options.key_prefix, self._call)

    # -- connection --------------------------------------------------------------------------------------------
    def _client(self) -> Any:
        """The client, built on first use: a cluster client must reach a node to learn the slots."""
        client = self._client_obj
        if client is not None:
            return client
        o = self.options
        kwargs: dict[str, Any] = {"socket_timeout": o.socket_timeout, "socket_connect_timeout": o.connect_timeout,
                                  "socket_read_size": o.socket_read_bytes, "max_connections": o.max_connections}
        if self._password is not None:
            kwargs["password"] = self._password
        if o.cluster:  # a cluster client passes on only the connection settings it knows, the class among them
            kwargs["connection_class"] = _connection_class(o.url.startswith("rediss://"))
        else:
            kwargs["command_packer"] = _packer()
        with self._lock:
            if self._client_obj is None:
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                try:
                    if o.cluster:
                        from redis.cluster import RedisCluster

                        # The cluster client retries timeouts too, each time after asking every node for the
                        # slots again (socket_timeout per stalled node): no retry keeps a stalled node's cost to
                        # one such round (measured: 5 x socket_timeout with one of three nodes paused, 9 x with
                        # one retry). The client is rebuilt after any error (see _call).
                        self._client_obj = RedisCluster.from_url(o.url, retry=Retry(NoBackoff(), 0), **kwargs)
                    else:
                        # One immediate retry replaces a pooled connection that the server closed (a restart).
                        # Not after a timeout: the server is stalled, and a second wait would double the time a
                        # caller waits for it (a call fails after socket_timeout, not twice that).
                        retry = Retry(NoBackoff(), 1, supported_errors=(self._redis.ConnectionError,))
                        self._client_obj = self._redis.Redis.from_url(o.url, retry=retry, **kwargs)
                except Exception as exc:  # whatever building the client raises is a TierError
                    # A cluster client connects here and raises RedisClusterException (no node answers, or
                    # the node is not in cluster mode); leaving it unwrapped would fail every call outside
                    # the store's outage handling.
                    raise TierError(f"{self.name}: cannot connect to {redact_url(o.url)}: {exc}") from exc
            return self._client_obj

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn(self._client())
        except self._errors as exc:
            if _wrong_type(exc):  # one key of another type: the server is fine
                raise ObjectError(f"{self.name}: {what}: the key is not a hash (WRONGTYPE)") from exc
            self._failed(what, exc)

    def _drop_client(self) -> None:
        # Also after a cluster error: a cluster client that lost every node keeps a stale slot map, so the next
        # call builds a new one.
        with self._lock:
            client, self._client_obj = self._client_obj, None
        if client is not None:
            try:
                client.close()
            except self._errors:
                pass

    def _hash(self, namespace: str, chunk: str) -> str:
        return f"{self.options.key_prefix}{namespace}:{chunk}"

    @staticmethod
    def _replies(pipe: Any) -> list[Any]:
        """Execute a pipeline; a reply that is an error is raised as it came (WRONGTYPE unprefixed: see _call)."""
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
        segments = _segments(parts, self.options.segment_bytes)
        n = len(segments)
        heads = str(key.heads)

        def execute(client: Any) -> list[Any]:
            # One HSET of one field is atomic by itself; several segments need MULTI/EXEC (which a cluster
            # client runs more slowly).
            pipe = client.pipeline(transaction=n > 1)
            pipe.hset(name, mapping={f"{heads}:{i}/{n}": seg for i, seg in enumerate(segments)})
            if self.options.ttl_seconds is not None:
                pipe.pexpire(name, int(self.options.ttl_seconds * 1000))
            pipe.hkeys(name)
            return pipe.execute(raise_on_error=False)

        def write(client: Any) -> None:
            replies = execute(client)
            if any(_wrong_type(r) for r in replies):
                # A key of another type holds this chunk's name, which is ours (prefix, namespace, chunk): a
                # put replaces what is stored under its name.
                client.unlink(name)
                replies = execute(client)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            # Segments of this shard from an earlier write with another count would never be read; drop them.
            # (Until then a reader may pick either complete set: both are whole, verified objects.)
            stale = [f for f in replies[-1] if (p := _parse_field(f)) and p[0] == key.heads and p[2] != n]
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
            fields = _complete(names).get(key.heads)
            if fields is None:
                return None
            if fields == [single.encode()]:
                return value
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
        the socket straight into ``payload`` (e.g. DRAM pages): no reply object, no copy after it. A shard in
        several segments, a cluster's redirection or an error reply other than WRONGTYPE goes through
        :meth:`get`."""
        name = self._hash(key.namespace, key.chunk)
        try:
            pool = self._pool_for(name)
            conn = pool.get_connection()
        except self._errors as exc:
            self._failed(f"get {key.name}", exc)
        command = conn.pack_commands([("HKEYS", name), ("HGET", name, f"{key.heads}:0/1")])
        in_step = False  # whether the connection may serve the next call; otherwise it is dropped
        try:
            for attempt in range(2):
                try:
                    conn.send_packed_command(command)
                    replies = _Replies(conn._sock)  # redis-py's own socket, connected by the send
                    header = self._stream(replies, key.heads, header_len, payload)
                    in_step = replies.drained
                    return header
                except (ConnectionError, self._redis.ConnectionError):
                    # A pooled connection the server closed (a restart): once more, on this connection anew. Not a
                    # timeout: the server is stalled, and a second wait would double the caller's.
                    conn.disconnect()
                    if attempt:
                        raise
        except _Unexpected as exc:
            in_step = exc.in_step
        except ObjectError as exc:
            raise ObjectError(f"{self.name}: get {key.name}: {exc}") from exc
        except (OSError, *self._errors) as exc:
            self._failed(f"get {key.name}", exc)
        finally:
            if not in_step:
                conn.disconnect()  # a reply may be half read
            pool.release(conn)
        blob = self._get(key)
        return None if blob is None else self._split(key, blob, header_len, payload)

    def _pool_for(self, name: str) -> Any:
        client = self._client()
        if not self.options.cluster:
            return client.connection_pool
        return client.get_redis_connection(client.get_node_from_key(name)).connection_pool

    @staticmethod
    def _stream(replies: _Replies, heads: HeadRange, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
        count = replies.length(replies.line(), b"*") or 0
        fields = [replies.bulk(_FIELD_MAX) for _ in range(count)]
        single = f"{heads}:0/1".encode()
        shard = _complete([f for f in fields if f is not None]).get(heads)
        size = replies.length(replies.line(), b"$")
        if shard is None and size is None:
            return None
        if shard != [single] or size is None:
            raise _Unexpected("not a shard of one segment", in_step=size is None)
        want = header_len + sum(part.nbytes for part in payload)
        if size != want:
            raise ObjectError(f"{size} bytes, expected {want}")
        header = bytearray(header_len)
        replies.into([memoryview(header), *payload])
        replies.end()
        return bytes(header)

    def _failed(self, what: str, exc: BaseException) -> NoReturn:
        if self.options.cluster:
            self._drop_client()
        raise TierError(f"{self.name}: {what} failed: {exc}") from exc

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
            except self._redis.ResponseError as exc:
                if not _wrong_type(exc):
                    raise
                # A key of another type at this chunk's name (ours: prefix, namespace, chunk) holds no shard;
                # the store deletes what get reported as malformed, so the key itself goes.
                return bool(client.unlink(name))
            fields = [f for f in names if (p := _parse_field(f)) and p[0] == key.heads]
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
                if _wrong_type(reply):  # someone's key of another type: no shards of this chunk, the rest stand
                    self._met_wrong_type(namespace, chunk)
                    out.append([])
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    out.append(list(_complete(reply)))
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
        if namespace is not None and not _HEX32.fullmatch(namespace):
            return  # no namespace id looks like that (and no glob characters reach the SCAN pattern)
        # Exactly <prefix><32 hex>:<32 hex>: the glob narrows the scan by length, the regex decides. A shorter
        # prefix of another deployment (``kvtier:`` beside ``kvtier:staging:``) never lists its keys.
        pattern = _escape_glob(self.options.key_prefix) + (namespace or "?" * 32) + ":" + "?" * 32
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
            return pipe.execute(raise_on_error=False)

        replies = self._call("listing", fields_and_idle)
        shards = [(name, heads, segs, idle) for name, idle, fields in zip(batch, replies[::2], replies[1::2])
                  if not isinstance(fields, Exception)  # not a hash: not ours to list
                  for heads, segs in _complete(fields).items()]
        if not shards:
            return

        def lengths(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, _, segs, _ in shards:
                for seg in segs:
                    pipe.hstrlen(name, seg)
            return pipe.execute(raise_on_error=False)

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
                "share_touch_failures": float(self._shares.touch_failures)}

    def close(self) -> None:
        self._drop_client()
