"""The codecs alone: round trips (exact, or within the bound the format gives), refusals, malformed payloads."""

from __future__ import annotations

import sys

import pytest
import torch

from kvtier import codecs
from kvtier.codecs import CODECS, CodecError, NotEncodable
from kvtier.errors import ConfigError
import itertools

SHAPE = (3, 2, 2, 32, 16)  # [layers, 2, heads, tokens, head_dim]


def sample(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """KV with what real KV has: an outlier key channel, a loud token, a zero channel, values near zero."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(SHAPE, generator=g) * 2
    kv[:, 0, :, :, 3] *= 40  # an outlier key channel
    kv[:, 1, :, 5, :] *= 25  # a loud value token
    kv[:, 0, :, :, 7] = 0  # a channel of zeros
    kv[:, :, :, 2, :] = 0  # a token of zeros (its groups' scales must not divide by zero)
    kv[1, 1, 0, 9, :] = torch.linspace(-1e-4, 1e-4, SHAPE[4])  # subnormal in e4m3 after scaling
    return kv.to(dtype)


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy().reshape(-1))


def split(view: memoryview, *cuts: int) -> list[memoryview]:
    """``view`` in parts cut at ``cuts`` (as a DRAM entry's extents are: anywhere, mid-element and mid-layer)."""
    edges = [0, *cuts, len(view)]
    return [view[a:b] for a, b in itertools.pairwise(edges)]


def round_trip(name: str, kv: torch.Tensor, in_parts: bool = True) -> tuple[torch.Tensor, bytes]:
    codec = CODECS[name]
    raw = as_bytes(kv)
    stored = b"".join(codec.encode(SHAPE, kv.dtype, split(raw, 7, 3001) if in_parts else [raw]))
    assert codec.valid_len(SHAPE, kv.dtype, len(stored))
    out = torch.full_like(kv, 99)
    codec.decode_into(SHAPE, kv.dtype, memoryview(stored), split(as_bytes(out), 1, 5000, 5001))
    return out, stored


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["none", "lossless"])
def test_exact_codecs_give_back_every_bit(name: str, dtype: torch.dtype) -> None:
    kv = sample(dtype)
    kv.view(-1)[17] = float("nan")  # exact codecs keep even these: they change nothing
    kv.view(-1)[18] = float("-inf")
    out, _ = round_trip(name, kv)
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["fp8", "k16v8"])
def test_lossy_codecs_stay_within_the_formats_bound(name: str, dtype: torch.dtype) -> None:
    kv = sample(dtype)
    top = torch.finfo(dtype).max
    kv[0, 1, 1, 20, :4] = torch.tensor([top, -top, 0.99 * top, 0.5 * top]).to(dtype)  # the dtype's edge
    kv[0, 0, 1, 21, :2] = torch.tensor([top, -top]).to(dtype)
    codec = CODECS[name]
    out, stored = round_trip(name, kv)
    err = (out.float() - kv.float()).abs()
    bound = codec.error_bound(kv)
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"
    assert float(err.max()) > 0  # (lossy: a bound that is never approached would prove nothing)
    assert torch.equal(out[:, 0, :, :, 7], kv[:, 0, :, :, 7])  # zeros stay zeros
    assert bool(torch.isfinite(out).all())  # (a scale rounded up never takes the dtype's largest past it)
    if name == "k16v8":
        assert torch.equal(out[:, 0].view(torch.uint8), kv[:, 0].view(torch.uint8))  # keys as they were
    assert torch.equal(out[:, :, :, 2], kv[:, :, :, 2])
    layers, _, heads, tokens, head_dim = SHAPE
    fp8_bytes = layers * heads * tokens * head_dim
    groups = head_dim // codecs.group_of(head_dim)
    scales = 2 * layers * heads * tokens * groups * (2 if name == "fp8" else 1)  # bf16, per token and group
    keys = fp8_bytes if name == "fp8" else fp8_bytes * dtype.itemsize
    assert len(stored) == keys + fp8_bytes + scales


def test_real_sized_shard_halves_for_fp8_and_quarters_off_for_k16v8() -> None:
    shape = (30, 2, 3, 256, 64)  # SmolLM2-135M's 256-token chunk
    raw = 30 * 2 * 3 * 256 * 64 * 2
    scales = 2 * 2 * 2 / (2 * 64 * 2)  # per token and head: K and V, 2 groups of 32 channels, a bf16 scale each
    assert CODECS["fp8"].max_len(shape, torch.bfloat16) / raw == pytest.approx(0.5 + scales) == 0.53125
    assert CODECS["k16v8"].max_len(shape, torch.bfloat16) / raw == pytest.approx(0.75 + scales / 2)
    assert [codecs.group_of(d) for d in (64, 128, 96, 80, 72)] == [32, 32, 32, 16, 8]


@pytest.mark.parametrize("name", ["fp8", "k16v8"])
@pytest.mark.parametrize("where", [(0, 0, 0, 0, 0), (2, 1, 1, 31, 15)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_lossy_codecs_refuse_nan_and_infinity(name: str, where: tuple[int, ...], bad: float) -> None:
    kv = sample()
    kv[where] = bad
    with pytest.raises(NotEncodable):
        CODECS[name].encode(SHAPE, kv.dtype, [as_bytes(kv)])


@pytest.mark.parametrize("name", ["fp8", "k16v8", "lossless"])
def test_a_truncated_or_extended_payload_does_not_decode(name: str) -> None:
    kv = sample()
    _, stored = round_trip(name, kv)
    out = as_bytes(torch.empty_like(kv))
    for bad in (stored[:-1], stored + b"\0", stored[:5], b""):
        with pytest.raises(CodecError):
            CODECS[name].decode_into(SHAPE, kv.dtype, memoryview(bad), [out])


@pytest.mark.parametrize("name", ["fp8", "k16v8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_forged_scale_is_refused(name: str, bad: float) -> None:
    kv = sample()
    _, stored = round_trip(name, kv)
    forged = bytearray(stored)
    layer = CODECS[name].max_len(SHAPE, kv.dtype) // SHAPE[0]
    # the value scales of the second layer (after its key scales, for fp8)
    at = layer + (2 * SHAPE[2] * SHAPE[3] if name == "fp8" else 0)
    forged[at:at + 2] = torch.tensor([bad], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(CodecError, match="scale"):
        CODECS[name].decode_into(SHAPE, kv.dtype, memoryview(bytes(forged)), [as_bytes(torch.empty_like(kv))])


def test_lossless_refuses_a_lying_table_and_a_stream_of_the_wrong_size() -> None:
    kv = sample()
    codec = CODECS["lossless"]
    _, stored = round_trip("lossless", kv)
    out = [as_bytes(torch.empty_like(kv))]
    lying = bytearray(stored)
    lying[0:4] = (int.from_bytes(stored[0:4], "little") - 1).to_bytes(4, "little")
    with pytest.raises(CodecError):
        codec.decode_into(SHAPE, kv.dtype, memoryview(bytes(lying) + b"\0"), out)
    garbage = bytearray(stored)
    garbage[12 + 8:12 + 40] = bytes(32)  # inside the first layer's zstd frame
    with pytest.raises(CodecError):
        codec.decode_into(SHAPE, kv.dtype, memoryview(bytes(garbage)), out)
    import zstandard

    small = zstandard.ZstdCompressor().compress(b"x" * 10)  # a valid frame that expands to too little
    table = b"".join(len(small).to_bytes(4, "little") for _ in range(SHAPE[0]))
    with pytest.raises(CodecError, match="declares 10 bytes"):
        codec.decode_into(SHAPE, kv.dtype, memoryview(table + small * SHAPE[0]), out)
    per = len(out[0]) // SHAPE[0]
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * per)
    table = b"".join(len(unsized).to_bytes(4, "little") for _ in range(SHAPE[0]))
    with pytest.raises(CodecError, match="declares 18446744073709551615 bytes"):  # zstd says "unknown": refused
        codec.decode_into(SHAPE, kv.dtype, memoryview(table + unsized * SHAPE[0]), out)
    whole = zstandard.ZstdCompressor().compress(b"x" * per) + b"junk"  # bytes after the frame
    table = b"".join(len(whole).to_bytes(4, "little") for _ in range(SHAPE[0]))
    with pytest.raises(CodecError, match="unused data"):
        codec.decode_into(SHAPE, kv.dtype, memoryview(table + whole * SHAPE[0]), out)


def test_a_lossless_frame_declaring_a_huge_layer_is_refused_before_anything_is_allocated() -> None:
    """A zip bomb: a few hundred bytes declaring 256 MiB. zstandard allocates what a frame declares whatever its
    max_output_size, so the declared size is checked first; memory stays near one layer's."""
    import tracemalloc

    import zstandard

    kv = sample()
    out = [as_bytes(torch.empty_like(kv))]
    bomb = zstandard.ZstdCompressor(level=19).compress(b"a" * 2**28)
    table = b"".join(len(bomb).to_bytes(4, "little") for _ in range(SHAPE[0]))
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="declares 268435456 bytes"):
            CODECS["lossless"].decode_into(SHAPE, kv.dtype, memoryview(table + bomb * SHAPE[0]), out)
        assert tracemalloc.get_traced_memory()[1] < 2**22
    finally:
        tracemalloc.stop()


def test_lossy_codecs_do_not_apply_to_kv_that_is_fp8_already() -> None:
    assert not CODECS["fp8"].applies(torch.float8_e4m3fn) and not CODECS["k16v8"].applies(torch.uint8)
    assert CODECS["lossless"].applies(torch.float8_e4m3fn) and CODECS["fp8"].applies(torch.float16)


def test_codec_names_in_a_config_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\].codec: unknown codec 'gzip'; known: fp8, k16v8, lossless, none"):
        codecs.by_name("gzip", "tiers[0].codec")
    with pytest.raises(ConfigError, match="unknown codec 3"):
        codecs.by_name(3, "tiers[0].codec")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # not installed
    with pytest.raises(ConfigError, match=r"kvtier\[lossless\]"):
        codecs.by_name("lossless", "tiers[0].codec")
    assert codecs.by_name("fp8", "x") is CODECS["fp8"]


def test_without_zstandard_lossless_objects_are_refused_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else real(name, *a))
    assert codecs.accepted(CODECS["fp8"]) == {CODECS["none"], CODECS["fp8"]}
    monkeypatch.undo()
    assert codecs.accepted(CODECS["fp8"]) == {CODECS["none"], CODECS["lossless"], CODECS["fp8"]}


def test_codes_are_distinct_and_none_is_zero() -> None:
    assert codecs.NONE.code == 0 and len(codecs.BY_CODE) == len(CODECS)
