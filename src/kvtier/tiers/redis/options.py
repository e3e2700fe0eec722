"""The Redis tier's options: what a config may say, checked at load time, before anything connects."""

from __future__ import annotations

import dataclasses
import math
import urllib.parse

from kvtier.config import check_url_port, redact_url
from kvtier.errors import ConfigError

# The server's default proto-max-bulk-len; a segment above it is refused by the server.
MAX_BULK = 512 * 2**20
_MAX_CONNECTIONS = 1024  # per process; more is a typo, and each one is a socket and a buffer


@dataclasses.dataclass(frozen=True)
class RedisOptions:
    """The keys of a ``type: redis`` tier: Redis 7 or Valkey, one server or a Redis Cluster."""

    url: str = dataclasses.field(default="redis://127.0.0.1:6379/0", metadata={
        "help": "redis://, rediss:// (TLS) or unix:// URL of the server (of any node, in a cluster)"})
    cluster: bool = dataclasses.field(default=False, metadata={
        "help": "true: a Redis Cluster (url names any node; MOVED/ASK are followed)"})
    key_prefix: str = dataclasses.field(default="kvtier:", metadata={
        "help": "keys are <prefix><namespace id>:<chunk key>, one hash per chunk"})
    ttl_seconds: float | None = dataclasses.field(default=None, metadata={
        "help": "expire a chunk this long after its last write (never served older); null: no limit"})
    segment_bytes: int = dataclasses.field(default=256 * 2**20, metadata={
        "help": "an object is stored in fields of at most this size (the server's limit: 512 MiB)"})
    socket_timeout: float = dataclasses.field(default=5.0, metadata={
        "help": "seconds per command (a timed-out command is not retried)"})
    connect_timeout: float = dataclasses.field(default=1.0, metadata={"help": "seconds to open a connection"})
    socket_read_bytes: int = dataclasses.field(default=65536, metadata={
        "help": "read size of the reply parser (at least 4096; larger measured no faster)"})
    max_connections: int = dataclasses.field(default=32, metadata={
        "help": "connections per node (1-1024); one server: a call beyond them waits up to socket_timeout for one"})
    # A file holding the password (e.g. a mounted Kubernetes Secret): the config itself then holds no secret.
    password_file: str | None = dataclasses.field(default=None, metadata={
        "help": "absolute path of a file holding the password (a mounted Secret), read at start"})

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
        if not 0 < self.segment_bytes <= MAX_BULK:
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
