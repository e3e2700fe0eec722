"""Codecs: how a shard's payload is stored on a secondary tier (``codec:`` on each tier in the config).

A codec turns a canonical shard ``[layers, 2 (K, V), heads, tokens, head_dim]`` into the bytes a tier stores and
back. It moves bytes and decides nothing; the cascade writers encode (on their own threads), the reading threads
decode straight into the DRAM entry reserved for the shard, a layer at a time (a read that has no entry, its
shape not yet known or DRAM full, decodes into a buffer of its own).

========  =====  =====================================================================================================
name      exact  stored payload, layer after layer
========  =====  =====================================================================================================
none      yes    the shard as it is
lossless  yes    per layer: its bytes split into planes (every element's first byte, then every second byte...), then
                 zstandard; a table of the layers' compressed lengths first (``u32`` each)
fp8       no     per layer: key scales, value scales (bf16: one per token and group of 32 channels, each ``max |x| /
                 448`` rounded up, so nothing saturates), then keys and values in float8 e4m3 (each element divided
                 by its scale)
k16v8     no     per layer: value scales as fp8's, the keys as they are, the values in float8 e4m3
========  =====  =====================================================================================================

The error of a lossy codec is bounded by the format: e4m3 keeps 3 mantissa bits, so an element off zero is
within ``2**-4`` of itself relative (half a step), or within ``scale * 2**-10`` near zero (e4m3's smallest
subnormal step is ``2**-9``). Lossy codecs apply to float KV (bf16, fp16, fp32); KV that is fp8 already is stored
as it is (``none``). They refuse KV holding NaN or infinity (:class:`NotEncodable`), which e4m3 would turn into
finite numbers or lose.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import struct
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar

import numpy as np
import torch

from kvtier.errors import ConfigError, NotEncodable, ObjectError

Shape = tuple[int, int, int, int, int]  # [layers, 2, heads, tokens, head_dim]
Parts = Sequence[memoryview]
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
# Payloads come back from network clients as immutable bytes; a codec only reads them (as frame.py explains).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)
_LENGTH = struct.Struct("<I")


class CodecError(ObjectError, ValueError):
    """A stored payload its codec cannot decode (bad scales, lengths, a compressed stream that does not expand
    to the shard): one malformed object, a miss, counted as corrupt and removed."""


class Codec(ABC):
    """One codec. ``code`` is its id in a stored frame's header (:mod:`kvtier.frame`), never reused."""

    name: ClassVar[str]
    code: ClassVar[int]
    exact: ClassVar[bool]
    fixed: ClassVar[bool] = True  # every shard of a shape is stored in max_len bytes (else: at most)
    requires: ClassVar[tuple[str, str] | None] = None  # (a module it imports, the kvtier extra that installs it)

    def __init__(self) -> None:
        self._scratch = threading.local()  # each thread's buffers, reused by its next call

    def applies(self, dtype: torch.dtype) -> bool:
        """Whether this codec stores KV of ``dtype`` (else the shard is stored as it is, codec ``none``)."""
        return True

    @abstractmethod
    def max_len(self, shape: Shape, dtype: torch.dtype) -> int:
        """The longest payload this codec stores for a shard (a fixed-size codec's only length)."""

    def valid_len(self, shape: Shape, dtype: torch.dtype, length: int) -> bool:
        most = self.max_len(shape, dtype)
        return length == most if self.fixed else 0 < length <= most

    @abstractmethod
    def encode(self, shape: Shape, dtype: torch.dtype, raw: Parts) -> list[memoryview]:
        """The stored payload of the shard in ``raw`` (its bytes in order, in parts), in buffers of this thread's
        that its next call reuses (write them before encoding again). Raises :class:`NotEncodable`."""

    @abstractmethod
    def decode_into(self, shape: Shape, dtype: torch.dtype, coded: memoryview, out: Parts) -> None:
        """Decode a stored payload into ``out`` (the shard's bytes, writable, in parts). Raises
        :class:`CodecError` when ``coded`` is malformed."""

    def error_bound(self, kv: torch.Tensor) -> torch.Tensor:
        """The most each element of a shard ``kv`` (``[layers, 2, heads, tokens, head_dim]``) may be off once
        stored and read back, from the format alone (zero: exact)."""
        return torch.zeros_like(kv, dtype=torch.float32)

    def _buffer(self, name: str, nbytes: int) -> memoryview:
        buf = getattr(self._scratch, name, None)
        if buf is None or len(buf) < nbytes:
            buf = memoryview(bytearray(nbytes))
            setattr(self._scratch, name, buf)
        return buf[:nbytes]


def _layers(shape: Shape, dtype: torch.dtype) -> tuple[int, int]:
    """(layers, the bytes of one layer) of a raw shard."""
    per = dtype.itemsize
    for d in shape[1:]:
        per *= d
    return shape[0], per


class _Raw:
    """A raw shard's bytes in parts, a layer at a time: a view where the layer lies in one part, else a copy
    through a scratch buffer (the parts of a DRAM entry split across its extents)."""

    def __init__(self, parts: Parts, per_layer: int, scratch: memoryview) -> None:
        self._parts = [p.cast("B") if p.format != "B" else p for p in parts]
        self._per = per_layer
        self._scratch = scratch

    def _pieces(self, layer: int) -> Iterator[tuple[memoryview, int]]:
        """(a piece of the part holding it, its offset within the layer) for each piece of layer ``layer``."""
        start, stop = layer * self._per, (layer + 1) * self._per
        pos = 0
        for part in self._parts:
            end = pos + len(part)
            if end > start and pos < stop:
                a, b = max(start, pos), min(stop, end)
                yield part[a - pos:b - pos], a - start
            pos = end

    def read(self, layer: int) -> memoryview:
        pieces = list(self._pieces(layer))
        if len(pieces) == 1:
            return pieces[0][0]
        for piece, at in pieces:
            self._scratch[at:at + len(piece)] = piece
        return self._scratch

    def target(self, layer: int) -> memoryview:
        """Where layer ``layer`` is to be written: the part itself, or the scratch buffer (then :meth:`commit`)."""
        pieces = list(self._pieces(layer))
        return pieces[0][0] if len(pieces) == 1 else self._scratch

    def commit(self, layer: int, written: memoryview) -> None:
        if written.obj is not self._scratch.obj:
            return
        for piece, at in self._pieces(layer):
            piece[:] = written[at:at + len(piece)]

    def total(self) -> int:
        return sum(len(p) for p in self._parts)


def _tensor(buf: memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(*shape)


class NoCodec(Codec):
    name = "none"
    code = 0
    exact = True

    def max_len(self, shape: Shape, dtype: torch.dtype) -> int:
        return _layers(shape, dtype)[0] * _layers(shape, dtype)[1]

    def encode(self, shape: Shape, dtype: torch.dtype, raw: Parts) -> list[memoryview]:
        return list(raw)

    def decode_into(self, shape: Shape, dtype: torch.dtype, coded: memoryview, out: Parts) -> None:
        pos = 0
        for part in out:
            part[:] = coded[pos:pos + len(part)]
            pos += len(part)


class _Fp8Layers(Codec):
    """fp8 and k16v8: per layer, the scales, then the keys (in fp8, or as they are), then the values in fp8."""

    exact = False
    keys_fp8: ClassVar[bool]

    def applies(self, dtype: torch.dtype) -> bool:
        return dtype in _FLOATS

    def _sizes(self, shape: Shape, dtype: torch.dtype) -> tuple[int, int, int, int]:
        """(key scale bytes, value scale bytes, key bytes, value bytes) of one layer."""
        _, _, heads, tokens, head_dim = shape
        elems = heads * tokens * head_dim
        scales = 2 * heads * tokens * (head_dim // group_of(head_dim))
        return (scales if self.keys_fp8 else 0, scales, elems if self.keys_fp8 else elems * dtype.itemsize, elems)

    def max_len(self, shape: Shape, dtype: torch.dtype) -> int:
        return shape[0] * sum(self._sizes(shape, dtype))

    def error_bound(self, kv: torch.Tensor) -> torch.Tensor:
        """Half an e4m3 step (``2**-4`` of the value), or half its smallest step near zero (``scale * 2**-10``,
        the scale at most 1% above its group's ``max |x| / 448``: rounded up to bf16), and the rounding into the
        KV's dtype (half its epsilon), with a little slack for the float32 division."""
        x = kv.float().abs()
        group = group_of(kv.shape[-1])
        scale = (x.unflatten(-1, (-1, group)).amax(dim=-1, keepdim=True) / FP8_MAX * 1.01).expand(
            *x.shape[:-1], -1, group).flatten(-2)
        bound = torch.maximum(x * 2**-4, scale * 2**-10) + x * (torch.finfo(kv.dtype).eps / 2)
        if not self.keys_fp8:
            bound[:, 0] = 0  # keys kept as they are: exact
        return bound * 1.001

    def encode(self, shape: Shape, dtype: torch.dtype, raw: Parts) -> list[memoryview]:
        layers, per = _layers(shape, dtype)
        _, _, heads, tokens, head_dim = shape
        ks_n, vs_n, k_n, v_n = self._sizes(shape, dtype)
        groups = (heads, tokens, head_dim // group_of(head_dim), group_of(head_dim))
        out = self._buffer("encoded", self.max_len(shape, dtype))
        src = _Raw(raw, per, self._buffer("layer", per))
        pos = 0
        for layer in range(layers):
            kv = _tensor(src.read(layer), dtype, (2, *groups))
            k_scales, v_scales = out[pos:pos + ks_n], out[pos + ks_n:pos + ks_n + vs_n]
            pos += ks_n + vs_n
            if self.keys_fp8:
                _quantize(kv[0], _tensor(k_scales, torch.bfloat16, (*groups[:3], 1)),
                          _tensor(out[pos:pos + k_n], torch.float8_e4m3fn, groups))
            else:
                if not bool(torch.isfinite(kv[0]).all()):
                    raise NotEncodable("keys hold NaN or infinity")
                out[pos:pos + k_n] = kv[0].contiguous().view(torch.uint8).numpy().reshape(-1).data
            pos += k_n
            _quantize(kv[1], _tensor(v_scales, torch.bfloat16, (*groups[:3], 1)),
                      _tensor(out[pos:pos + v_n], torch.float8_e4m3fn, groups))
            pos += v_n
        return [out[:pos]]

    def decode_into(self, shape: Shape, dtype: torch.dtype, coded: memoryview, out: Parts) -> None:
        layers, per = _layers(shape, dtype)
        _, _, heads, tokens, head_dim = shape
        ks_n, vs_n, k_n, v_n = self._sizes(shape, dtype)
        if len(coded) != self.max_len(shape, dtype):
            raise CodecError(f"{self.name} payload is {len(coded)} bytes, its shape needs "
                             f"{self.max_len(shape, dtype)}")
        groups = (heads, tokens, head_dim // group_of(head_dim), group_of(head_dim))
        dst = _Raw(out, per, self._buffer("layer", per))
        codes = self._buffer("codes", 4 * heads * tokens * head_dim)  # (int32 indices into the fp8 table)
        pos = 0
        for layer in range(layers):
            k_scales = _tensor(coded[pos:pos + ks_n], torch.bfloat16, (*groups[:3], 1)) if ks_n else None
            v_scales = _tensor(coded[pos + ks_n:pos + ks_n + vs_n], torch.bfloat16, (*groups[:3], 1))
            pos += ks_n + vs_n
            if not (_valid_scales(v_scales) and (k_scales is None or _valid_scales(k_scales))):
                raise CodecError(f"{self.name}: layer {layer} has a negative, NaN or infinite scale")
            target = dst.target(layer)
            kv = _tensor(target, dtype, (2, *groups))
            if k_scales is not None:
                _dequantize(coded[pos:pos + k_n], k_scales, kv[0], codes)
            else:
                kv[0].view(-1).view(torch.uint8).copy_(torch.frombuffer(coded[pos:pos + k_n], dtype=torch.uint8))
            pos += k_n
            _dequantize(coded[pos:pos + v_n], v_scales, kv[1], codes)
            pos += v_n
            dst.commit(layer, target)


def group_of(head_dim: int) -> int:
    """The channels of one token that share a scale: 32, fewer where ``head_dim`` is no multiple of 32. Chosen on a
    sweep of held-out text where it had the lowest KL; ``bench_codecs.py``'s ablations since put a scale per token
    and finer groups within the spread between sets of prompts (docs/benchmarks.md, "Codecs")."""
    return math.gcd(head_dim, 32)


def _valid_scales(scales: torch.Tensor) -> bool:
    return bool(torch.isfinite(scales).all()) and bool((scales >= 0).all())


def _quantize(x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
    """``x`` (``[heads, tokens, groups, group]``) into e4m3 ``codes`` with one scale per group, written to
    ``scales`` (bf16)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    if not bool(torch.isfinite(amax).all()):  # max propagates NaN, and an infinity is its own max
        raise NotEncodable("KV holds NaN or infinity")
    scale = (amax / FP8_MAX).to(torch.bfloat16)
    # Rounded up to the next bf16 where it rounded down (a positive bf16's successor is its bits plus one), so that
    # |x| / scale <= 448: nothing saturates.
    low = scale.float() * FP8_MAX < amax
    scale.view(torch.int16)[low] += 1
    scale[amax == 0] = 1
    scales.copy_(scale)
    codes.copy_((x.float() / scale.float()).clamp_(-FP8_MAX, FP8_MAX))


# Every e4m3 byte's value as float32 (its two NaN bytes included): a decode is a table lookup and a multiply.
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _dequantize(coded: memoryview, scales: torch.Tensor, dst: torch.Tensor, scratch: memoryview) -> None:
    """e4m3 bytes times their scales, into ``dst`` (in its dtype: rounded once)."""
    idx = torch.frombuffer(scratch[:4 * len(coded)], dtype=torch.int32)
    idx.copy_(torch.frombuffer(coded, dtype=torch.uint8))
    values = torch.index_select(_FP8_VALUES, 0, idx).view(dst.shape)
    torch.mul(values, scales, out=values)
    # Within the dtype: a scale rounded up to bf16 can take an element at the dtype's largest value past it
    # (fp16's 65504 would read back as infinity).
    top = torch.finfo(dst.dtype).max
    values.clamp_(-top, top)
    dst.copy_(values)


class Fp8(_Fp8Layers):
    name = "fp8"
    code = 1
    keys_fp8 = True


class K16V8(_Fp8Layers):
    name = "k16v8"
    code = 2
    keys_fp8 = False


class Lossless(Codec):
    """Byte planes, then zstandard (level 1), a layer at a time."""

    name = "lossless"
    code = 3
    exact = True
    fixed = False
    requires = ("zstandard", "lossless")
    LEVEL = 1

    def max_len(self, shape: Shape, dtype: torch.dtype) -> int:
        layers, per = _layers(shape, dtype)
        return layers * (_LENGTH.size + per + per // 128 + 64)  # zstd's bound for a frame it cannot shrink

    def encode(self, shape: Shape, dtype: torch.dtype, raw: Parts) -> list[memoryview]:
        import zstandard

        layers, per = _layers(shape, dtype)
        src = _Raw(raw, per, self._buffer("layer", per))
        planes = self._buffer("planes", per)
        out = self._buffer("encoded", self.max_len(shape, dtype))
        compressor = zstandard.ZstdCompressor(level=self.LEVEL)
        table = layers * _LENGTH.size
        pos = table
        for layer in range(layers):
            _split_planes(src.read(layer), planes, dtype.itemsize)
            frame = compressor.compress(planes)
            out[pos:pos + len(frame)] = frame
            _LENGTH.pack_into(out, layer * _LENGTH.size, len(frame))
            pos += len(frame)
        return [out[:pos]]

    def decode_into(self, shape: Shape, dtype: torch.dtype, coded: memoryview, out: Parts) -> None:
        import zstandard

        layers, per = _layers(shape, dtype)
        table = layers * _LENGTH.size
        if len(coded) < table:
            raise CodecError(f"lossless payload of {len(coded)} bytes holds no table of {layers} layers")
        lengths = [_LENGTH.unpack_from(coded, i * _LENGTH.size)[0] for i in range(layers)]
        if table + sum(lengths) != len(coded):
            raise CodecError(f"lossless payload is {len(coded)} bytes, its table says {table + sum(lengths)}")
        dst = _Raw(out, per, self._buffer("layer", per))
        planes = self._buffer("planes", per)
        decompressor = zstandard.ZstdDecompressor()
        pos = table
        for layer, length in enumerate(lengths):
            piece = coded[pos:pos + length]
            try:
                # The frame's declared size first: zstandard allocates what a frame declares, whatever
                # max_output_size says, so a forged frame of a few bytes could ask for gigabytes.
                declared = zstandard.get_frame_parameters(piece).content_size
                if declared != per:
                    raise CodecError(f"lossless: layer {layer} declares {declared} bytes, not {per}")
                got = decompressor.decompress(piece, max_output_size=per, allow_extra_data=False)
            except zstandard.ZstdError as exc:
                raise CodecError(f"lossless: layer {layer} does not decompress: {exc}") from None
            if len(got) != per:
                raise CodecError(f"lossless: layer {layer} expands to {len(got)} bytes, not {per}")
            planes[:] = got
            target = dst.target(layer)
            _join_planes(planes, target, dtype.itemsize)
            dst.commit(layer, target)
            pos += length


def _split_planes(src: memoryview, planes: memoryview, itemsize: int) -> None:
    a = np.frombuffer(src, dtype=np.uint8).reshape(-1, itemsize)
    np.frombuffer(planes, dtype=np.uint8).reshape(itemsize, -1)[:] = a.T


def _join_planes(planes: memoryview, dst: memoryview, itemsize: int) -> None:
    a = np.frombuffer(planes, dtype=np.uint8).reshape(itemsize, -1)
    np.frombuffer(dst, dtype=np.uint8).reshape(-1, itemsize)[:] = a.T


class UnknownCodec(Codec):
    """The codec of an object whose code this release does not know (a later release's): never decoded; a reader
    refuses such an object (leaving it in place) once its key and sealing have been checked."""

    name = "unknown"
    code = -1
    exact = False
    fixed = False

    def max_len(self, shape: Shape, dtype: torch.dtype) -> int:
        return 0

    def encode(self, shape: Shape, dtype: torch.dtype, raw: Parts) -> list[memoryview]:
        raise CodecError("an unknown codec encodes nothing")

    def decode_into(self, shape: Shape, dtype: torch.dtype, coded: memoryview, out: Parts) -> None:
        raise CodecError("an unknown codec decodes nothing")


UNKNOWN = UnknownCodec()
CODECS: dict[str, Codec] = {c.name: c for c in (NoCodec(), Fp8(), K16V8(), Lossless())}
BY_CODE: dict[int, Codec] = {c.code: c for c in CODECS.values()}
NONE = CODECS["none"]


def by_name(name: object, field: str) -> Codec:
    """The codec named ``name`` (a config value at ``field``); a :class:`ConfigError` naming the known ones, or
    the package it needs when that is not installed (checked here: a config must not fail on its first write)."""
    if not isinstance(name, str) or name not in CODECS:
        raise ConfigError(f"{field}: unknown codec {name!r}; known: {', '.join(sorted(CODECS))}")
    codec = CODECS[name]
    if codec.requires is not None:
        module, extra = codec.requires
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConfigError(f"{field}: codec {name!r} needs the {module} package (pip install "
                              f"'kvtier[{extra}]')") from None
    return codec


def accepted(own: Codec, listed: Iterable[Codec] = ()) -> frozenset[Codec]:
    """What a tier's reads accept: the exact codecs this installation can decode (lossless needs zstandard: without
    it, lossless objects are refused, left for engines that have it), its own, and those its config lists
    (``accept_codecs``; a config naming a codec checks its package: :func:`by_name`)."""
    return frozenset({c for c in CODECS.values() if c.exact and _installed(c)} | {own, *listed})


def _installed(codec: Codec) -> bool:
    return codec.requires is None or importlib.util.find_spec(codec.requires[0]) is not None
