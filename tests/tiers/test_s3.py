"""The s3 tier against a real S3-compatible server (SeaweedFS) on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier import ConfigError, S3Tier
from kvtier.testing.servers import S3Server
from kvtier.testing.tiers import NS_A, TierConformance, key

def open_tier(server: S3Server, **options: object) -> S3Tier:
    tier = S3Tier.from_config("s3", {**server.tier_options(), **options}, "tiers[0]")
    assert isinstance(tier, S3Tier)
    return tier


class TestS3Conformance(TierConformance):
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


@pytest.mark.parametrize("options, message", [
    ({}, "tiers[0].bucket"),
    ({"bucket": "b", "access_key_id": "x"}, "access_key_id/secret_access_key"),
    ({"bucket": "b", "prefix": "no-slash"}, "tiers[0].prefix"),
    ({"bucket": "b", "addressing_style": "sideways"}, "tiers[0].addressing_style"),
])
def test_bad_options_name_the_field(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        S3Tier.from_config("s3", options, "tiers[0]")
