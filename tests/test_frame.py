from __future__ import annotations

import pytest
import torch

from kvtier.frame import HEADER_LEN, FrameError, ShardMeta, decode, encode_header, payload_tensor
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
