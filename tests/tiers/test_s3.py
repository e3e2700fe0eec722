"""The s3 tier against a real S3-compatible server (SeaweedFS) on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier import ConfigError, S3Tier
from kvtier.keys import HeadRange
from kvtier.testing.servers import S3Server
from kvtier.testing.tiers import NS_A, TierConformance, key


def open_tier(server: S3Server, **options: object) -> S3Tier:
    tier = S3Tier.from_config("s3", {**server.tier_options(), **options}, "tiers[0]")
    assert isinstance(tier, S3Tier)
    return tier


class TestS3Conformance(TierConformance):
    @pytest.fixture
    def tier_config(self, s3_server: S3Server, unique_prefix: str) -> dict[str, object]:
        return {"type": "s3", **s3_server.tier_options(), "prefix": unique_prefix}

    @pytest.fixture
    def tier(self, s3_server: S3Server, unique_prefix: str) -> Iterator[S3Tier]:
        tier = open_tier(s3_server, prefix=unique_prefix)
        yield tier
        tier.close()

    @pytest.fixture
    def reopen(self, s3_server: S3Server, unique_prefix: str):
        def reopen(old: S3Tier) -> S3Tier:
            old.close()
            return open_tier(s3_server, prefix=unique_prefix)
        return reopen


def test_credentials_from_the_environment(s3_server: S3Server, unique_prefix: str, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-env")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-env-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    tier = S3Tier.from_config("s3", {"endpoint_url": s3_server.endpoint_url, "bucket": "kvtier",
                                     "prefix": unique_prefix, "create_bucket": True}, "tiers[0]")
    tier.put(key(1), [b"hello"])
    assert bytes(tier.get(key(1)) or b"") == b"hello"
    tier.close()


def test_prefixes_separate_deployments(s3_server: S3Server, unique_prefix: str) -> None:
    a = open_tier(s3_server, prefix=unique_prefix + "a/")
    b = open_tier(s3_server, prefix=unique_prefix + "b/")
    a.put(key(2), [b"from a"])
    assert b.get(key(2)) is None and b.heads(NS_A, [key(2).chunk]) == [[]] and list(b.list()) == []
    a.close()
    b.close()


def raw_put(server: S3Server, name: str) -> None:
    """An object that kvtier did not write, put with boto3 itself."""
    import boto3

    o = server.tier_options()
    client = boto3.client("s3", endpoint_url=o["endpoint_url"], aws_access_key_id=o["access_key_id"],
                          aws_secret_access_key=o["secret_access_key"], region_name=o["region"])
    client.put_object(Bucket=o["bucket"], Key=name, Body=b"not kvtier's")
    client.close()


def test_only_exact_names_are_shards(s3_server: S3Server, unique_prefix: str) -> None:
    """<prefix><32 hex>/<32 hex>/<heads> and nothing else: a ``purge --all`` never reaches other objects."""
    tier = open_tier(s3_server, prefix=unique_prefix)
    tier.put(key(1), [b"ours"])
    chunk = key(1).chunk
    for name in [f"{NS_A}/{chunk}/old/0-4of4", f"notes/{chunk}/0-4of4", f"{NS_A}/not-hex/0-4of4",
                 f"{NS_A}/{chunk}/0-4of4.bak", f"{NS_A}/{chunk}/+0-4of4", f"{NS_A}/{key(2).chunk}/4-0of4"]:
        raw_put(s3_server, unique_prefix + name)
    assert tier.heads(NS_A, [chunk, key(2).chunk]) == [[HeadRange(0, 4, 4)], []]
    assert [o.key for o in tier.list()] == [key(1)]
    assert [o.key for o in tier.list(NS_A)] == [key(1)] and list(tier.list("")) == []
    tier.close()


def test_a_shorter_prefix_never_lists_a_longer_one(s3_server: S3Server, unique_prefix: str) -> None:
    ours = open_tier(s3_server, prefix=unique_prefix)
    staging = open_tier(s3_server, prefix=unique_prefix + "staging/")
    staging.put(key(3), [b"staging's"])
    raw_put(s3_server, f"{unique_prefix}staging/{key(3).chunk}/0-4of4")  # would parse as namespace "staging"
    assert list(ours.list()) == []
    assert [o.key for o in staging.list()] == [key(3)]
    ours.close()
    staging.close()


@pytest.mark.parametrize("options, message", [
    ({}, "tiers[0].bucket"),
    ({"bucket": "b", "access_key_id": "x"}, "access_key_id/secret_access_key"),
    ({"bucket": "b", "prefix": "no-slash"}, "tiers[0].prefix"),
    ({"bucket": "b", "addressing_style": "sideways"}, "tiers[0].addressing_style"),
    ({"bucket": "b", "endpoint_url": "http://127.0.0.1:70000"}, "tiers[0].endpoint_url: the port"),
    ({"bucket": "b", "endpoint_url": "http://127.0.0.1:port"}, "tiers[0].endpoint_url: the port"),
    ({"bucket": "b", "endpoint_url": "minio:9000"}, "tiers[0].endpoint_url"),
    ({"bucket": "b", "endpoint_url": "http://AKIA:Zq9@127.0.0.1:9000"},
     "tiers[0].endpoint_url: must not hold user info"),
    ({"bucket": "b", "max_connections": 100_000}, "tiers[0].max_connections"),
    ({"bucket": "b", "max_attempts": 0}, "tiers[0].max_attempts"),
    ({"bucket": "b", "max_attempts": 1000}, "tiers[0].max_attempts"),
    ({"bucket": "b", "read_timeout": float("inf")}, "tiers[0].read_timeout"),
])
def test_bad_options_name_the_field(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        S3Tier.from_config("s3", options, "tiers[0]")


@pytest.mark.parametrize("options", [
    {"bucket": "b", "access_key_id": "AKIAEXAMPLE", "secret_access_key": 31415926535897},  # unquoted in YAML
    {"bucket": "b", "access_key_id": "AKIAEXAMPLE", "secret_access_key": "31415926535897",
     "endpoint_url": "http://127.0.0.1:70000"},
    {"bucket": "b", "access_key_id": "AKIAEXAMPLE", "secret_access_key": "31415926535897", "max_attempts": 0},
])
def test_config_errors_never_show_the_secret_key(options: dict) -> None:
    with pytest.raises(ConfigError) as info:
        S3Tier.from_config("s3", options, "tiers[0]")
    assert "31415926535897" not in str(info.value), str(info.value)
