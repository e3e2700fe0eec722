from __future__ import annotations

import pytest
import torch
import xxhash

from kvtier.errors import KVTierError, ObjectError, TierError
from kvtier.codecs import CODECS
from kvtier.frame import (HEADER_LEN, FrameError, RefusedCodec, ShardMeta, UnknownKey, decode, decode_into, decoded,
                          encode_header, payload_tensor)
from kvtier.health import Fault, classify
from kvtier.keys import HeadRange, ShardKey

KEY = ShardKey("1" * 32, "2" * 32, HeadRange(2, 4, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_round_trip(dtype: torch.dtype) -> None:
    meta = ShardMeta(3, 16, 8, dtype, KEY.heads)
    shard = torch.randn(meta.shape).to(dtype)
    payload = shard.contiguous().view(torch.uint8).numpy().tobytes()
    blob = encode_header(KEY, meta, [payload[:100], payload[100:]]) + payload
    header, view = decode(blob, expected=KEY)
    assert header.meta == meta and header.key == KEY and len(blob) == HEADER_LEN + meta.nbytes
    assert torch.equal(payload_tensor(view, meta).view(torch.uint8), shard.view(torch.uint8))


def test_every_single_bit_flip_is_caught() -> None:
    meta = ShardMeta(1, 4, 4, torch.bfloat16, KEY.heads)
    payload = torch.randn(meta.shape).bfloat16().view(torch.uint8).numpy().tobytes()
    blob = bytearray(encode_header(KEY, meta, [payload]) + payload)
    for bit in range(len(blob) * 8):
        damaged = bytearray(blob)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameError):
            decode(damaged, expected=KEY)


def test_wrong_key_and_bad_lengths() -> None:
    meta = ShardMeta(1, 4, 4, torch.bfloat16, KEY.heads)
    payload = bytes(meta.nbytes)
    blob = encode_header(KEY, meta, [payload]) + payload
    with pytest.raises(FrameError, match="expected"):
        decode(blob, expected=ShardKey(KEY.namespace, "3" * 32, KEY.heads))
    for bad in (blob[:-1], blob + b"\0", blob[:10], b""):
        with pytest.raises(FrameError):
            decode(bad, expected=KEY)
    with pytest.raises(ValueError, match="needs"):
        encode_header(KEY, meta, [payload[:-2]])


def test_a_bad_shard_is_an_object_error_and_still_a_value_error() -> None:
    """FrameError sits in errors.py's tree (one bad object, not an outage of the tier) and stays a ValueError for
    callers that caught it as one; an unknown key stays apart from corruption."""
    with pytest.raises(FrameError) as err:
        decode(b"", expected=KEY)
    assert isinstance(err.value, ObjectError) and isinstance(err.value, TierError)
    assert isinstance(err.value, KVTierError) and isinstance(err.value, ValueError)
    assert issubclass(UnknownKey, FrameError)
    assert classify(err.value) is Fault.CORRUPT and classify(UnknownKey("k")) is Fault.UNKNOWN_KEY


# -- codecs in the frame ---------------------------------------------------------------------------------------
def coded_object(codec_name: str, meta: ShardMeta) -> tuple[bytes, torch.Tensor]:
    shard = (torch.randn(meta.shape) * 3).to(meta.dtype)
    codec = CODECS[codec_name]
    stored = b"".join(codec.encode(meta.shape, meta.dtype, [memoryview(shard.view(torch.uint8).numpy().reshape(-1))]))
    return encode_header(KEY, meta, [stored], codec=codec) + stored, shard


@pytest.mark.parametrize("name", ["fp8", "k16v8", "lossless"])
def test_a_coded_shard_names_its_codec_and_decodes_to_the_shard(name: str) -> None:
    meta = ShardMeta(2, 16, 8, torch.bfloat16, KEY.heads)
    blob, shard = coded_object(name, meta)
    header, stored = decode(blob, expected=KEY)
    assert header.codec is CODECS[name] and header.meta == meta and header.payload_len == len(stored) < meta.nbytes
    got = payload_tensor(decoded(header, stored), meta)
    assert bool(((got.float() - shard.float()).abs() <= CODECS[name].error_bound(shard)).all())
    out = torch.empty_like(shard)
    decode_into(header, stored, [memoryview(out.view(torch.uint8).numpy().reshape(-1))])
    assert torch.equal(out, got)


def test_a_reader_takes_only_the_codecs_it_accepts_before_the_payload_is_checked() -> None:
    meta = ShardMeta(2, 16, 8, torch.bfloat16, KEY.heads)
    blob, _ = coded_object("fp8", meta)
    exact = {CODECS["none"], CODECS["lossless"]}
    with pytest.raises(RefusedCodec, match="codec fp8; this tier's reads accept lossless, none"):
        decode(blob, expected=KEY, accepts=exact)
    damaged = bytearray(blob)
    damaged[-1] ^= 1  # a payload that fails its checksum is still only refused: nothing of it is trusted
    with pytest.raises(RefusedCodec):
        decode(damaged, expected=KEY, accepts=exact)
    assert classify(RefusedCodec("x")) is Fault.REFUSED_CODEC

    class Opener:
        def open_into(self, header: object, payload: object) -> None:
            raise AssertionError("a plain object is never opened")

    with pytest.raises(FrameError, match="plain object where encryption is on") as forged:
        decode(blob, expected=KEY, opener=Opener(), accepts=exact)  # forged, whatever codec it claims
    assert not isinstance(forged.value, RefusedCodec)
    assert decode(blob, expected=KEY, accepts=exact | {CODECS["fp8"]})[0].codec is CODECS["fp8"]


def test_an_unknown_codec_or_a_length_its_codec_cannot_have_is_a_bad_frame() -> None:
    meta = ShardMeta(2, 16, 8, torch.bfloat16, KEY.heads)
    blob, _ = coded_object("fp8", meta)
    at = 4 + 2 + 2 + 8 + 16 + 16 + 16 + 2 * 3 + 2 + 4 + 2 + 1  # the codec byte, after the dtype

    def rewritten(codec_code: int, blob: bytes = blob) -> bytes:
        head = bytearray(blob[:HEADER_LEN - 8])
        head[at] = codec_code
        return bytes(head) + xxhash.xxh3_64_intdigest(bytes(head)).to_bytes(8, "little") + blob[HEADER_LEN:]

    with pytest.raises(RefusedCodec, match="does not know"):  # a later kvtier's: left in place
        decode(rewritten(200), expected=KEY)
    with pytest.raises(FrameError, match="expected") as misplaced:  # but its key is checked first
        decode(rewritten(200), expected=ShardKey(KEY.namespace, "3" * 32, KEY.heads))
    assert not isinstance(misplaced.value, RefusedCodec)
    with pytest.raises(FrameError, match="does not fit shape"):  # an fp8 payload claimed to be k16v8
        decode(rewritten(CODECS["k16v8"].code), expected=KEY)
    with pytest.raises(FrameError, match="does not fit shape"):  # or plain
        decode(rewritten(0), expected=KEY)
    with pytest.raises(FrameError):  # a flipped codec byte without the header's checksum redone
        decode(blob[:at] + bytes([blob[at] ^ 2]) + blob[at + 1:], expected=KEY)
    with pytest.raises(ValueError, match="needs 1"):
        encode_header(KEY, meta, [b"x"], codec=CODECS["fp8"])
