"""The conformance suite every secondary tier passes.

Subclass :class:`TierConformance` in a pytest module and provide a ``tier`` fixture (and ``reopen`` for
persistent tiers); every test here then runs against that tier.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
import torch

from kvtier.errors import WrongSize
from kvtier.keys import HeadRange, ShardKey
from kvtier.tiers.base import Buffer, Tier

NS_A = "a" * 32
NS_B = "b" * 32
_ALL_HEADS = HeadRange(0, 4, 4)


def key(chunk: int, heads: HeadRange = _ALL_HEADS, namespace: str = NS_A) -> ShardKey:
    return ShardKey(namespace, f"{chunk:032x}", heads)


class TierConformance:
    """Behaviour the store relies on from any tier. Fixtures ``tier`` and ``reopen`` come from the subclass."""

    @pytest.fixture
    def reopen(self) -> Callable[[Tier], Tier] | None:
        """Override for persistent tiers: close the given tier and open a new one over the same storage."""
        return None

    def test_round_trip_concatenates_parts(self, tier: Tier) -> None:
        parts: list[Buffer] = [b"header", os.urandom(100_000), memoryview(os.urandom(3))]
        tier.put(key(1), parts)
        got = tier.get(key(1))
        assert got is not None and bytes(got) == b"".join(bytes(p) for p in parts)

    def test_put_replaces_an_object(self, tier: Tier) -> None:
        """A rewrite (e.g. re-sealed under a new key by ``kvtier cache rekey``) replaces what was there."""
        tier.put(key(14), [b"first", os.urandom(5000)])
        second = b"second" + os.urandom(7000)
        tier.put(key(14), [second])
        got = tier.get(key(14))
        assert got is not None and bytes(got) == second
        assert [o.size for o in tier.list(key(14).namespace) if o.key == key(14)] == [len(second)]

    def test_missing_is_none(self, tier: Tier) -> None:
        assert tier.get(key(2)) is None
        assert tier.heads(NS_A, [key(2).chunk]) == [[]]
        assert not tier.exists(key(2))

    def test_delete(self, tier: Tier) -> None:
        tier.put(key(3), [b"x" * 10])
        assert tier.delete(key(3)) is True
        assert tier.get(key(3)) is None
        assert tier.delete(key(3)) is False

    def test_heads_per_chunk(self, tier: Tier) -> None:
        tier.put(key(4, HeadRange(0, 2, 4)), [b"lo"])
        tier.put(key(4, HeadRange(2, 4, 4)), [b"hi"])
        tier.put(key(5, HeadRange(0, 1, 1)), [b"x"])
        got = tier.heads(NS_A, [key(4).chunk, key(6).chunk, key(5).chunk])
        assert sorted(got[0]) == [HeadRange(0, 2, 4), HeadRange(2, 4, 4)]
        assert got[1] == [] and got[2] == [HeadRange(0, 1, 1)]

    def test_namespaces_are_separate(self, tier: Tier) -> None:
        tier.put(key(7, namespace=NS_A), [b"tenant-a"])
        assert tier.get(key(7, namespace=NS_B)) is None
        assert tier.heads(NS_B, [key(7).chunk]) == [[]]
        tier.put(key(7, namespace=NS_B), [b"tenant-b"])
        assert bytes(tier.get(key(7, namespace=NS_A)) or b"") == b"tenant-a"
        assert [o.key.namespace for o in tier.list(NS_B)] == [NS_B]

    def test_list_reports_sizes(self, tier: Tier) -> None:
        tier.put(key(8), [b"a" * 1000])
        tier.put(key(9), [b"b" * 10])
        sizes = {o.key: o.size for o in tier.list()}
        assert sizes == {key(8): 1000, key(9): 10}

    def test_large_object(self, tier: Tier) -> None:
        blob = os.urandom(8 * 2**20 + 17)
        tier.put(key(10), [memoryview(blob)[:2**20], memoryview(blob)[2**20:]])
        assert bytes(tier.get(key(10)) or b"") == blob

    def test_get_into_buffers(self, tier: Tier) -> None:
        """A read in two parts: the header returned, the payload written into the caller's buffers (e.g. DRAM
        pages, as several extents); an object of another size is :class:`WrongSize` (the store then reads it whole:
        it may be stored with a codec), not half-written into them."""
        blob = os.urandom(96 + 3 * 2**20 + 5)
        tier.put(key(12), [memoryview(blob)])
        pages = [bytearray(2**20), bytearray(2 * 2**20 + 5)]
        assert tier.get_into(key(12), 96, [memoryview(p) for p in pages]) == blob[:96]
        assert b"".join(pages) == blob[96:]
        with pytest.raises(WrongSize, match="expected") as raised:
            tier.get_into(key(12), 96, [memoryview(bytearray(3 * 2**20))])
        assert raised.value.size == len(blob)  # (what the store reads it again at)
        assert tier.get_into(key(13), 96, [memoryview(bytearray(8))]) is None

    def test_head_reads_an_objects_first_bytes(self, tier: Tier) -> None:
        blob = os.urandom(3 * 2**20 + 7)
        tier.put(key(14), [memoryview(blob)])
        assert tier.head(key(14), 144) == blob[:144]
        tier.put(key(15), [b"short"])
        assert tier.head(key(15), 144) == b"short"
        assert tier.head(key(16), 144) is None

    def test_get_into_many_answers_each_read(self, tier: Tier) -> None:
        """Several reads at once (one batch where the tier batches them): each answered as :meth:`get_into`
        would, a missing or malformed object in the batch costing only its own read."""
        blobs = [os.urandom(96 + 2**20 + i) for i in range(3)]
        for i, blob in enumerate(blobs):
            tier.put(key(20 + i), [memoryview(blob)])
        pages = [bytearray(2**20 + i) for i in range(3)]
        got = tier.get_into_many([(key(20), 96, [memoryview(pages[0])]), (key(23), 96, [memoryview(bytearray(8))]),
                                  (key(21), 96, [memoryview(bytearray(2**20))]), (key(22), 96, [memoryview(pages[2])])])
        assert got[0] == blobs[0][:96] and bytes(pages[0]) == blobs[0][96:]
        assert got[1] is None
        assert isinstance(got[2], WrongSize) and "expected" in str(got[2]) and got[2].size == len(blobs[1])
        assert got[3] == blobs[2][:96] and bytes(pages[2]) == blobs[2][96:]

    def test_concurrent_writers(self, tier: Tier) -> None:
        errors: list[BaseException] = []

        def write(i: int) -> None:
            try:
                tier.put(key(100 + i), [i.to_bytes(4, "little") * 1000])
            except BaseException as exc:  # noqa: BLE001 collected, and the test fails on them below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i in range(16):
            assert bytes(tier.get(key(100 + i)) or b"") == i.to_bytes(4, "little") * 1000

    @pytest.fixture
    def tier_config(self) -> dict[str, object] | None:
        """Override: this tier as a store's config names it (``type`` and options; its storage the ``tier``
        fixture's or a like one), for the tests that run whole stores over it, each opening its own."""
        return None

    @pytest.mark.parametrize("codec", ["none", "lossless", "fp8", "k16v8"])
    def test_a_store_round_trips_kv_through_it_with_each_codec(self, tier_config: dict[str, object] | None,
                                                                codec: str) -> None:
        """A store writing through this tier with ``codec`` reads back, once its DRAM is dropped, what it put:
        exact (none, lossless), or within the format's bound (fp8, k16v8) and in fewer bytes; a store over the
        same storage that takes exact KV only finds no lossy object (a miss, counted, the objects left)."""
        from kvtier.codecs import CODECS
        from kvtier.keys import Namespace
        from kvtier.store import KVStore
        from kvtier.testing.data import synthetic_kv, synthetic_tokens

        if tier_config is None:
            pytest.skip("the tier's tests give no tier_config")
        tokens = synthetic_tokens(11, 3 * 16)
        kv = synthetic_kv(tokens, layers=2, heads=4, head_dim=64)
        ns = Namespace(model=f"conformance-{codec}", dtype="bfloat16")

        def store(codec: str) -> KVStore:
            return KVStore.from_config({"chunk_tokens": 16, "dram": {"capacity_bytes": "4MiB", "page_bytes": "4KiB"},
                                        "tiers": [{**tier_config, "name": "t", "codec": codec}]})

        with store(codec) as writer:
            writer.put(ns, tokens, kv)
            writer.flush()
            writer.drop_dram()
            got = writer.get(ns, tokens)
            assert got is not None
            bound = torch.cat([CODECS[codec].error_bound(c) for c in kv.split(16, dim=3)], dim=3)
            assert bool(((got.float() - kv.float()).abs() <= bound).all())
            stats = writer.stats()["t"]
            assert stats["hit_chunks_total"] == 3
            assert stats["codec_bytes_total{form=stored}"] < stats["codec_bytes_total{form=raw}"] or codec == "none"
            held = len(list(writer.tiers[0].list(writer.named(ns).id)))
        if not CODECS[codec].exact:
            with store("none") as exact:
                assert exact.get(ns, tokens) is None
                assert exact.stats()["t"]["codec_refused_objects_total"] == 1  # (planned without it after)
                assert len(list(exact.tiers[0].list(exact.named(ns).id))) == held == 3

    def test_persistent_tier_survives_reopen(self, tier: Tier, reopen: Callable[[Tier], Tier] | None) -> None:
        if not tier.persistent:
            pytest.skip("tier is not persistent")
        assert reopen is not None, "persistent tiers must provide the reopen fixture"
        tier.put(key(11), [b"kept"])
        again = reopen(tier)
        try:
            assert bytes(again.get(key(11)) or b"") == b"kept"
            assert again.heads(NS_A, [key(11).chunk]) == [[HeadRange(0, 4, 4)]]
        finally:
            again.close()
