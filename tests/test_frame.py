from __future__ import annotations

import pytest
import torch

from kvtier.errors import KVTierError, ObjectError, TierError
from kvtier.frame import HEADER_LEN, FrameError, ShardMeta, UnknownKey, decode, encode_header, payload_tensor
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
