"""The redis tier against a real redis-server on loopback, one node and a three-node Redis Cluster."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier import ConfigError, RedisTier, TierError
from kvtier.keys import HeadRange
from kvtier.testing.servers import RedisCluster, RedisServer, free_port
from kvtier.testing.tiers import NS_A, TierConformance, key


def open_tier(url: str, **options: object) -> RedisTier:
    tier = RedisTier.from_config("redis", {"url": url, **options}, "tiers[0]")
    assert isinstance(tier, RedisTier)
    return tier


class TestRedisConformance(TierConformance):
    @pytest.fixture
    def tier_config(self, redis_server: RedisServer, unique_prefix: str) -> dict[str, object]:
        return {"type": "redis", "url": redis_server.url, "key_prefix": unique_prefix}

    @pytest.fixture
    def tier(self, redis_server: RedisServer, unique_prefix: str) -> Iterator[RedisTier]:
        tier = open_tier(redis_server.url, key_prefix=unique_prefix)
        yield tier
        tier.close()

    @pytest.fixture
    def reopen(self, redis_server: RedisServer, unique_prefix: str):
        def reopen(old: RedisTier) -> RedisTier:
            old.close()
            return open_tier(redis_server.url, key_prefix=unique_prefix)
        return reopen


class TestRedisClusterConformance(TierConformance):
    @pytest.fixture
    def tier_config(self, redis_cluster, unique_prefix: str) -> dict[str, object]:
        return {"type": "redis", "url": redis_cluster.url, "cluster": True, "key_prefix": unique_prefix}

    @pytest.fixture
    def tier(self, redis_cluster, unique_prefix: str) -> Iterator[RedisTier]:
        tier = open_tier(redis_cluster.url, cluster=True, key_prefix=unique_prefix)
        yield tier
        tier.close()

    @pytest.fixture
    def reopen(self, redis_cluster, unique_prefix: str):
        def reopen(old: RedisTier) -> RedisTier:
            old.close()
            return open_tier(redis_cluster.url, cluster=True, key_prefix=unique_prefix)
        return reopen


def test_cluster_spreads_chunks_over_every_node(redis_cluster, unique_prefix: str) -> None:
    tier = open_tier(redis_cluster.url, cluster=True, key_prefix=unique_prefix)
    for i in range(60):
        tier.put(key(i), [bytes([i]) * 100])
    counts = [int(node.cli("dbsize").strip()) for node in redis_cluster.nodes]
    assert all(c > 0 for c in counts) and sum(counts) >= 60
    assert all(bytes(tier.get(key(i)) or b"") == bytes([i]) * 100 for i in range(60))
    tier.close()


def _move_slot(cluster: RedisCluster, name: str, between: Callable[[], None]) -> None:
    """Reshard ``name``'s slot to another node as redis-cli --cluster reshard does; ``between`` runs after the
    key moved and before the nodes are told (the source then answers ASK)."""
    slot = cluster.nodes[0].cli("cluster", "keyslot", name).strip()
    owner = next(n for n in cluster.nodes if n.cli("cluster", "countkeysinslot", slot).strip() == "1")
    target = next(n for n in cluster.nodes if n is not owner)
    owner_id, target_id = owner.cli("cluster", "myid").strip(), target.cli("cluster", "myid").strip()
    assert target.cli("cluster", "setslot", slot, "importing", owner_id).strip() == "OK"
    assert owner.cli("cluster", "setslot", slot, "migrating", target_id).strip() == "OK"
    assert owner.cli("migrate", "127.0.0.1", str(target.port), "", "0", "5000", "keys", name).strip() == "OK"
    between()
    for node in (target, owner, *(n for n in cluster.nodes if n not in (owner, target))):
        assert node.cli("cluster", "setslot", slot, "node", target_id).strip() == "OK"


def test_a_resharded_cluster_is_followed_by_a_client_that_knew_the_old_slots(tmp_path: Path) -> None:
    """kvtier sends each command to its node itself; a node's MOVED or ASK (a resharding) sends the call through
    the cluster client, which follows it: no call fails, and the client learns the new owner."""
    cluster = RedisCluster(tmp_path).start()
    try:
        tier = open_tier(cluster.url, cluster=True)
        tier.put(key(1), [b"a" * 300])
        name = f"kvtier:{NS_A}:{key(1).chunk}"
        assert bytes(tier.get(key(1)) or b"") == b"a" * 300  # the slot map is learnt: the old owner
        asked = []
        _move_slot(cluster, name, lambda: asked.append(bytes(tier.get(key(1)) or b"")))  # ASK: still migrating
        assert asked == [b"a" * 300]
        payload = bytearray(300)
        assert tier.get_into(key(1), 0, [memoryview(payload)]) == b"" and payload == b"a" * 300  # MOVED
        assert tier.heads(NS_A, [key(1).chunk]) == [[key(1).heads]]
        other = key(1, heads=HeadRange(0, 4, 8))
        tier.put(other, [b"b" * 200])  # a write the new owner takes
        assert bytes(tier.get(other) or b"") == b"b" * 200
        assert tier.delete(key(1)) and tier.get(key(1)) is None
        tier.close()
    finally:
        cluster.stop()


def test_large_objects_are_cut_into_segments(redis_server: RedisServer, unique_prefix: str) -> None:
    tier = open_tier(redis_server.url, key_prefix=unique_prefix, segment_bytes=4096)
    blob = os.urandom(10_000)
    tier.put(key(1), [blob[:100], blob[100:]])
    fields = redis_server.cli("hkeys", f"{unique_prefix}{NS_A}:{key(1).chunk}").split()
    assert sorted(fields) == ["0-4of4:0/3", "0-4of4:1/3", "0-4of4:2/3"]
    assert bytes(tier.get(key(1)) or b"") == blob
    tier.put(key(1), [b"short"])  # a rewrite with fewer segments leaves none of the old ones behind
    assert redis_server.cli("hkeys", f"{unique_prefix}{NS_A}:{key(1).chunk}").split() == ["0-4of4:0/1"]
    assert bytes(tier.get(key(1)) or b"") == b"short"
    tier.close()


def test_a_missing_segment_is_a_miss_not_a_partial_read(redis_server: RedisServer, unique_prefix: str) -> None:
    tier = open_tier(redis_server.url, key_prefix=unique_prefix, segment_bytes=4096)
    tier.put(key(2), [os.urandom(10_000)])
    redis_server.cli("hdel", f"{unique_prefix}{NS_A}:{key(2).chunk}", "0-4of4:1/3")
    assert tier.get(key(2)) is None
    assert tier.heads(NS_A, [key(2).chunk]) == [[]]
    tier.close()


def test_ttl_expires_keys(redis_server: RedisServer, unique_prefix: str) -> None:
    tier = open_tier(redis_server.url, key_prefix=unique_prefix, ttl_seconds=1.5)  # (past a loaded machine's pause)
    tier.put(key(3), [b"short-lived"])
    assert tier.get(key(3)) is not None
    time.sleep(1.7)
    assert tier.get(key(3)) is None and tier.heads(NS_A, [key(3).chunk]) == [[]]
    tier.close()


def test_key_prefixes_separate_deployments(redis_server: RedisServer, unique_prefix: str) -> None:
    a = open_tier(redis_server.url, key_prefix=unique_prefix + "a:")
    b = open_tier(redis_server.url, key_prefix=unique_prefix + "b:")
    a.put(key(4), [b"from a"])
    assert b.get(key(4)) is None and b.heads(NS_A, [key(4).chunk]) == [[]] and list(b.list()) == []
    assert [o.key for o in a.list()] == [key(4)]
    a.close()
    b.close()


def test_server_eviction_is_a_miss_never_a_partial_read(tmp_path: Path, unique_prefix: str) -> None:
    server = RedisServer(tmp_path / "small", maxmemory="4mb").start()
    try:
        tier = open_tier(server.url, key_prefix=unique_prefix, segment_bytes=32 * 1024)
        blobs = {i: os.urandom(100_000) for i in range(120)}  # 12 MB into 4 MB
        for i, blob in blobs.items():
            tier.put(key(i, HeadRange(0, 1, 1)), [blob])
        found = 0
        for i, blob in blobs.items():
            got = tier.get(key(i, HeadRange(0, 1, 1)))
            assert got is None or bytes(got) == blob
            found += got is not None
        assert 0 < found < len(blobs)
        tier.close()
    finally:
        server.stop()


@pytest.mark.parametrize("options, message", [
    ({"url": "http://x"}, "tiers[0].url"),
    ({"url": "unix:///tmp/r.sock", "cluster": True}, "tiers[0].url"),
    ({"segment_bytes": "1GiB"}, "tiers[0].segment_bytes"),
    ({"ttl_seconds": 0}, "tiers[0].ttl_seconds"),
    ({"socket_read_bytes": 10}, "tiers[0].socket_read_bytes"),
    ({"colour": "red"}, "colour"),
    # Caught when the config is read, not on every call later (redis-py parses the URL on first use):
    ({"url": "redis://127.0.0.1:70000/0"}, "tiers[0].url: the port"),
    ({"url": "redis://127.0.0.1:0/0"}, "tiers[0].url: the port"),
    ({"url": "redis://127.0.0.1:notaport/0"}, "tiers[0].url: the port"),
    ({"url": "redis://127.0.0.1:6379/zero"}, "tiers[0].url: the path"),
    ({"url": "redis://127.0.0.1:6379/0?socket_timeout=soon"}, "tiers[0].url: redis-py cannot use"),
    ({"url": "redis://127.0.0.1:6379/0?colour=red"}, "tiers[0].url: redis-py cannot use"),
    ({"url": "redis://127.0.0.1:7000/1", "cluster": True}, "tiers[0].url: a Redis Cluster has only database 0"),
    ({"max_connections": 100_000}, "tiers[0].max_connections"),
    ({"socket_timeout": float("inf")}, "tiers[0].socket_timeout"),
    ({"connect_timeout": float("nan")}, "tiers[0].connect_timeout"),
    ({"ttl_seconds": float("inf")}, "tiers[0].ttl_seconds"),
])
def test_bad_options_name_the_field(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RedisTier.from_config("redis", options, "tiers[0]")


@pytest.mark.parametrize("url", [
    "redis://:hunter2-pw@127.0.0.1:70000/0",
    "redis://kv:hunter2-pw@127.0.0.1:notaport/0",
    "redis://kv:hunter2-pw@127.0.0.1:6379/zero",
    "redis://:hunter2/pw@127.0.0.1:6379/0",  # an unescaped '/' ends the host part for URL parsers
    "redis://hunter2-pw@127.0.0.1:70000/0",  # a password written without its colon
    "redis://127.0.0.1:6379/0?password=hunter2-pw&colour=red",
    "http://:hunter2-pw@127.0.0.1:6379/0",
])
def test_config_errors_never_show_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        RedisTier.from_config("redis", {"url": url}, "tiers[0]")
    assert "hunter2" not in str(info.value) and "tiers[0].url" in str(info.value), str(info.value)


@pytest.mark.parametrize("cluster", [False, True])
def test_connection_errors_never_show_the_password(cluster: bool) -> None:
    tier = open_tier(f"redis://kv:hunter2-pw@127.0.0.1:{free_port()}/0", cluster=cluster)  # nothing listens
    with pytest.raises(TierError) as info:
        tier.heads(NS_A, [key(1).chunk])
    assert "hunter2" not in str(info.value), str(info.value)
    tier.close()


def test_cluster_mode_against_a_plain_server_is_a_tier_error(redis_server: RedisServer) -> None:
    """redis-py raises RedisClusterException (not a RedisError) from building the client, on every call."""
    tier = open_tier(redis_server.url, cluster=True)
    for _ in range(2):
        with pytest.raises(TierError, match="cannot connect to .*Cluster mode is not enabled"):
            tier.heads(NS_A, [key(1).chunk])
    tier.close()


def read_into(tier: RedisTier, k, size: int, header: int = 96) -> tuple[bytes | None, bytes]:
    """get_into over two buffers (as DRAM pages of one entry): the header and the payload it wrote."""
    pages = [bytearray(size // 3), bytearray(size - header - size // 3)]
    head = tier.get_into(k, header, [memoryview(p) for p in pages])
    return head, b"".join(pages)


@pytest.mark.parametrize("kind", ["redis_server", "redis_cluster"])
def test_get_into_reads_one_segment_itself_and_the_rest_through_get(kind: str, request, unique_prefix: str) -> None:
    server = request.getfixturevalue(kind)
    cluster = kind == "redis_cluster"
    tier = open_tier(server.url, cluster=cluster, key_prefix=unique_prefix)
    segmented = open_tier(server.url, cluster=cluster, key_prefix=unique_prefix, segment_bytes=4096)
    blobs = {i: os.urandom(10_000 + i) for i in range(8)}
    for i, blob in blobs.items():
        (segmented if i % 2 else tier).put(key(i), [blob])
    fallbacks = []
    through_get = tier._get  # the whole read, under get's share accounting

    def get(k):
        fallbacks.append(k)
        return through_get(k)

    tier._get = get  # type: ignore[method-assign]
    for i, blob in blobs.items():
        assert read_into(tier, key(i), len(blob)) == (blob[:96], blob[96:])
    assert fallbacks == [key(i) for i in blobs if i % 2]  # one segment: read from the socket, not through get
    # Another head range of a stored chunk is absent (one round trip, no fallback); so is an unknown chunk.
    assert tier.get_into(key(0, HeadRange(0, 2, 4)), 96, [memoryview(bytearray(8))]) is None
    assert tier.get_into(key(99), 96, [memoryview(bytearray(8))]) is None
    assert len(fallbacks) == 4
    tier.close()
    segmented.close()


def test_reads_ahead_beyond_max_connections_wait_for_one(redis_server: RedisServer, unique_prefix: str) -> None:
    """A store reads a load's shards several at a time; with fewer connections than that, each read waits for a free
    one (the default pool would fail it: an outage for the tier) and the load is whole and exact."""
    import torch

    from kvtier import KVStore, Namespace
    from kvtier.testing import synthetic_kv, synthetic_tokens

    ns = Namespace(model="m", dtype="bfloat16")
    cfg = {"chunk_tokens": 16, "dram": {"capacity_bytes": "8MiB"},
           "tiers": [{"type": "redis", "url": redis_server.url, "key_prefix": unique_prefix, "max_connections": 1}]}
    tokens = synthetic_tokens(3, 8 * 16)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(cfg) as store:
        store.put(ns, tokens, kv)
        store.flush()
        for _ in range(3):
            store.drop_dram()
            assert torch.equal(store.get(ns, tokens), kv)
        stats = store.stats()["redis"]
        assert stats["read_errors_total"] == 0 and stats["hit_chunks_total"] == 3 * 8


def test_get_into_after_a_restart_reconnects(tmp_path: Path, unique_prefix: str) -> None:
    server = RedisServer(tmp_path / "restart").start()
    try:
        tier = open_tier(server.url, key_prefix=unique_prefix)
        blob = os.urandom(50_000)
        tier.put(key(1), [blob])
        assert read_into(tier, key(1), len(blob))[0] == blob[:96]  # a pooled connection
        server.stop()
        server.start()  # empty (no persistence): the pooled connection is dead, the next call needs a new one
        assert tier.get_into(key(1), 96, [memoryview(bytearray(len(blob) - 96))]) is None
        tier.put(key(1), [blob])
        assert read_into(tier, key(1), len(blob)) == (blob[:96], blob[96:])
        tier.close()
    finally:
        server.stop()


class CuttingServer:
    """A fault a real server does not make on demand: a RESP server that answers a shard's read with the start of
    its reply, then closes the connection (``stall=False``) or says nothing more (``stall=True``)."""

    def __init__(self, size: int, *, stall: bool) -> None:
        self.size, self.stall, self.reads = size, stall, 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        while True:
            try:
                got = conn.recv(65536)
            except OSError:
                return
            if not got:
                return
            data += got
            if b"HELLO" in data:  # the client's handshake: RESP3
                conn.sendall(b"%1\r\n+proto\r\n:3\r\n")
                data = b""
                continue
            if b"HGET" not in data:  # the rest of it (CLIENT SETINFO ...): one +OK per command
                conn.sendall(b"+OK\r\n" * data.count(b"*"))
                data = b""
                continue
            self.reads += 1
            field = f"{key(1).heads}:0/1".encode()
            conn.sendall(b"*1\r\n$%d\r\n%s\r\n$%d\r\n" % (len(field), field, self.size) + b"x" * (self.size // 2))
            if not self.stall:
                conn.close()
                return

    def close(self) -> None:
        self._listener.close()
        for conn in self._open:
            conn.close()


@pytest.mark.parametrize("stall", [False, True])
def test_a_reply_cut_short_is_a_tier_error(stall: bool) -> None:
    size = 200_000
    server = CuttingServer(size, stall=stall)
    try:
        tier = open_tier(f"redis://127.0.0.1:{server.port}/0", socket_timeout=0.5)
        start = time.monotonic()
        with pytest.raises(TierError, match="get"):
            tier.get_into(key(1), 96, [memoryview(bytearray(size - 96))])
        # A closed connection is tried once more on a new one (a restart looks the same); a stalled one is not.
        assert server.reads == (1 if stall else 2)
        assert time.monotonic() - start < (1.5 if stall else 1.0)
        tier.close()
    finally:
        server.close()


def test_a_password_from_a_file_keeps_the_config_free_of_secrets(redis_server: RedisServer, tmp_path,
                                                                  unique_prefix: str) -> None:
    """``password_file`` (e.g. a mounted Kubernetes Secret): the tier authenticates with the file's password (one
    trailing newline ignored); a wrong one is a TierError that never shows it; bad options name the field."""
    user = "kvtierpwtest"
    redis_server.cli("ACL", "SETUSER", user, "on", ">s3cret-pw", "~*", "+@all")
    url = redis_server.url.replace("redis://", f"redis://{user}@")
    good = tmp_path / "password"
    good.write_text("s3cret-pw\n")
    tier = open_tier(url, key_prefix=unique_prefix, password_file=str(good))
    tier.put(key(1), [b"payload"])
    assert bytes(tier.get(key(1))) == b"payload"
    tier.close()
    wrong = tmp_path / "wrong"
    wrong.write_text("not-it")
    tier = open_tier(url, key_prefix=unique_prefix, password_file=str(wrong))
    with pytest.raises(TierError) as info:
        tier.get(key(1))
    assert "not-it" not in str(info.value)
    tier.close()
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.password_file: an absolute path"):
        open_tier(url, password_file="password")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.password_file: the url holds a password too"):
        open_tier(redis_server.url.replace("redis://", "redis://:pw@"), password_file=str(good))
    with pytest.raises(ConfigError, match=r"redis\.password_file: cannot read"):
        open_tier(url, password_file=str(tmp_path / "missing"))
