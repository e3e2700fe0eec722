"""The mooncake tier against a real Mooncake Store on loopback (master, HTTP metadata, a memory-holding client)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator

import pytest

from kvtier import ConfigError, MooncakeTier, ObjectError, TierError
from kvtier.keys import HeadRange
from kvtier.testing.servers import MooncakeServer
from kvtier.testing.tiers import NS_A, NS_B, TierConformance, key
from kvtier.tiers._mooncake import _slices


def open_tier(server: MooncakeServer, **options: object) -> MooncakeTier:
    tier = MooncakeTier.from_config("mooncake", {**server.tier_options(), **options}, "tiers[0]")
    assert isinstance(tier, MooncakeTier)
    return tier


class TestMooncakeConformance(TierConformance):
    @pytest.fixture
    def tier_config(self, mooncake_server: MooncakeServer, unique_prefix: str) -> dict[str, object]:
        return {"type": "mooncake", **mooncake_server.tier_options(), "key_prefix": unique_prefix}

    @pytest.fixture
    def tier(self, mooncake_server: MooncakeServer, unique_prefix: str) -> Iterator[MooncakeTier]:
        tier = open_tier(mooncake_server, key_prefix=unique_prefix)
        yield tier
        tier.close()

    @pytest.fixture
    def reopen(self, mooncake_server: MooncakeServer, unique_prefix: str):
        def reopen(old: MooncakeTier) -> MooncakeTier:
            old.close()
            return open_tier(mooncake_server, key_prefix=unique_prefix)
        return reopen


def test_slices_are_every_tensor_parallel_split() -> None:
    assert _slices(1) == [HeadRange(0, 1, 1)]
    assert set(_slices(4)) == {HeadRange(0, 1, 4), HeadRange(1, 2, 4), HeadRange(2, 3, 4), HeadRange(3, 4, 4),
                               HeadRange(0, 2, 4), HeadRange(2, 4, 4), HeadRange(0, 4, 4)}


def test_another_process_finds_shards_through_the_marker(mooncake_server: MooncakeServer,
                                                         unique_prefix: str) -> None:
    writer = open_tier(mooncake_server, key_prefix=unique_prefix)
    writer.put(key(1, HeadRange(2, 4, 8)), [b"tp4 rank 1"])
    writer.close()
    reader = open_tier(mooncake_server, key_prefix=unique_prefix)  # knows nothing yet
    assert reader.heads(NS_A, [key(1).chunk, key(2).chunk]) == [[HeadRange(2, 4, 8)], []]
    assert reader.heads(NS_B, [key(1).chunk]) == [[]]
    reader.close()


def test_an_object_above_the_local_buffer_is_refused_clearly(mooncake_server: MooncakeServer,
                                                             unique_prefix: str) -> None:
    tier = open_tier(mooncake_server, key_prefix=unique_prefix, local_buffer_bytes="1MiB")
    with pytest.raises(TierError, match="local_buffer_bytes"):
        tier.put(key(3), [b"x" * (2 * 2**20)])
    tier.close()


def test_over_rdma_reads_go_through_get_and_a_copy(mooncake_server: MooncakeServer, unique_prefix: str) -> None:
    """Pages not registered with the transfer engine cannot be read into over RDMA: each read is a get and a copy
    (run here over TCP with the tier told otherwise)."""
    tier = open_tier(mooncake_server, key_prefix=unique_prefix)
    blob = os.urandom(96 + 4096)
    tier.put(key(5), [blob])
    tier.options = dataclasses.replace(tier.options, protocol="rdma")
    page = bytearray(4096)
    assert tier.get_into_many([(key(5), 96, [memoryview(page)]), (key(6), 96, [memoryview(bytearray(8))])]) == \
        [blob[:96], None]
    assert bytes(page) == blob[96:]
    tier.close()


def test_listing_needs_the_admin_address(mooncake_server: MooncakeServer, unique_prefix: str) -> None:
    tier = open_tier(mooncake_server, key_prefix=unique_prefix, admin_url=None)
    with pytest.raises(TierError, match="admin_url"):
        list(tier.list())
    tier.close()


def test_a_damaged_marker_is_an_object_error_and_the_next_put_rewrites_it(mooncake_server: MooncakeServer,
                                                                         unique_prefix: str) -> None:
    writer = open_tier(mooncake_server, key_prefix=unique_prefix)
    reader = open_tier(mooncake_server, key_prefix=unique_prefix)
    raw = writer._store()  # Mooncake's own client: writes what a broken or hostile writer would
    marker = f"{unique_prefix}{NS_A}/heads"
    # Not UTF-8, not numbers, a count whose slices would be 10**8 names per lookup, zero, too many counts.
    for damage in [b"\xff\xfe", b"four", b"100000000", b"0", b"4,,8", b",".join([b"4"] * 40)]:
        assert raw.upsert(marker, damage) == 0
        with pytest.raises(ObjectError, match="marker of namespace"):
            reader.heads(NS_A, [key(1).chunk])  # a miss for this namespace, not an outage of the tier
    writer.put(key(1), [b"kv"])
    assert reader.heads(NS_A, [key(1).chunk]) == [[HeadRange(0, 4, 4)]]
    writer.close()
    reader.close()


def test_listing_sees_only_exact_names(mooncake_server: MooncakeServer, unique_prefix: str) -> None:
    tier = open_tier(mooncake_server, key_prefix=unique_prefix)
    tier.put(key(1), [b"ours"])
    chunk = key(1).chunk
    for name in [f"notes/{chunk}/0-4of4", f"staging/{chunk}/0-4of4", f"{NS_A}/not-hex/0-4of4",
                 f"{NS_A}/{chunk}/0-4of4.bak", f"{NS_A}/{key(2).chunk}/4-0of4"]:
        assert tier._store().put(unique_prefix + name, b"not kvtier's") == 0
    assert [o.key for o in tier.list()] == [key(1)]
    assert [o.key for o in tier.list(NS_A)] == [key(1)] and list(tier.list("")) == []
    tier.close()


@pytest.mark.parametrize("options, message", [
    ({"metadata_server": "http://x/metadata"}, "tiers[0].master: required"),
    ({"master": "nohost", "metadata_server": "http://x/metadata"}, "tiers[0].master"),
    ({"master": "h:1", "metadata_server": "http://x/metadata", "protocol": "udp"}, "tiers[0].protocol"),
    ({"master": "h:70000", "metadata_server": "http://x/metadata"}, "tiers[0].master"),
    ({"master": "h:0", "metadata_server": "http://x/metadata"}, "tiers[0].master"),
    ({"master": "h:1", "metadata_server": "http://x:70000/metadata"}, "tiers[0].metadata_server: the port"),
    ({"master": "h:1", "metadata_server": "http://x/metadata", "admin_url": "http://x:99999"},
     "tiers[0].admin_url: the port"),
    ({"master": "h:1", "metadata_server": "http://x/metadata", "transfer_timeout": 0},
     "tiers[0].transfer_timeout: must be a whole number of seconds in [1, 3600]"),
    ({"master": "h:1", "metadata_server": "http://x/metadata", "transfer_timeout": 2.5}, "tiers[0].transfer_timeout"),
])
def test_bad_options_name_the_field(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MooncakeTier.from_config("mooncake", options, "tiers[0]")


def test_transfer_timeout_is_the_last_tiers_unless_the_user_set_it(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """Mooncake reads MC_TCP_PROGRESS_TIMEOUT_SEC for every transfer of the process: kvtier sets it, a tier set up
    later changes it (said), and a value from the user's environment is kept (a different setting said)."""
    from kvtier.tiers import _mooncake

    monkeypatch.setattr(_mooncake, "_progress_ours", None)
    monkeypatch.delenv(_mooncake._PROGRESS_ENV, raising=False)
    _mooncake._progress_timeout("a", 5)
    assert os.environ[_mooncake._PROGRESS_ENV] == "5"
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        _mooncake._progress_timeout("b", 2)
    assert os.environ[_mooncake._PROGRESS_ENV] == "2" and "now applies to every Mooncake transfer" in caplog.text
    monkeypatch.setattr(_mooncake, "_progress_ours", None)
    monkeypatch.setenv(_mooncake._PROGRESS_ENV, "9")  # the user's
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        _mooncake._progress_timeout("c", 2)
    assert os.environ[_mooncake._PROGRESS_ENV] == "9" and "not applied" in caplog.text
