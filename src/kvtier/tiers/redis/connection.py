"""The Redis tier's client: built on first use, rebuilt after a cluster error, and the one place a Redis error
becomes a :class:`TierError` (or, for one key of another type, an :class:`ObjectError`).

Calls run on the caller's thread with the configured socket timeouts; the client reconnects by itself on the
next call once the server answers again. A call to a stalled server fails after ``socket_timeout`` (a timeout
is not retried; on one server, a call beyond ``max_connections`` first waits up to ``socket_timeout`` for a free
connection); in a cluster, kvtier sends each command to its key's node itself (:mod:`.routing`), so a call
fails after ``socket_timeout`` at the first stalled node it reaches, and the other nodes' keys are served
meanwhile. Messages show the URL with its password replaced by ``***``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from kvtier.config import redact_url
from kvtier.errors import ConfigError, ObjectError, TierError
from kvtier.tiers.redis.fields import wrong_type
from kvtier.tiers.redis.options import RedisOptions
from kvtier.tiers.redis.routing import NodeHealth, Routed

_T = TypeVar("_T")


def _packer() -> Any:
    """redis-py's own command packer. hiredis's copies every argument into one buffer: 10 ms for a 5.9 MB
    chunk, three times the transfer itself; this one sends large arguments as they are."""
    from redis.connection import Encoder, PythonRespSerializer

    encode = Encoder("utf-8", "strict", False).encode  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
    return PythonRespSerializer(6000, encode)


def _connection_class(tls: bool) -> type:
    """A connection class that packs commands with :func:`_packer` (for cluster clients)."""
    from redis.connection import Connection, SSLConnection

    base = SSLConnection if tls else Connection

    class PackingConnection(base):  # type: ignore[misc, valid-type]  # a base chosen at run time: mypy cannot check it
        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("command_packer", _packer())
            super().__init__(**kwargs)

    return PackingConnection


@dataclasses.dataclass(frozen=True)
class Node:
    """A call to one node of a cluster, as :meth:`Client.pool_for` began it."""

    health: NodeHealth
    node: Any
    began: float


class Client:
    """One tier's Redis client (``tier``: its name, in messages), and how its calls fail."""

    def __init__(self, tier: str, options: RedisOptions) -> None:
        try:
            import redis
        except ImportError as exc:
            raise ConfigError(f"{tier}: the redis tier needs the 'redis' package (pip install 'kvtier[redis]')") \
                from exc
        self.redis = redis
        # RedisClusterException (no slots, no reachable node) is not a RedisError in redis-py.
        self.errors = (redis.RedisError, redis.exceptions.RedisClusterException)
        self._tier = tier
        self._options = options
        self._lock = threading.Lock()
        self._client_obj: Any = None
        self._password: str | None = None
        self._known: list[tuple[str, int]] = []  # a cluster's nodes, as the last client knew them
        self._node_counts = (0, 0)  # node_counters() of the clients dropped
        if options.password_file is not None:
            try:  # read once, at start: a rotated Secret takes a restart, as a changed url does
                with open(options.password_file, encoding="utf-8") as f:
                    self._password = f.read().rstrip("\r\n")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{tier}.password_file: cannot read {options.password_file}: "
                                  f"{type(exc).__name__}") from None

    def get(self) -> Any:
        """The client, built on first use: a cluster client must reach a node to learn the slots."""
        client = self._client_obj
        if client is not None:
            return client
        o = self._options
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
                self._client_obj = self._build(kwargs)
            return self._client_obj

    def _build(self, kwargs: dict[str, Any]) -> Any:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        o = self._options
        try:
            if o.cluster:
                from redis.cluster import RedisCluster

                # Commands bypass the cluster client's retries (see .routing) except for redirections, which
                # it follows without waiting.
                from redis.cluster import ClusterNode

                # After a rebuild, every node the last client knew is asked for the slots too: the url's node may
                # be the one that failed.
                known = [ClusterNode(host, port)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                         for host, port in self._known]
                # (the docs ask for cluster-require-full-coverage no: a client that needs every slot covered
                # could not be built while one primary and its replica are both lost)
                cluster = RedisCluster.from_url(o.url, retry=Retry(NoBackoff(), 0), startup_nodes=known,
                                                require_full_coverage=False, **kwargs)
                self._known = [(n.host, n.port)
                               for n in cluster.get_nodes()]  # type: ignore[no-untyped-call]  # (as ClusterNode)
                return Routed(cluster, self._tier)
            # One immediate retry replaces a pooled connection that the server closed (a restart). Not after a
            # timeout: the server is stalled, and a second wait would double the time a caller waits for it (a
            # call fails after socket_timeout, not twice that).
            retry = Retry(NoBackoff(), 1, supported_errors=(self.redis.ConnectionError,))
            # A call waits up to socket_timeout for a free connection when max_connections are in use (reads
            # ahead, writers and lookups at once), where the default pool fails it (an outage for the tier).
            pool = self.redis.BlockingConnectionPool.from_url(o.url, retry=retry, timeout=o.socket_timeout, **kwargs)
            client = self.redis.Redis(connection_pool=pool)
            client.auto_close_connection_pool = True
            return client
        except Exception as exc:  # whatever building the client raises is a TierError
            # A cluster client connects here and raises RedisClusterException (no node answers, or the node is
            # not in cluster mode); leaving it unwrapped would fail every call outside the store's outage
            # handling.
            raise TierError(f"{self._tier}: cannot connect to {redact_url(o.url)}: {exc}") from exc

    def call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        """``fn(client)``; a Redis error raised as a :class:`TierError` naming ``what``."""
        try:
            return fn(self.get())
        except self.errors as exc:
            if wrong_type(exc):  # one key of another type: the server is fine
                raise ObjectError(f"{self._tier}: {what}: the key is not a hash (WRONGTYPE)") from exc
            self.failed(what, exc)

    def failed(self, what: str, exc: BaseException) -> NoReturn:
        if self._options.cluster and not isinstance(exc, self.redis.TimeoutError):
            # A node that closed its connections, or slots no node serves: the slots may have moved (a
            # failover), so the next call builds a client that asks for them. A timeout is a stalled node,
            # whose slots stand; the client keeps serving the other nodes' keys.
            self.drop()
        raise TierError(f"{self._tier}: {what} failed: {exc}") from exc

    def node_counters(self) -> dict[str, float]:
        """A cluster's node failures (calls failed or skipped for a failing node) and slot maps asked for after
        them; nothing for one server."""
        if not self._options.cluster:
            return {}
        failures, refreshes = self._node_counts
        client = self._client_obj
        if isinstance(client, Routed):
            failures, refreshes = failures + client.health.part_failures, refreshes + client.health.refreshes
        return {"node_failures": float(failures), "slot_map_refreshes": float(refreshes)}

    def pool_for(self, name: str) -> tuple[Any, Node | None]:
        """The connection pool of the node that holds key ``name``, and that node's call (None on one server);
        raises :class:`~kvtier.errors.PartUnavailable` while that node rests after a failure."""
        client = self.get()
        if not isinstance(client, Routed):
            return client.connection_pool, None
        node = client.cluster.get_node_from_key(name)
        began = client.health.check(node)
        return client.cluster.get_redis_connection(node).connection_pool, Node(client.health, node, began)

    def node_failed(self, call: Node | None, what: str, exc: BaseException) -> NoReturn:
        """A call from :meth:`pool_for` failed: its node's outage (on one server, or another error:
        :meth:`failed`)."""
        if call is None or not isinstance(exc, call.health.failures + (OSError,)):
            self.failed(what, exc)
        call.health.failed(call.node, exc, call.began)

    @staticmethod
    def node_succeeded(call: Node | None) -> None:
        if call is not None:
            call.health.succeeded(call.node, call.began)

    def drop(self) -> None:
        # Also after a cluster error: a cluster client that lost every node keeps a stale slot map, so the next
        # call builds a new one.
        with self._lock:
            client, self._client_obj = self._client_obj, None
        if isinstance(client, Routed):
            failures, refreshes = self._node_counts
            self._node_counts = (failures + client.health.part_failures, refreshes + client.health.refreshes)
            try:
                self._known = [(n.host, n.port) for n in client.cluster.get_nodes()] or self._known
            except Exception:  # noqa: BLE001 (a client being torn down): the nodes known before stand
                pass
        if client is not None:
            try:
                client.close()
            except self.errors:
                pass
