"""The Redis tier: shards in a Redis or Valkey server, or a Redis Cluster, shared by every engine that uses it.

Each chunk is one Redis hash, ``<key_prefix><namespace>:<chunk>``; each shard is stored in that hash under
fields ``<heads>:<i>/<n>``, the object cut into ``n`` segments of at most ``segment_bytes`` (the server's
bulk-length limit is 512 MB by default). A shard is written by one HSET (in one MULTI/EXEC when it has
several segments), so a reader sees all of its segments or none; the server's own eviction (maxmemory)
removes a whole hash, so an evicted shard is a miss, never a partial read. In a cluster the chunks spread over the slots and the client follows MOVED/ASK.

Calls run on the caller's thread with the configured socket timeouts; any Redis error (refused, timed out,
out of memory) is a :class:`TierError`, and the client reconnects by itself on the next call once the server
answers again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.errors import ConfigError, TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.tiers.base import TIERS, Buffer, StoredObject, Tier

# The server's default proto-max-bulk-len; a segment above it is refused by the server.
_MAX_BULK = 512 * 2**20


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

    def check(self, field: str) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"{field}.url: expected a redis://, rediss:// or unix:// URL, got {self.url!r}")
        if self.cluster and self.url.startswith("unix://"):
            raise ConfigError(f"{field}.url: a Redis Cluster is reached over TCP, got {self.url!r}")
        if self.ttl_seconds is not None and self.ttl_seconds <= 0:
            raise ConfigError(f"{field}.ttl_seconds: must be positive, got {self.ttl_seconds}")
        if not 0 < self.segment_bytes <= _MAX_BULK:
            raise ConfigError(f"{field}.segment_bytes: must be in (0, 512MiB], got {self.segment_bytes}")
        for name in ("socket_timeout", "connect_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{field}.{name}: must be positive, got {getattr(self, name)}")
        if self.socket_read_bytes < 4096:
            raise ConfigError(f"{field}.socket_read_bytes: must be at least 4096, got {self.socket_read_bytes}")
        if self.max_connections < 1:
            raise ConfigError(f"{field}.max_connections: must be at least 1, got {self.max_connections}")


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
    try:
        heads, _, seg = field.decode().rpartition(":")
        i, _, n = seg.partition("/")
        return HeadRange.parse(heads), int(i), int(n)
    except (UnicodeDecodeError, ValueError):
        return None


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


def _escape_glob(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@TIERS.register("redis")
class RedisTier(Tier):
    """Shards in Redis / Valkey (one server, or a Redis Cluster with ``cluster: true``)."""

    Options = RedisOptions
    persistent = True  # the data lives in the server, not in this process

    def __init__(self, name: str, options: RedisOptions) -> None:
        super().__init__(name, options)
        try:
            import redis
        except ImportError as exc:
            raise ConfigError(f"{name}: the redis tier needs the 'redis' package (pip install 'kvtier[redis]')") \
                from exc
        self._redis = redis
        self._lock = threading.Lock()
        self._client_obj: Any = None

    # -- connection --------------------------------------------------------------------------------------------
    def _client(self) -> Any:
        """The client, built on first use: a cluster client must reach a node to learn the slots."""
        client = self._client_obj
        if client is not None:
            return client
        o = self.options
        kwargs: dict[str, Any] = dict(socket_timeout=o.socket_timeout, socket_connect_timeout=o.connect_timeout,
                                      socket_read_size=o.socket_read_bytes, max_connections=o.max_connections)
        if o.cluster:  # a cluster client passes on only the connection settings it knows, the class among them
            kwargs["connection_class"] = _connection_class(o.url.startswith("rediss://"))
        else:
            kwargs["command_packer"] = _packer()
        with self._lock:
            if self._client_obj is None:
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                # One immediate retry replaces a pooled connection that the server closed (e.g. a restart);
                # more would only make an outage slower to report.
                retry = Retry(NoBackoff(), 1)
                try:
                    if o.cluster:
                        from redis.cluster import RedisCluster

                        self._client_obj = RedisCluster.from_url(o.url, retry=retry, **kwargs)
                    else:
                        self._client_obj = self._redis.Redis.from_url(o.url, retry=retry, **kwargs)
                except self._redis.RedisError as exc:
                    raise TierError(f"{self.name}: cannot connect to {o.url}: {exc}") from exc
            return self._client_obj

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn(self._client())
        except self._redis.RedisError as exc:
            if self.options.cluster:
                self._drop_client()
            raise TierError(f"{self.name}: {what} failed: {exc}") from exc

    def _drop_client(self) -> None:
        # Also after a cluster error: a cluster client that lost every node keeps a stale slot map, so the next
        # call builds a new one.
        with self._lock:
            client, self._client_obj = self._client_obj, None
        if client is not None:
            try:
                client.close()
            except self._redis.RedisError:
                pass

    def _hash(self, namespace: str, chunk: str) -> str:
        return f"{self.options.key_prefix}{namespace}:{chunk}"

    # -- the tier interface ------------------------------------------------------------------------------------
    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        name = self._hash(key.namespace, key.chunk)
        segments = _segments(parts, self.options.segment_bytes)
        n = len(segments)
        heads = str(key.heads)

        def write(client: Any) -> None:
            # One HSET of one field is atomic by itself; several segments need MULTI/EXEC (which a cluster
            # client runs more slowly).
            pipe = client.pipeline(transaction=n > 1)
            pipe.hset(name, mapping={f"{heads}:{i}/{n}": seg for i, seg in enumerate(segments)})
            if self.options.ttl_seconds is not None:
                pipe.pexpire(name, int(self.options.ttl_seconds * 1000))
            pipe.hkeys(name)
            fields = pipe.execute()[-1]
            # Segments of this shard from an earlier write with another count would never be read; drop them.
            # (Until then a reader may pick either complete set: both are whole, verified objects.)
            stale = [f for f in fields if (p := _parse_field(f)) and p[0] == key.heads and p[2] != n]
            if stale:
                client.hdel(name, *stale)

        self._call(f"put {key.name}", write)

    def get(self, key: ShardKey) -> Buffer | None:
        name = self._hash(key.namespace, key.chunk)

        def read(client: Any) -> Buffer | None:
            # One round trip for the usual one-segment shard: the field list, and that segment if it exists.
            single = f"{key.heads}:0/1"
            pipe = client.pipeline(transaction=False)
            pipe.hkeys(name)
            pipe.hget(name, single)
            names, value = pipe.execute()
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
            values = pipe.execute()
            if any(v is None for v in values):  # evicted or replaced between the two calls
                return None
            return b"".join(values)

        return self._call(f"get {key.name}", read)

    def delete(self, key: ShardKey) -> bool:
        name = self._hash(key.namespace, key.chunk)

        def remove(client: Any) -> bool:
            fields = [f for f in client.hkeys(name) if (p := _parse_field(f)) and p[0] == key.heads]
            return bool(fields) and client.hdel(name, *fields) > 0

        return self._call(f"delete {key.name}", remove)

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        if not chunks:
            return []

        def query(client: Any) -> list[list[HeadRange]]:
            pipe = client.pipeline(transaction=False)
            for chunk in chunks:
                pipe.hkeys(self._hash(namespace, chunk))
            return [list(_complete(fields)) for fields in pipe.execute()]

        return self._call(f"lookup of {len(chunks)} chunks", query)

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        prefix = self.options.key_prefix
        pattern = _escape_glob(prefix) + (namespace if namespace else "*") + ":*"
        names = self._call("listing", lambda c: list(c.scan_iter(match=pattern, count=1000)))
        now = time.time()
        for start in range(0, len(names), 256):
            batch = names[start:start + 256]

            def describe(client: Any) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for n in batch:
                    pipe.hkeys(n)
                    pipe.object("idletime", n)
                return pipe.execute(raise_on_error=False)

            replies = self._call("listing", describe)
            for name, fields, idle in zip(batch, replies[::2], replies[1::2]):
                if isinstance(fields, Exception):
                    continue
                ns, _, chunk = name.decode()[len(prefix):].partition(":")
                for heads, segs in _complete(fields).items():
                    sizes = self._call("listing", lambda c: [c.hstrlen(name, f) for f in segs])
                    # Redis keeps no creation time; the last access stands for both.
                    used = now - (idle if isinstance(idle, int) else 0)
                    yield StoredObject(ShardKey(ns, chunk, heads), sum(sizes), used, used)

    def close(self) -> None:
        self._drop_client()
