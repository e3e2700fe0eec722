"""The s3 tier against a SeaweedFS that checks credentials, as a real bucket does: wrong keys fail clearly at
start (naming the bucket and the S3 error, never the secret), right keys work, and keys are found wherever the
AWS credential chain looks (config, environment, a profile in a shared credentials file)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import ConfigError, S3Tier, TierError
from kvtier.testing.servers import S3Server
from kvtier.testing.tiers import key

KEY_ID = "kvtier-admin"
SECRET = "s3cr3t-Right-Key-0123456789"
WRONG = "s3cr3t-Wrong-Key-9876543210"


@pytest.fixture(scope="module")
def authed_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A second S3 server, with one identity: only these tests need it, so it runs for this module only."""
    server = S3Server(tmp_path_factory.mktemp("seaweedfs-auth"), credentials=(KEY_ID, SECRET)).start()
    yield server
    server.stop()


@pytest.fixture
def no_ambient_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Nothing from this machine's environment or ~/.aws; returns an empty shared credentials file to fill."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    credentials = tmp_path / "credentials"
    credentials.write_text("")
    (tmp_path / "config").write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup (it waits for a timeout)
    return credentials


def options(server: S3Server, prefix: str, **over: object) -> dict[str, object]:
    opts = {**server.tier_options(), "prefix": prefix, **over}
    return {k: v for k, v in opts.items() if v is not None}


def round_trip(tier: S3Tier) -> None:
    tier.put(key(1), [b"hello"])
    assert bytes(tier.get(key(1)) or b"") == b"hello"
    assert [o.key for o in tier.list()] == [key(1)]
    tier.close()


def test_right_keys_in_the_config_work(authed_s3: S3Server, unique_prefix: str) -> None:
    round_trip(S3Tier.from_config("s3", options(authed_s3, unique_prefix), "tiers[0]"))  # type: ignore[arg-type]


@pytest.mark.parametrize("key_id, secret", [(KEY_ID, WRONG), ("nobody", WRONG), ("nobody", SECRET)])
def test_wrong_keys_fail_at_start_naming_the_bucket_never_the_secret(authed_s3: S3Server, unique_prefix: str,
                                                                     key_id: str, secret: str) -> None:
    with pytest.raises(TierError) as info:
        S3Tier.from_config("s3", options(authed_s3, unique_prefix, access_key_id=key_id, secret_access_key=secret),
                           "tiers[0]")
    message = str(info.value)
    assert "'kvtier'" in message and "access denied" in message and "403" in message, message
    assert "from explicit" in message  # where the keys came from
    assert SECRET not in message and WRONG not in message


def test_keys_from_the_environment(authed_s3: S3Server, unique_prefix: str, no_ambient_credentials: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    opts = options(authed_s3, unique_prefix, access_key_id=None, secret_access_key=None)
    round_trip(S3Tier.from_config("s3", opts, "tiers[0]"))  # type: ignore[arg-type]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG)
    with pytest.raises(TierError, match="access denied.*from env") as info:
        S3Tier.from_config("s3", opts, "tiers[0]")
    assert WRONG not in str(info.value)


def test_keys_from_a_profile(authed_s3: S3Server, unique_prefix: str, no_ambient_credentials: Path) -> None:
    no_ambient_credentials.write_text(f"[kvtier-test]\naws_access_key_id = {KEY_ID}\n"
                                      f"aws_secret_access_key = {SECRET}\n\n"
                                      f"[kvtier-wrong]\naws_access_key_id = {KEY_ID}\n"
                                      f"aws_secret_access_key = {WRONG}\n")
    opts = options(authed_s3, unique_prefix, access_key_id=None, secret_access_key=None, profile="kvtier-test")
    round_trip(S3Tier.from_config("s3", opts, "tiers[0]"))  # type: ignore[arg-type]
    with pytest.raises(TierError, match="access denied.*shared-credentials-file"):
        S3Tier.from_config("s3", {**opts, "profile": "kvtier-wrong"}, "tiers[0]")
    with pytest.raises(ConfigError, match="'kvtier-missing'"):
        S3Tier.from_config("s3", {**opts, "profile": "kvtier-missing"}, "tiers[0]")


def test_no_credentials_anywhere_is_a_clear_error(authed_s3: S3Server, unique_prefix: str,
                                                  no_ambient_credentials: Path) -> None:
    opts = options(authed_s3, unique_prefix, access_key_id=None, secret_access_key=None)
    with pytest.raises(TierError, match="no usable credentials for bucket 'kvtier'"):
        S3Tier.from_config("s3", opts, "tiers[0]")


def test_a_missing_bucket_fails_at_start(authed_s3: S3Server, unique_prefix: str) -> None:
    with pytest.raises(TierError, match="bucket 'no-such-bucket' does not exist"):
        S3Tier.from_config("s3", options(authed_s3, unique_prefix, bucket="no-such-bucket", create_bucket=False),
                           "tiers[0]")
