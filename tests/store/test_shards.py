"""Shards stored with a codec (``codec:`` on a tier) through a whole store on a real disk: read back by a new store
exactly (none, lossless) or within the format's bound (fp8, k16v8), decoded straight into DRAM, in a load by layers
too; a reader that wants exact KV never takes lossy objects; KV decoded from a lossy codec never becomes "exact" in
a front tier; NaN is never encoded; sealed and compressed together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash

from kvtier import KVStore, Namespace, frame
from kvtier.codecs import CODECS
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.conftest import CLEAN_AUDIT, settled

T = 16
NS = Namespace(model="codec-test", dtype="bfloat16")


def cfg(*tiers: dict, **extra: object) -> dict:
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "8MiB", "page_bytes": "4KiB"},
            "tiers": [{"queue_depth": 4096, **t} for t in tiers], **extra}


def disk(path: Path, codec: str = "none", name: str = "disk", **more: object) -> dict:
    return {"type": "filesystem", "name": name, "path": str(path), "codec": codec, **more}


def sample(chunks: int = 4, seed: int = 3) -> tuple[list[int], torch.Tensor]:
    tokens = synthetic_tokens(seed, chunks * T)
    kv = synthetic_kv(tokens, layers=3, heads=2, head_dim=64) * 3
    kv[:, 0, :, :, 5] *= 30  # an outlier key channel, as real keys have
    return tokens, kv


def within(got: torch.Tensor, kv: torch.Tensor, codec: str) -> bool:
    per_chunk = [CODECS[codec].error_bound(c) for c in kv.split(T, dim=3)]
    return bool(((got.float() - kv.float()).abs() <= torch.cat(per_chunk, dim=3)).all())


def files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.kv"))


@pytest.mark.parametrize("codec", ["none", "lossless", "fp8", "k16v8"])
def test_a_prefix_stored_with_each_codec_is_read_back_by_a_new_store(tmp_path: Path, codec: str) -> None:
    tokens, kv = sample()
    with KVStore.from_config(cfg(disk(tmp_path / "d", codec))) as store:
        store.put(NS, tokens, kv)
        store.flush()
        stats = store.stats()["disk"]
    raw = kv.numel() * kv.element_size()
    stored = sum(p.stat().st_size - frame.HEADER_LEN for p in files(tmp_path / "d"))
    assert stats["codec_bytes_total{form=raw}"] == raw and stats["codec_bytes_total{form=stored}"] == stored
    if CODECS[codec].fixed:  # (16-token chunks: a value scale per token weighs more than in 256-token ones)
        assert stored == 4 * CODECS[codec].max_len((3, 2, 2, T, 64), kv.dtype)
    ratio = {"none": (1.0, 1.0), "lossless": (0.01, 0.99), "fp8": (0.5, 0.6), "k16v8": (0.75, 0.8)}[codec]
    assert ratio[0] <= stored / raw <= ratio[1], stored / raw
    with KVStore.from_config(cfg(disk(tmp_path / "d", codec))) as fresh:  # an empty DRAM: every chunk from disk
        got = fresh.get(NS, tokens)
        assert got is not None
        if CODECS[codec].exact:
            assert torch.equal(got, kv)
        else:
            assert within(got, kv, codec) and not torch.equal(got, kv)
        assert fresh.stats()["disk"]["hit_chunks_total"] == 4
        fresh.drop_dram()
        with fresh.loading(NS, tokens, layers=3, head_dim=64, dtype=torch.bfloat16, by_layers=True) as loaded:
            for layer in range(3):
                loaded.read_layer(layer)
            assert loaded.verified() == 4 * T
            by_layers = torch.cat([v for _, v in loaded.views]).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
        assert torch.equal(by_layers, got)  # the same KV, read a layer at a time (or whole, where coded)
        assert settled(fresh) == CLEAN_AUDIT


def test_a_reader_that_wants_exact_kv_never_takes_lossy_objects(tmp_path: Path) -> None:
    tokens, kv = sample()
    with KVStore.from_config(cfg(disk(tmp_path / "d", "fp8"))) as store:
        store.put(NS, tokens, kv)
        store.flush()
    before = files(tmp_path / "d")
    with KVStore.from_config(cfg(disk(tmp_path / "d", "none"))) as exact:
        assert exact.get(NS, tokens) is None
        assert exact.load(NS, tokens, lambda *_: None, layers=3, head_dim=64, dtype=torch.bfloat16) == 0
        with exact.loading(NS, tokens, layers=3, head_dim=64, dtype=torch.bfloat16, by_layers=True) as loaded:
            assert loaded.tokens == 0
        stats = exact.stats()["disk"]
        assert stats["codec_refused_objects_total"] >= 1 and stats["corrupt_objects_total"] == 0
        assert settled(exact) == CLEAN_AUDIT
    assert files(tmp_path / "d") == before  # left in place for the readers that take them
    with KVStore.from_config(cfg(disk(tmp_path / "d", "none", accept_codecs=["fp8"]))) as accepting:
        got = accepting.get(NS, tokens)
        assert got is not None and within(got, kv, "fp8")
    with KVStore.from_config(cfg(disk(tmp_path / "d", "k16v8"))) as other_lossy:  # k16v8 is not fp8
        assert other_lossy.get(NS, tokens) is None


def test_an_exact_reader_takes_lossless_objects_of_a_tier_that_stores_none(tmp_path: Path) -> None:
    """A tier whose codec changed from lossless to none: its old objects are exact KV, read whole and decoded
    (their size is not the shard's), in a load by layers too."""
    tokens, kv = sample()
    with KVStore.from_config(cfg(disk(tmp_path / "d", "lossless"))) as store:
        store.put(NS, tokens, kv)
        store.flush()
    with KVStore.from_config(cfg(disk(tmp_path / "d", "none"))) as plain:
        with plain.loading(NS, tokens, layers=3, head_dim=64, dtype=torch.bfloat16, by_layers=True) as loaded:
            for layer in range(3):
                loaded.read_layer(layer)
            assert loaded.verified() == 4 * T
            got = torch.cat([v for _, v in loaded.views]).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
        assert torch.equal(got, kv)
        plain.drop_dram()
        assert torch.equal(plain.get(NS, tokens), kv)
        stats = plain.stats()["disk"]
        assert stats["corrupt_objects_total"] == 0 and stats["codec_refused_objects_total"] == 0
    assert len(files(tmp_path / "d")) == 4


def test_lossy_kv_promoted_from_a_tier_is_never_copied_to_the_tiers_in_front(tmp_path: Path) -> None:
    """Written to a front tier as exact KV, a reader wanting exact KV would take it; encoded again by a front tier
    of the same codec, its error would grow past the codec's bound (bf16 values rounded twice). Exact KV promoted
    from a lossless tier is copied as any exact KV is."""
    tokens, kv = sample()
    back = disk(tmp_path / "back", "fp8", name="back")
    with KVStore.from_config(cfg(back)) as store:
        store.put(NS, tokens, kv)
        store.flush()
    for front in (disk(tmp_path / "exact", "none", name="front", accept_codecs=["fp8"]),
                  disk(tmp_path / "fp8front", "fp8", name="front")):
        with KVStore.from_config(cfg(front, back)) as store:
            got = store.get(NS, tokens)
            assert got is not None and within(got, kv, "fp8")
            store.flush()
            assert store.stats()["back"]["promotions_total"] == 4
    assert files(tmp_path / "exact") == [] and files(tmp_path / "fp8front") == []
    with KVStore.from_config(cfg(disk(tmp_path / "ll", "lossless", name="back"))) as store:
        store.put(NS, tokens, kv)
        store.flush()
    with KVStore.from_config(cfg(disk(tmp_path / "front2", "none", name="front"),
                                 disk(tmp_path / "ll", "lossless", name="back"))) as store:
        assert torch.equal(store.get(NS, tokens), kv)
        store.flush()
    assert len(files(tmp_path / "front2")) == 4


def test_an_object_stored_with_a_codec_as_long_as_the_shard_is_decoded_not_served_as_kv(tmp_path: Path) -> None:
    """With head_dim 6 (a scale per 2 channels) an fp8 shard is exactly as long as the raw one: a reader storing
    none (accepting fp8) reads it into the entry as if raw, sees its codec, and decodes it, whole or by layers."""
    tokens = synthetic_tokens(8, 2 * T)
    kv = synthetic_kv(tokens, layers=2, heads=2, head_dim=6) * 3
    assert CODECS["fp8"].max_len((2, 2, 2, T, 6), kv.dtype) == kv[:, :, :, :T].numel() * 2
    with KVStore.from_config(cfg(disk(tmp_path / "d", "fp8"))) as store:
        store.put(NS, tokens, kv)
        store.flush()
    reader = cfg(disk(tmp_path / "d", "none", accept_codecs=["fp8"]))
    with KVStore.from_config(reader) as plain:
        with plain.loading(NS, tokens, layers=2, head_dim=6, dtype=torch.bfloat16, by_layers=True) as loaded:
            for layer in range(2):
                loaded.read_layer(layer)
            assert loaded.verified() == 2 * T
            got = torch.cat([v for _, v in loaded.views]).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
        assert within(got, kv, "fp8")
        plain.drop_dram()
        again = plain.get(NS, tokens)
        assert again is not None and within(again, kv, "fp8")
        assert settled(plain) == CLEAN_AUDIT


def test_an_object_larger_than_any_accepted_codec_stores_the_shard_in_is_corrupt_and_never_read(
        tmp_path: Path) -> None:
    import tracemalloc

    tokens, kv = sample(1)
    with KVStore.from_config(cfg(disk(tmp_path / "d"))) as store:
        store.put(NS, tokens, kv)
        store.flush()
    (victim,) = files(tmp_path / "d")
    with victim.open("ab") as f:
        f.write(bytes(64 * 2**20))  # a valid shard and 64 MiB after it
    with KVStore.from_config(cfg(disk(tmp_path / "d"))) as store:
        tracemalloc.start()
        try:
            got = store.load(NS, tokens, lambda *_: None, layers=3, head_dim=64, dtype=torch.bfloat16)
            peak = tracemalloc.get_traced_memory()[1]
            assert got == 0
        finally:
            tracemalloc.stop()
        assert peak < 16 * 2**20  # never read at its size
        assert store.stats()["disk"]["corrupt_objects_total"] == 1
    assert files(tmp_path / "d") == []


def test_exact_kv_computed_again_replaces_an_object_the_tiers_reads_refused(tmp_path: Path) -> None:
    """A tier whose codec went from fp8 to none: its fp8 objects are refused; the engine computes the prefix
    again, and its put writes exact KV over every chunk (no write skipped as present while refusals are recent),
    which the next read takes."""
    tokens, kv = sample()
    with KVStore.from_config(cfg(disk(tmp_path / "d", "fp8"))) as store:
        store.put(NS, tokens, kv)
        store.flush()
    with KVStore.from_config(cfg(disk(tmp_path / "d", "none"))) as exact:
        assert exact.get(NS, tokens) is None  # the first chunk refused: a miss
        exact.put(NS, tokens, kv)  # computed again
        exact.flush()
        exact.drop_dram()
        got = exact.get(NS, tokens)
        assert got is not None and torch.equal(got, kv)  # every chunk, not only the one refused
        stats = exact.stats()["disk"]
        assert stats["codec_refused_objects_total"] == 1 and stats["present_writes_total"] == 0
    assert {frame.decode_header(f.read_bytes()).codec.name for f in files(tmp_path / "d")} == {"none"}


@pytest.mark.parametrize("codec", ["fp8", "k16v8"])
def test_kv_holding_nan_is_never_encoded_lossy(tmp_path: Path, codec: str) -> None:
    tokens, kv = sample(2)
    kv[1, 1, 0, T + 3, 7] = float("nan")  # in the second chunk's values
    with KVStore.from_config(cfg(disk(tmp_path / "d", codec))) as store:
        assert store.put(NS, tokens, kv) == 2 * T  # DRAM holds it as it is
        store.flush()
        assert store.stats()["disk"]["dropped_writes_total{reason=not_encodable}"] == 1
        assert store.stats()["disk"]["write_errors_total"] == 0
        got = store.get(NS, tokens)
        assert got is not None and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    assert len(files(tmp_path / "d")) == 1  # the first chunk only


def test_sealed_and_compressed_together(tmp_path: Path) -> None:
    from tests.test_sealing import config as sealed_config
    from tests.test_sealing import ns

    tokens, kv = sample()
    tenant = ns("tenant-a")
    conf = sealed_config(tmp_path, tier=disk(tmp_path / "d", "fp8", queue_depth=4096))
    with KVStore.from_config(conf) as store:
        store.put(tenant, tokens, kv)
        store.flush()
    objs = files(tmp_path / "d")
    raw_chunk = kv.numel() * kv.element_size() // 4
    for path in objs:
        header = frame.decode_header(path.read_bytes())
        assert header.sealing is not None and header.codec is CODECS["fp8"]
        assert path.stat().st_size - frame.SEALED_HEADER_LEN == CODECS["fp8"].max_len(header.meta.shape,
                                                                                        header.meta.dtype) < raw_chunk
    with KVStore.from_config(conf) as fresh:
        got = fresh.get(tenant, tokens)
        assert got is not None and within(got, kv, "fp8")
    conf_k = sealed_config(tmp_path, tier=disk(tmp_path / "d", "k16v8", accept_codecs=["fp8"], queue_depth=4096))
    with KVStore.from_config(conf_k) as reader:
        assert reader.get(tenant, tokens) is not None  # (accepted as it is)
        # The codec is in the associated data. Shards of head size 6 (a scale per 2 channels) are as long in fp8 as
        # in k16v8: one relabelled (its header's own checksum redone, as a tier writer can) fails to authenticate.
        sealer = reader._tenancy.sealer
        assert sealer is not None
        key = frame.decode_header(objs[0].read_bytes()).key
        meta = frame.ShardMeta(3, 4, 6, torch.bfloat16, key.heads)
        shard = torch.randn(meta.shape).bfloat16()
        fp8, k16v8 = CODECS["fp8"], CODECS["k16v8"]
        assert fp8.max_len(meta.shape, meta.dtype) == k16v8.max_len(meta.shape, meta.dtype)
        coded = bytes(fp8.encode(meta.shape, meta.dtype, [memoryview(shard.view(torch.uint8).numpy().reshape(-1))])[0])
        blob = b"".join(bytes(p) for p in sealer.seal(key, meta, [memoryview(coded)], None, fp8))
        assert frame.decode(blob, expected=key, opener=sealer)[0].codec is fp8
        at = 4 + 2 + 2 + 8 + 16 + 16 + 16 + 2 * 3 + 2 + 4 + 2 + 1  # the codec byte
        head = bytearray(blob[:frame.SEALED_HEADER_LEN - 8])
        head[at] = k16v8.code
        forged = bytes(head) + xxhash.xxh3_64_intdigest(bytes(head)).to_bytes(8, "little") + blob[len(head) + 8:]
        with pytest.raises(frame.FrameError, match="authenticate"):
            frame.decode(forged, expected=key, opener=sealer)
