"""The byte format of one stored shard: a fixed header, then the canonical KV payload.

Every tier stores exactly these bytes, and every read is verified here, so a torn, truncated, bit-flipped or
misplaced object is caught the same way whatever tier it came from.

Header (little-endian; 96 bytes in version 1, 144 in version 2)::

    magic "KVTR" | version u16 | header_len u16 | payload_len u64 | payload xxh3-128 (16)
    namespace (16) | chunk key (16) | head start, stop, total u16 x3 | layers u16 | tokens u32 | head_dim u16
    dtype u8 | codec u8 | created f64
    [version 2: key id (8) | nonce (24) | GCM tag (16)]
    header xxh3-64 (8)

Version 1 is plain: the payload is the shard ``[num_layers, 2, heads, chunk_tokens, head_dim]`` in the model's
dtype as its codec stored it (:mod:`kvtier.codecs`; code 0, ``none``: as it is), checked by its xxh3. The shape and
dtype are the shard's own, decoded; ``payload_len`` is what is stored, which the codec bounds (a fixed-size codec:
exactly). Version 2 is sealed (:mod:`kvtier.sealing`): the payload is that shard encrypted with
AES-256-GCM, the header up to the nonce is the associated data (so the shard's key, shape and key id are
authenticated), the payload checksum field is zero (a plaintext digest would let anyone confirm a guessed
prompt), and the tag authenticates both. The xxh3 of the header only catches torn and bit-flipped headers early.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import time
import warnings
from collections.abc import Collection, Sequence
from typing import Protocol

import torch
import xxhash

from kvtier import codecs
from kvtier.errors import ObjectError
from kvtier.keys import HeadRange, ShardKey

MAGIC = b"KVTR"
VERSION = 1
SEALED_VERSION = 2
_LEAD = struct.Struct("<4sHH")
_BODY = struct.Struct("<4sHHQ16s16s16sHHHHIHBBd")
_SEAL = struct.Struct("<8s24s")  # key id, nonce
_TAG_LEN = 16
_TAIL = struct.Struct("<Q")
HEADER_LEN = _BODY.size + _TAIL.size
SEALED_HEADER_LEN = _BODY.size + _SEAL.size + _TAG_LEN + _TAIL.size
MAX_HEADER_LEN = SEALED_HEADER_LEN
_NO_CHECKSUM = bytes(16)

_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8,
)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class FrameError(ObjectError, ValueError):
    """The bytes are not a valid shard for the expected key (corrupt, truncated or misplaced): an
    :class:`~kvtier.errors.ObjectError` (one stored object is bad, not the tier), and a ValueError as it always
    was."""


class UnknownKey(FrameError):
    """A sealed shard under a key this process does not hold (a forgotten tenant's, another tenant's replayed
    here, or a newer master key this process was not given yet): a miss, counted apart from corruption."""


class RefusedCodec(FrameError):
    """A shard stored with a codec its reader does not accept (lossy KV where the tier's config takes exact KV
    only): a miss, left in place for the readers that accept it, counted apart from corruption."""


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


def _body(version: int, key: ShardKey, meta: ShardMeta, codec: codecs.Codec, payload_len: int,
          payload_sum: bytes, created: float | None) -> bytes:
    if meta.dtype not in _DTYPE_CODE:
        raise ValueError(f"unsupported KV dtype {meta.dtype}; supported: {', '.join(map(str, _DTYPES))}")
    if not codec.valid_len(meta.shape, meta.dtype, payload_len):
        most = codec.max_len(meta.shape, meta.dtype)
        raise ValueError(f"payload is {payload_len} bytes, its shape {meta.shape} {meta.dtype} with codec "
                         f"{codec.name} needs {'' if codec.fixed else 'at most '}{most}")
    return _BODY.pack(
        MAGIC, version, HEADER_LEN if version == VERSION else SEALED_HEADER_LEN, payload_len, payload_sum,
        bytes.fromhex(key.namespace), bytes.fromhex(key.chunk),
        key.heads.start, key.heads.stop, key.heads.total,
        meta.num_layers, meta.chunk_tokens, meta.head_dim, _DTYPE_CODE[meta.dtype], codec.code,
        time.time() if created is None else created,
    )


def encode_header(key: ShardKey, meta: ShardMeta, payload: Sequence[memoryview | bytes],
                  created: float | None = None, codec: codecs.Codec = codecs.NONE) -> bytes:
    """The plain (version 1) header for ``payload`` (as ``codec`` stores the shard; given as parts, hashed in
    order without copying)."""
    body = _body(VERSION, key, meta, codec, sum(len(p) for p in payload), checksum(payload), created)
    return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))


def sealed_aad(key: ShardKey, meta: ShardMeta, key_id: bytes, nonce: bytes, created: float | None = None,
               codec: codecs.Codec = codecs.NONE, payload_len: int | None = None) -> bytes:
    """The first part of a sealed (version 2) header, up to its nonce: the associated data of its encryption
    (the codec and the stored payload's length among it)."""
    length = meta.nbytes if payload_len is None else payload_len
    return _body(SEALED_VERSION, key, meta, codec, length, _NO_CHECKSUM, created) + _SEAL.pack(key_id, nonce)


def sealed_header(aad: bytes, tag: bytes) -> bytes:
    """The whole sealed header: :func:`sealed_aad`'s bytes, the encryption's tag, the header's own xxh3."""
    assert len(aad) == _BODY.size + _SEAL.size and len(tag) == _TAG_LEN
    head = aad + tag
    return head + _TAIL.pack(xxhash.xxh3_64_intdigest(head))


@dataclasses.dataclass(frozen=True)
class Sealing:
    """How a version 2 shard was sealed: its key id, nonce and tag, and the header bytes it authenticates."""

    key_id: bytes
    nonce: bytes
    tag: bytes
    aad: bytes


@dataclasses.dataclass(frozen=True)
class Header:
    key: ShardKey
    meta: ShardMeta
    payload_len: int
    payload_checksum: bytes
    created: float
    sealing: Sealing | None = None  # None: a plain (version 1) shard
    codec: codecs.Codec = codecs.NONE  # how the payload stores the shard

    @property
    def length(self) -> int:
        return HEADER_LEN if self.sealing is None else SEALED_HEADER_LEN


class Opener(Protocol):
    """What decrypts sealed shards (:class:`kvtier.sealing.Sealer`)."""

    def open_into(self, header: Header, payload: Sequence[memoryview]) -> None:
        """Decrypt ``payload`` (writable) in place; :class:`FrameError` if it fails to authenticate,
        :class:`UnknownKey` if its key is not held."""


def decode_header(data: bytes | memoryview) -> Header:
    """Parse and check the header alone (not the payload); ``data`` may run on past it."""
    if len(data) < _LEAD.size:
        raise FrameError(f"truncated header: {len(data)} bytes")
    magic, version, header_len = _LEAD.unpack(bytes(data[:_LEAD.size]))
    if magic != MAGIC or (version, header_len) not in ((VERSION, HEADER_LEN), (SEALED_VERSION, SEALED_HEADER_LEN)):
        raise FrameError(f"not a kvtier v{VERSION} or v{SEALED_VERSION} shard (magic {magic!r}, version {version})")
    if len(data) < header_len:
        raise FrameError(f"truncated header: {len(data)} bytes, need {header_len}")
    head = bytes(data[:header_len - _TAIL.size])
    (tail,) = _TAIL.unpack(bytes(data[header_len - _TAIL.size:header_len]))
    if xxhash.xxh3_64_intdigest(head) != tail:
        raise FrameError("header checksum mismatch")
    body = head[:_BODY.size]
    sealing = None
    if version == SEALED_VERSION:
        key_id, nonce = _SEAL.unpack(head[_BODY.size:_BODY.size + _SEAL.size])
        sealing = Sealing(key_id, nonce, head[_BODY.size + _SEAL.size:], head[:_BODY.size + _SEAL.size])
    (_, _, _, payload_len, payload_sum, ns, chunk, h0, h1, ht,
     layers, tokens, head_dim, dtype_code, codec_code, created) = _BODY.unpack(body)
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
    # A code this release does not know (a later kvtier's, its header intact): refused by verify once the key and
    # the sealing are checked, and left in place for the engines that know it.
    codec = codecs.BY_CODE.get(codec_code, codecs.UNKNOWN)
    if codec is not codecs.UNKNOWN and not codec.valid_len(meta.shape, meta.dtype, payload_len):
        raise FrameError(f"payload length {payload_len} does not fit shape {meta.shape} with codec {codec.name}")
    return Header(key, meta, payload_len, payload_sum, created, sealing, codec)


def decode(data: bytes | bytearray | memoryview, expected: ShardKey | None = None,
           opener: Opener | None = None, accepts: Collection[codecs.Codec] | None = None) -> tuple[Header, memoryview]:
    """Verify a whole stored object; return its header and a view of its payload as stored (decrypted, when
    sealed, into a copy; still encoded by its codec: see :func:`decoded`).

    Raises :class:`FrameError` when the object is truncated, extended, corrupt or belongs to another key, and when
    it is sealed and ``opener`` is None or plain and ``opener`` is given, or of a codec not in ``accepts`` (see
    :func:`verify`).
    """
    view = memoryview(data).cast("B")
    length = decode_header(view).length
    payload = view[length:]
    if length == SEALED_HEADER_LEN and opener is not None:  # decrypted into a copy: never into a tier's own buffer
        payload = memoryview(bytearray(payload))
    return verify(view[:length], [payload], expected, opener, accepts), payload


def decoded(header: Header, payload: memoryview) -> memoryview:
    """A verified payload's shard as it was put: itself when stored as it is, else decoded by its codec into a new
    buffer. Raises :class:`~kvtier.codecs.CodecError` when it does not decode."""
    if header.codec is codecs.NONE:
        return payload
    buf = memoryview(bytearray(header.meta.nbytes))
    decode_into(header, payload, [buf])
    return buf


def decode_into(header: Header, payload: memoryview, out: Sequence[memoryview]) -> None:
    """Decode a verified payload by its codec into ``out`` (writable: the shard's bytes in parts, e.g. a DRAM
    entry's pages). Raises :class:`~kvtier.codecs.CodecError` when it does not decode."""
    header.codec.decode_into(header.meta.shape, header.meta.dtype, payload, out)


def verify(header: bytes | memoryview, payload: Sequence[memoryview], expected: ShardKey | None = None,
           opener: Opener | None = None, accepts: Collection[codecs.Codec] | None = None) -> Header:
    """:func:`decode` for an object read in parts: its header, and its payload (e.g. read straight into DRAM
    pages, and decrypted there). With an ``opener`` (encryption on) only a sealed object passes: a plain one is
    what a writer to the tier could forge. An object of a codec not in ``accepts`` (None: any) is
    :class:`RefusedCodec`, before its payload is checked (a plain object where encryption is on is refused as
    forged first). Raises :class:`FrameError` as :func:`decode` does."""
    parsed = decode_header(header)
    if expected is not None and parsed.key != expected:
        raise FrameError(f"object holds {parsed.key.name}, expected {expected.name}")
    if parsed.sealing is None and opener is not None:
        raise FrameError("a plain object where encryption is on (only sealed objects are read)")
    if parsed.sealing is not None and opener is None:
        raise UnknownKey("sealed, and this store has no encryption key")
    if parsed.codec is codecs.UNKNOWN:
        raise RefusedCodec(f"stored with a codec this release does not know; known: "
                           f"{', '.join(f'{c.code} ({c.name})' for c in codecs.BY_CODE.values())}")
    if accepts is not None and parsed.codec not in accepts:
        raise RefusedCodec(f"stored with codec {parsed.codec.name}; this tier's reads accept "
                           f"{', '.join(sorted(c.name for c in accepts))}")
    size = sum(len(part) for part in payload)
    if size != parsed.payload_len:
        raise FrameError(f"payload is {size} bytes, header says {parsed.payload_len}")
    if opener is None:
        if checksum(payload) != parsed.payload_checksum:
            raise FrameError("payload checksum mismatch")
    else:
        opener.open_into(parsed, payload)
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
