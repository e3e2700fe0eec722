"""Names of stored KV: namespaces, prefix-chained chunk keys and head-shard keys.

Chunk ``i``'s key is ``blake2b(key[i-1] || tokens[i])`` (128 bits) and the chain's root hashes the namespace, so
one key names a whole prefix inside one namespace. Token ids never appear in a key or on disk.

Unkeyed, these names can be checked by anyone who sees them: a tier shows the namespace id (the chain's root) and
each chunk's key (the next one's parent), so whoever reads a tier can hash a guessed prompt and confirm it. A
namespace with a :attr:`Namespace.name_key` hashes everything under that key (keyed BLAKE2b, a PRF): its id and
every key look random to whoever lacks the key, and nothing in a tier confirms a guess. A store with encryption
names its objects so (:meth:`kvtier.store.KVStore.named`, the key from its keyring); one without keeps the unkeyed
names.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import xxhash

DIGEST_BYTES = 16  # a namespace id, a chunk key, a tail key: blake2b digests of 128 bits
LAYOUT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class InputSpan(NamedTuple):
    """A non-token input (an image, an audio clip) over placeholder tokens ``[offset, offset + length)``.

    Placeholder ids are the same for every image, so the tokens alone do not name the KV: ``identifier`` (a hash
    of the input's content, e.g. vLLM's multimodal hash) does.
    """

    offset: int
    length: int
    identifier: str


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Everything that must differ for two caches never to share a chunk.

    ``model`` is a model fingerprint (see :func:`fingerprint_model`) or any string that changes whenever the
    weights or the config do; ``cache_salt`` isolates tenants. ``settings`` names the engine settings that
    change the KV computed from the same weights (KV-cache dtype, quantization, config overrides, RoPE scaling),
    e.g. a digest of them. ``layout_version`` changes when kvtier's canonical layout does.

    ``inputs`` are the request's non-token inputs. They are not part of the root digest (the chunks before the
    first input are the same KV as without it) but are folded into the key of every chunk they overlap, with
    their offset in that chunk, as vLLM's own prefix cache does; so is every later key, through the chain.

    ``name_key`` (16 to 64 bytes; empty: none) keys every hash of the namespace's names: its digest, id and chunk
    keys. A store with encryption sets it to its deployment's naming key (:meth:`kvtier.store.KVStore.named`), so
    the names it writes to tiers confirm no guessed prompt; it is never shown (``repr``, :meth:`describe`).
    """

    model: str
    dtype: str
    lora: str | None = None
    cache_salt: str | None = None
    layout_version: int = LAYOUT_VERSION
    settings: str | None = None
    inputs: tuple[InputSpan, ...] = ()
    name_key: bytes = dataclasses.field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"Namespace.model must be a non-empty string, got {self.model!r}")
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"Namespace.dtype must be a dtype name such as 'bfloat16', got {self.dtype!r}")
        spans = tuple(sorted(InputSpan(*span) for span in self.inputs))
        for span in spans:
            if span.offset < 0 or span.length < 1 or not isinstance(span.identifier, str) or not span.identifier:
                raise ValueError(f"Namespace.inputs: bad span {span!r} (offset >= 0, length >= 1, an identifier)")
        object.__setattr__(self, "inputs", spans)
        if not isinstance(self.name_key, bytes) or len(self.name_key) not in (0, *range(16, 65)):
            raise ValueError("Namespace.name_key must be 16 to 64 bytes (or empty: unkeyed names)")

    def keyed(self, name_key: bytes) -> Namespace:
        """This namespace with its names hashed under ``name_key`` (itself when they are already)."""
        return self if name_key == self.name_key else dataclasses.replace(self, name_key=name_key)

    def _root_fields(self) -> dict[str, object]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("inputs",
                                                                                                      "name_key")}
        if fields["settings"] is None:
            del fields["settings"]  # namespaces made before the field existed keep their ids (and stored KV)
        return fields

    @functools.cached_property
    def digest(self) -> bytes:
        """A 128-bit hash of every field but ``inputs`` (keyed by ``name_key``); the root of this namespace's key
        chains."""
        blob = json.dumps(self._root_fields(), sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=DIGEST_BYTES, person=b"kvtier-ns", key=self.name_key).digest()

    @functools.cached_property
    def id(self) -> str:
        """Hex form of :attr:`digest`, used to name the namespace in tiers."""
        return self.digest.hex()

    def describe(self) -> dict[str, object]:
        """The fields that may be written next to stored KV (the tenant's salt and the inputs' hashes are not)."""
        info = self._root_fields()
        info["cache_salt"] = None if self.cache_salt is None else "<set>"
        info["inputs"] = len(self.inputs)
        return info


def _inputs_in(spans: tuple[InputSpan, ...], start: int, stop: int) -> bytes:
    """The spans overlapping tokens ``[start, stop)``, each with its offset relative to ``start``, as bytes."""
    out = bytearray()
    for span in spans:
        if span.offset >= stop:
            break  # sorted by offset
        if span.offset + span.length > start:
            ident = span.identifier.encode()
            out += struct.pack("<qqq", span.offset - start, span.length, len(ident)) + ident
    return bytes(out)


def _token_ids(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    ids = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {ids.shape}")
    return ids.astype("<i8", copy=False)


class NamedChunks:
    """Chunks an engine names itself, in place of their token ids: for an engine whose own key of a chunk hashes its
    whole prefix already (vLLM's ``OffloadKey``, which :mod:`kvtier.integrations.vllm_tier` stores). It goes where
    token ids go in the store: its length counts ``chunk_tokens`` tokens a name, as a prompt of those chunks would
    have, and :func:`chunk_keys` keys each name under the namespace. Names are never stored or shown; a namespace
    named by its engine's keys has no ``inputs`` (the engine's key covers them) and no tails."""

    def __init__(self, names: Sequence[bytes], chunk_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        if any(not isinstance(name, bytes) or not name for name in names):
            raise ValueError("NamedChunks: every name must be non-empty bytes")
        self.names = tuple(names)
        self.chunk_tokens = chunk_tokens

    def __len__(self) -> int:
        return len(self.names) * self.chunk_tokens

    def keys(self, namespace: Namespace) -> list[bytes]:
        """Each name's key in ``namespace``: a hash of the name keyed by the namespace's digest (itself keyed by its
        ``name_key``), so no name is confirmed by whoever reads a tier without that key."""
        if namespace.inputs:
            raise ValueError("named chunks take no Namespace.inputs: the engine's names cover them")
        return [hashlib.blake2b(name, digest_size=DIGEST_BYTES, person=b"kvtier-named", key=namespace.digest).digest()
                for name in self.names]


def chunk_keys(namespace: Namespace, tokens: Sequence[int] | np.ndarray | torch.Tensor | NamedChunks,
               chunk_tokens: int, *, tail: bool = False) -> list[bytes]:
    """Keys of the whole chunks of ``tokens``; a partial trailing chunk gets no key, or with ``tail`` a tail key
    (see :func:`tail_keys`).

    A chunk's key hashes its parent's key, its token ids and the namespace's inputs that overlap it (under the
    namespace's ``name_key``: a parent's key, shown in a tier, does not let anyone compute its children's).
    Chunks an engine names itself (:class:`NamedChunks`) are keyed by their names.
    """
    if isinstance(tokens, NamedChunks):
        if tokens.chunk_tokens != chunk_tokens or tail:
            raise ValueError(f"named chunks of {tokens.chunk_tokens} tokens (no tails), asked for chunks of "
                             f"{chunk_tokens}{' with a tail' if tail else ''}")
        return tokens.keys(namespace)
    ids = _token_ids(tokens)
    keys = []
    prev = namespace.digest
    for i in range(len(ids) // chunk_tokens):
        h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES, person=b"kvtier-chunk", key=namespace.name_key)
        h.update(ids[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes())
        if namespace.inputs:
            # After the fixed-length token bytes, so a chunk with inputs never hashes like one without.
            h.update(_inputs_in(namespace.inputs, i * chunk_tokens, (i + 1) * chunk_tokens))
        prev = h.digest()
        keys.append(prev)
    rest = len(ids) % chunk_tokens
    if tail and rest:
        keys += tail_keys(namespace, prev, ids[len(ids) - rest:], len(ids) - rest, [rest])
    return keys


def tail_keys(namespace: Namespace, parent: bytes, tokens: Sequence[int] | np.ndarray | torch.Tensor, start: int,
              lengths: Sequence[int]) -> list[bytes]:
    """Keys of tails: the first ``length`` of ``tokens`` for each of ``lengths``. ``tokens`` begin at token
    ``start`` of the prompt, a chunk boundary right after the chunk whose key is ``parent`` (the namespace's
    digest at the prompt's start).

    A tail is a prompt's tokens after its last whole chunk, stored as a chunk of its own, so that a prompt asked
    again loads as far as the engine's own prefix cache would. Its key hashes its parent, its length, its token
    ids and the inputs overlapping it (under the namespace's ``name_key``), with a personalisation of its own: a
    tail is never taken for a whole chunk or for a tail of another length.
    """
    ids = _token_ids(tokens)
    if any(not 0 < n <= len(ids) for n in lengths):
        raise ValueError(f"tail lengths must be in [1, {len(ids)}], got {list(lengths)}")
    keys = []
    for n in lengths:
        h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES, person=b"kvtier-tail", key=namespace.name_key)
        h.update(struct.pack("<q", n))
        h.update(ids[:n].tobytes())
        if namespace.inputs:
            h.update(_inputs_in(namespace.inputs, start, start + n))
        keys.append(h.digest())
    return keys


@dataclasses.dataclass(frozen=True, order=True)
class HeadRange:
    """KV heads ``[start, stop)`` out of ``total``: the slice one tensor-parallel rank holds."""

    start: int
    stop: int
    total: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        return f"{self.start}-{self.stop}of{self.total}"

    @classmethod
    def parse(cls, text: str) -> HeadRange:
        span, _, total = text.partition("of")
        start, _, stop = span.partition("-")
        rng = cls(int(start), int(stop), int(total))
        if not 0 <= rng.start < rng.stop <= rng.total:
            raise ValueError(f"bad head range {text!r}")
        return rng


@dataclasses.dataclass(frozen=True)
class ShardKey:
    """One stored object: the heads ``heads`` of chunk ``chunk`` (hex) in namespace ``namespace`` (hex)."""

    namespace: str
    chunk: str
    heads: HeadRange

    def __post_init__(self) -> None:
        # Shard keys index several dicts on the hot path; hash them once.
        object.__setattr__(self, "_hash", hash((self.namespace, self.chunk, self.heads.start, self.heads.stop,
                                                self.heads.total)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]  # set in __post_init__, not a dataclass field

    @property
    def name(self) -> str:
        """A relative object name usable as a file path or an object-store key."""
        return f"{self.namespace}/{self.chunk[:2]}/{self.chunk}.{self.heads}"


def rank_heads(kv_heads: int, tp_rank: int, tp_size: int) -> HeadRange:
    """The KV heads that tensor-parallel rank ``tp_rank`` of ``tp_size`` holds, of a model with ``kv_heads``.

    Up to ``kv_heads`` ranks, each holds an equal slice. With more ranks than KV heads, vLLM replicates heads:
    each rank holds one, by its real index, so ranks sharing a head write the same shard and KV written at any
    degree is read at any other.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, tp_size), got tp_rank={tp_rank}, tp_size={tp_size}")
    if kv_heads < 1:
        raise ValueError(f"kv_heads must be positive, got {kv_heads}")
    if tp_size <= kv_heads:
        if kv_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide the {kv_heads} KV heads")
        per = kv_heads // tp_size
        return HeadRange(tp_rank * per, (tp_rank + 1) * per, kv_heads)
    if tp_size % kv_heads:
        raise ValueError(f"tp_size {tp_size} is neither a divisor nor a multiple of the {kv_heads} KV heads")
    head = tp_rank * kv_heads // tp_size
    return HeadRange(head, head + 1, kv_heads)


def cover(ranges: Iterable[HeadRange], start: int, stop: int) -> list[tuple[HeadRange, int, int]] | None:
    """Pick ranges whose union covers heads ``[start, stop)``.

    Returns ``(range, from, to)`` pieces in head order (each piece takes heads ``[from, to)`` out of its range),
    or None when the heads are not all present. Greedy: at each point take the range reaching furthest.
    """
    ordered = sorted(ranges)
    pieces = []
    cur = start
    while cur < stop:
        best = None
        for rng in ordered:
            if rng.start <= cur < rng.stop and (best is None or rng.stop > best.stop):
                best = rng
        if best is None:
            return None
        end = min(best.stop, stop)
        pieces.append((best, cur, end))
        cur = end
    return pieces


def fingerprint_model(model: str | os.PathLike[str] | Mapping[str, object],
                      state_dict: Mapping[str, torch.Tensor] | None = None) -> str:
    """A fingerprint of a model's config and weights, for :attr:`Namespace.model`.

    ``model`` is either a model directory (its ``config.json`` and every weight file are hashed) or a config
    mapping, in which case ``state_dict`` must give the weights. Any change of a config value or of one weight
    byte changes the fingerprint, so a changed model never hits KV computed by the old one.
    """
    h = xxhash.xxh3_128()
    if isinstance(model, Mapping):
        if state_dict is None:
            raise ValueError("fingerprint_model: a config mapping needs state_dict with the weights")
        h.update(json.dumps(model, sort_keys=True, default=str).encode())
        for name in sorted(state_dict):
            tensor = state_dict[name].detach().cpu().contiguous()
            h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        return "xxh3-weights:" + h.hexdigest()
    root = Path(model)
    if not root.is_dir():
        raise ValueError(f"fingerprint_model: {root} is not a model directory")
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and (p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES))
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in files):
        raise ValueError(f"fingerprint_model: no weight files ({', '.join(_WEIGHT_SUFFIXES)}) under {root}")
    return "xxh3-dir:" + hash_files(root, files)


def hash_files(root: Path, files: Sequence[Path]) -> str:
    """An xxh3-128 hex digest of ``files`` (under ``root``): each one's relative name and its whole content."""
    h = xxhash.xxh3_128()
    for path in files:
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(8 * 2**20):
                h.update(block)
    return h.hexdigest()
