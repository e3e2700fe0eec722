"""The byte format of one stored shard: a fixed header, then the canonical KV payload.

Every tier stores exactly these bytes, and every read is verified here, so a torn, truncated, bit-flipped or
misplaced object is caught the same way whatever tier it came from.

Header (little-endian, 96 bytes)::

    magic "KVTR" | version u16 | header_len u16 | payload_len u64 | payload xxh3-128 (16)
    namespace (16) | chunk key (16) | head start, stop, total u16 x3 | layers u16 | tokens u32 | head_dim u16
    dtype u8 | pad u8 | created f64 | header xxh3-64 (8)

The payload is the shard ``[num_layers, 2, heads, chunk_tokens, head_dim]`` in the model's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import time
import warnings
from collections.abc import Sequence

import torch
import xxhash

from kvtier.keys import HeadRange, ShardKey

MAGIC = b"KVTR"
VERSION = 1
_BODY = struct.Struct("<4sHHQ16s16s16sHHHHIHBxd")
_TAIL = struct.Struct("<Q")
HEADER_LEN = _BODY.size + _TAIL.size

_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8,
)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class FrameError(ValueError):
    """The bytes are not a valid shard for the expected key (corrupt, truncated or misplaced)."""


@dataclasses.dataclass(frozen=True)
class ShardMeta:
    """Shape and dtype of one shard's payload."""

    num_layers: int
    chunk_tokens: int
    head_dim: int
    dtype: torch.dtype
    heads: HeadRange

    @functools.cached_property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.heads.count, self.chunk_tokens, self.head_dim)

    @functools.cached_property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def checksum(parts: Sequence[memoryview | bytes]) -> bytes:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


def encode_header(key: ShardKey, meta: ShardMeta, payload: Sequence[memoryview | bytes],
                  created: float | None = None) -> bytes:
    """The header for ``payload`` (given as parts, hashed in order without copying)."""
    if meta.dtype not in _DTYPE_CODE:
        raise ValueError(f"unsupported KV dtype {meta.dtype}; supported: {', '.join(map(str, _DTYPES))}")
    payload_len = sum(len(p) for p in payload)
    if payload_len != meta.nbytes:
        raise ValueError(f"payload is {payload_len} bytes, its shape {meta.shape} needs {meta.nbytes}")
    body = _BODY.pack(
        MAGIC, VERSION, HEADER_LEN, payload_len, checksum(payload),
        bytes.fromhex(key.namespace), bytes.fromhex(key.chunk),
        key.heads.start, key.heads.stop, key.heads.total,
        meta.num_layers, meta.chunk_tokens, meta.head_dim, _DTYPE_CODE[meta.dtype],
        time.time() if created is None else created,
    )
    return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))


@dataclasses.dataclass(frozen=True)
class Header:
    key: ShardKey
    meta: ShardMeta
    payload_len: int
    payload_checksum: bytes
    created: float


def decode_header(data: bytes | memoryview) -> Header:
    """Parse and check the header alone (not the payload)."""
    if len(data) < HEADER_LEN:
        raise FrameError(f"truncated header: {len(data)} bytes, need {HEADER_LEN}")
    body = bytes(data[:_BODY.size])
    (tail,) = _TAIL.unpack(bytes(data[_BODY.size:HEADER_LEN]))
    if xxhash.xxh3_64_intdigest(body) != tail:
        raise FrameError("header checksum mismatch")
    (magic, version, header_len, payload_len, payload_sum, ns, chunk, h0, h1, ht,
     layers, tokens, head_dim, dtype_code, created) = _BODY.unpack(body)
    if magic != MAGIC or version != VERSION or header_len != HEADER_LEN:
        raise FrameError(f"not a kvtier v{VERSION} shard (magic {magic!r}, version {version})")
    if min(layers, tokens, head_dim) < 1:
        raise FrameError(f"empty shape: {layers} layers, {tokens} tokens, head_dim {head_dim}")
    if dtype_code >= len(_DTYPES):
        raise FrameError(f"unknown dtype code {dtype_code}")
    try:
        heads = HeadRange.parse(f"{h0}-{h1}of{ht}")
    except ValueError as exc:
        raise FrameError(str(exc)) from exc
    key = ShardKey(ns.hex(), chunk.hex(), heads)
    meta = ShardMeta(layers, tokens, head_dim, _DTYPES[dtype_code], heads)
    if meta.nbytes != payload_len:
        raise FrameError(f"payload length {payload_len} does not match shape {meta.shape}")
    return Header(key, meta, payload_len, payload_sum, created)


def decode(data: bytes | bytearray | memoryview, expected: ShardKey | None = None) -> tuple[Header, memoryview]:
    """Verify a whole stored object; return its header and a view of its payload.

    Raises :class:`FrameError` when the object is truncated, extended, corrupt or belongs to another key.
    """
    view = memoryview(data).cast("B")
    payload = view[HEADER_LEN:]
    return verify(view[:HEADER_LEN], [payload], expected), payload


def verify(header: bytes | memoryview, payload: Sequence[memoryview], expected: ShardKey | None = None) -> Header:
    """:func:`decode` for an object read in parts: its header, and its payload (e.g. read straight into DRAM
    pages). Raises :class:`FrameError` as :func:`decode` does."""
    parsed = decode_header(header)
    size = sum(len(part) for part in payload)
    if size != parsed.payload_len:
        raise FrameError(f"payload is {size} bytes, header says {parsed.payload_len}")
    if expected is not None and parsed.key != expected:
        raise FrameError(f"object holds {parsed.key.name}, expected {expected.name}")
    if checksum(payload) != parsed.payload_checksum:
        raise FrameError("payload checksum mismatch")
    return parsed


# Network clients hand back immutable ``bytes``. kvtier only ever copies *from* a payload tensor, so a tensor
# over read-only memory is safe here, and copying each payload to silence torch's warning cost a fresh
# allocation (page faults) per chunk. The filter applies to calls from this module only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


def byte_tensor(payload: memoryview) -> torch.Tensor:
    """A zero-copy uint8 tensor over ``payload``, read-only buffers included; never write into it."""
    return torch.frombuffer(payload, dtype=torch.uint8)


def payload_tensor(payload: memoryview, meta: ShardMeta) -> torch.Tensor:
    """A zero-copy tensor over a verified payload (a source to copy from, never written)."""
    return byte_tensor(payload).view(meta.dtype).view(meta.shape)
