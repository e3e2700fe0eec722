"""The redis tier meets keys and fields it did not write: one bad object is a miss for that object (or an
ObjectError the store counts and removes), never an outage of the tier, and listings see only kvtier's keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kvtier import ObjectError, RedisTier
from kvtier.keys import HeadRange
from kvtier.testing.servers import RedisCluster, RedisServer
from kvtier.testing.tiers import NS_A, key

H = HeadRange(0, 4, 4)


@pytest.fixture(params=["redis_server", "redis_cluster"])
def server(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def cli(server: RedisServer | RedisCluster, *args: str) -> str:
    """redis-cli against the node that holds the key ``args[1]`` (-c follows MOVED in a cluster)."""
    node = server.nodes[0] if isinstance(server, RedisCluster) else server
    return node.cli("-c", *args) if isinstance(server, RedisCluster) else node.cli(*args)


def raw(server: RedisServer | RedisCluster, command: str, *args: bytes) -> None:
    """A command with binary arguments (redis-cli cannot send non-UTF-8 bytes), through redis-py."""
    import redis
    from redis.cluster import RedisCluster as Client

    client = Client.from_url(server.url) if isinstance(server, RedisCluster) else redis.Redis.from_url(server.url)
    try:
        client.execute_command(command, *args)
    finally:
        client.close()


@pytest.fixture
def tier(server: RedisServer | RedisCluster, unique_prefix: str) -> Iterator[RedisTier]:
    tier = RedisTier.from_config("redis", {"url": server.url, "cluster": isinstance(server, RedisCluster),
                                           "key_prefix": unique_prefix}, "tiers[0]")
    assert isinstance(tier, RedisTier)
    yield tier
    tier.close()


def hash_name(tier: RedisTier, chunk: int) -> str:
    return f"{tier.options.key_prefix}{NS_A}:{key(chunk).chunk}"


def test_a_wrong_type_key_has_no_heads_and_the_rest_of_the_lookup_stands(server, tier: RedisTier) -> None:
    tier.put(key(1), [b"one"])
    tier.put(key(3), [b"three"])
    assert "OK" in cli(server, "set", hash_name(tier, 2), "someone else's string")
    chunks = [key(i).chunk for i in (1, 2, 3)]
    assert tier.heads(NS_A, chunks) == [[H], [], [H]]
    assert tier.counters()["wrong_type_keys"] == 1


def test_get_of_a_wrong_type_key_is_an_object_error_and_delete_removes_it(server, tier: RedisTier) -> None:
    for i, command in enumerate([("set", "x"), ("rpush", "x"), ("sadd", "x")]):
        name = hash_name(tier, 10 + i)
        cli(server, command[0], name, command[1])
        with pytest.raises(ObjectError, match="WRONGTYPE"):
            tier.get(key(10 + i))
        assert tier.delete(key(10 + i)) is True  # what the store does with an ObjectError
        assert cli(server, "exists", name).strip() == "0"
        assert tier.get(key(10 + i)) is None


def test_a_put_replaces_a_wrong_type_key(server, tier: RedisTier) -> None:
    cli(server, "set", hash_name(tier, 20), "x")
    tier.put(key(20), [b"kv"])
    assert bytes(tier.get(key(20)) or b"") == b"kv"
    options = {**dataclasses.asdict(tier.options), "segment_bytes": 4}
    segmented = RedisTier.from_config("redis", options, "tiers[0]")
    cli(server, "set", hash_name(tier, 21), "x")
    segmented.put(key(21), [b"three segments"])  # MULTI/EXEC
    assert bytes(segmented.get(key(21)) or b"") == b"three segments"
    segmented.close()


def test_fields_that_are_not_exactly_ours_are_ignored(server, tier: RedisTier) -> None:
    tier.put(key(30, HeadRange(0, 2, 4)), [b"lo"])
    name = hash_name(tier, 30).encode()
    junk = [b"2-4of4:5/2", b"2-4of4:7/2",  # as many fields as segments, but not segments 0 and 1
            b"2-4of4:-1/1", b"2-4of4: 0/1", b"+2-4of4:0/1", b"2-4of4:0/1 ", b"\xff\xfe:0/1", b"2-4of4:\xd9\xa1/1",
            b"4-2of4:0/1", b"2-4of4:0/0", b"x"]
    raw(server, "HSET", name, *[part for field in junk for part in (field, b"junk")])
    assert tier.heads(NS_A, [key(30).chunk]) == [[HeadRange(0, 2, 4)]]
    assert tier.get(key(30, HeadRange(2, 4, 4))) is None
    assert bytes(tier.get(key(30, HeadRange(0, 2, 4))) or b"") == b"lo"
    assert [o.key for o in tier.list()] == [key(30, HeadRange(0, 2, 4))]
    assert tier.delete(key(30, HeadRange(2, 4, 4))) is False
    assert tier.delete(key(30, HeadRange(0, 2, 4))) is True


def test_listing_never_reaches_a_longer_prefix(server, tier: RedisTier, unique_prefix: str) -> None:
    """``purge --all`` of a deployment with prefix P must not touch the deployment with prefix P + "staging:"."""
    options = {**dataclasses.asdict(tier.options), "key_prefix": unique_prefix + "staging:"}
    staging = RedisTier.from_config("redis", options, "tiers[0]")
    staging.put(key(40), [b"staging's"])
    tier.put(key(41), [b"ours"])
    assert [o.key for o in tier.list()] == [key(41)]
    for obj in list(tier.list()):
        tier.delete(obj.key)
    assert [o.key for o in staging.list()] == [key(40)]
    assert bytes(staging.get(key(40)) or b"") == b"staging's"
    staging.close()


def test_listing_skips_names_that_are_not_prefix_hex_colon_hex(server, tier: RedisTier, unique_prefix: str) -> None:
    tier.put(key(41), [b"ours"])
    p = unique_prefix.encode()
    ns, chunk = NS_A.encode(), key(42).chunk.encode()
    for name in [p + ns + b":" + chunk + b":x", p + ns + b":not-hex", p + b"\xff:" + chunk,
                 p + ns.upper() + b":" + chunk, p + ns + b"\xff:" + chunk]:
        raw(server, "HSET", name, b"0-4of4:0/1", b"not ours")
    assert [o.key for o in tier.list()] == [key(41)]
    assert [o.key for o in tier.list(NS_A)] == [key(41)]
    assert list(tier.list("*")) == [] and list(tier.list("")) == []


def test_get_into_meets_other_writers_keys_and_the_connection_stays_in_step(server, tier: RedisTier) -> None:
    """Read straight from the socket, a bad reply must neither be half taken for KV nor leave unread bytes on a
    pooled connection for the next read to take for its own."""
    good = b"h" * 96 + b"k" * 5000
    tier.put(key(50), [good])
    tier._get = None  # type: ignore[assignment, method-assign]  # every read below is get_into's own

    def read(chunk: int, size: int = len(good)) -> bytes | None:
        pages = bytearray(size - 96)
        head = tier.get_into(key(chunk), 96, [memoryview(pages)])
        assert head is None or head + pages == good
        return head

    cli(server, "set", hash_name(tier, 51), "x")
    with pytest.raises(ObjectError, match="WRONGTYPE"):
        read(51)
    assert read(50) == good[:96]
    with pytest.raises(ObjectError, match="expected"):  # another size than the caller's entry
        read(50, size=len(good) + 1)
    assert read(50) == good[:96]
    # Fields that are not ours, one of them longer than any of ours (read past): still the shard.
    raw(server, "HSET", hash_name(tier, 50).encode(), b"f" * 5000, b"junk", b"0-4of4:0/1x", b"junk")
    assert read(50) == good[:96]
    raw(server, "HSET", hash_name(tier, 52).encode(), b"0-4of4:1/2", b"half a shard")
    assert read(52) is None
    assert read(50) == good[:96]
