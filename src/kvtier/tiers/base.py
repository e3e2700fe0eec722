"""The interface every secondary tier implements, and the tier registry.

A tier stores opaque objects (a header and a payload, see :mod:`kvtier.frame`) under :class:`ShardKey` names.
It only moves bytes: what to store, promote or evict across tiers is decided by the store. Methods are
blocking and called from the store's worker threads or from a reading caller; a missing object is ``None``,
an I/O failure is :class:`TierError`. Tiers verify nothing themselves: the store checks every object it reads.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from kvtier.config import build_dataclass
from kvtier.errors import WrongSize
from kvtier.keys import HeadRange, ShardKey
from kvtier.registry import Registry

Buffer = bytes | bytearray | memoryview


@dataclasses.dataclass(frozen=True)
class StoredObject:
    """What a listing tells about one stored object."""

    key: ShardKey
    size: int
    created: float
    last_used: float


class Ranges(Protocol):
    """An object opened for reads of its payload in pieces (:meth:`Tier.open_ranges`)."""

    header: bytes  # its first header_len bytes
    payload_len: int  # the bytes after them

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in order from the payload's byte ``offset``; raises ObjectError where it ends first."""

    def close(self) -> None:
        """Release the object (e.g. its file descriptor)."""


class Tier(ABC):
    """A secondary tier. Subclasses set ``Options`` (a dataclass validated from the config) and ``persistent``."""

    Options: ClassVar[type] = type(None)
    persistent: ClassVar[bool] = False
    # Answers heads() from this host without waiting on a network (a local disk's index): an engine's scheduler
    # asks it inline, and leaves the other tiers to a background lookup.
    local: ClassVar[bool] = False
    # A get reads this tier's shards ahead of their use, on threads (up to the store's READ_AHEAD), each into the
    # DRAM entry reserved for it and verified there, while the caller copies out the ones before: tiers across a
    # network (an object store's GETs, Redis: the server sends while a shard is verified) and a local disk (reads
    # and checksums on another core). A load by layers reads a ranged tier's shards a layer at a time instead.
    read_ahead: ClassVar[bool] = False
    # heads() answers any number of keys in one round trip (a pipeline, a batch call): a lookup asks it about a
    # prompt's tails in the same question as its chunks. Off where each key costs a request of its own (S3's
    # listings), so that a miss costs no requests for tails.
    heads_in_one_call: ClassVar[bool] = True
    # Opens an object for reads of its payload in pieces (open_ranges): a local file, read a layer at a time by
    # a load that copies each layer as soon as it is read.
    ranged_reads: ClassVar[bool] = False
    # Reads the shards a get needs from this tier several at a time (get_into_many, a few shards a call), on reading
    # threads, each straight into the DRAM entry reserved for it: for tiers with a batched read (Mooncake's).
    batch_reads: ClassVar[bool] = False
    # list() reports when each object was written (else every object counts as new: Mooncake keeps no times), so
    # age-based removals (`kvtier cache purge --older-than`, `retain`) can select by it.
    listed_times: ClassVar[bool] = True
    # Keeps per-tenant quotas (set_share): a tier with an index of its own (a local disk), a server that counts
    # every engine's writes itself (Redis), or a store each engine lists (S3, Mooncake with its admin address).
    shares: ClassVar[bool] = False

    def __init__(self, name: str, options: Any) -> None:
        self.name = name
        self.options = options

    @classmethod
    def from_config(cls, name: str, options: Mapping[str, object], field: str) -> Tier:
        """Validate ``options`` against :attr:`Options` (errors name ``field``) and build the tier."""
        return cls(name, build_dataclass(cls.Options, options, field))

    @abstractmethod
    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` under ``key``, replacing any object there, atomically: readers see
        all of the old object or all of the new one."""

    @abstractmethod
    def get(self, key: ShardKey) -> Buffer | None:
        """The bytes stored under ``key``, or None if absent."""

    def get_into(self, key: ShardKey, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
        """Read the object under ``key`` in two parts: its first ``header_len`` bytes are returned, the rest is
        written into ``payload`` (writable buffers, in order), or None if absent. An object whose size is not
        ``header_len`` plus the buffers' is :class:`~kvtier.errors.WrongSize` (malformed, or stored with a codec:
        the store then reads it whole); the caller verifies
        the rest. The default copies what :meth:`get` returns; a tier that can read into the buffers directly
        (a file: ``readv``) saves that copy."""
        blob = self.get(key)
        return None if blob is None else self._split(key, blob, header_len, payload)

    def head(self, key: ShardKey, nbytes: int) -> bytes | None:
        """The object's first ``nbytes`` bytes (fewer where it is shorter; e.g. its header, for ``kvtier cache ls
        --codecs``), or None if absent. A read like :meth:`get` (it may count as a use); the default reads the
        object whole, a tier that can read a prefix (a file, an object store's ranged GET) saves that."""
        blob = self.get(key)
        return None if blob is None else bytes(memoryview(blob)[:nbytes])

    def open_ranges(self, key: ShardKey, header_len: int, payload_len: int) -> Ranges | None:
        """The object under ``key`` opened for reads of its payload in pieces, in any order (None if absent):
        its first ``header_len`` bytes read already; one of another size than ``header_len + payload_len`` is
        :class:`~kvtier.errors.WrongSize`. Only where :attr:`ranged_reads`; the caller verifies the
        payload once it has read all of it, and closes what it opened."""
        raise NotImplementedError(f"tier {self.name} reads objects whole")

    def get_into_many(self, reads: Sequence[tuple[ShardKey, int, Sequence[memoryview]]]) \
            -> list[bytes | Exception | None]:
        """:meth:`get_into` of several ``(key, header_len, payload)`` at once; for each, what it would return, or
        the exception it would raise. The default calls it in turn; a tier with a batched read overrides it."""
        out: list[bytes | Exception | None] = []
        for key, header_len, payload in reads:
            try:
                out.append(self.get_into(key, header_len, payload))
            except Exception as exc:  # noqa: BLE001 this read's answer: what get_into raised (the docstring)
                out.append(exc)
        return out

    def _split(self, key: ShardKey, blob: Buffer, header_len: int, payload: Sequence[memoryview]) -> bytes:
        """:meth:`get_into`'s work on an object read whole: its header returned, the rest copied into ``payload``."""
        view = memoryview(blob).cast("B")
        want = header_len + sum(part.nbytes for part in payload)
        if len(view) != want:
            raise WrongSize(f"{self.name}: {key.name} is {len(view)} bytes, expected {want}", len(view))
        pos = header_len
        for part in payload:
            part[:] = view[pos:pos + part.nbytes]
            pos += part.nbytes
        return bytes(view[:header_len])

    @abstractmethod
    def delete(self, key: ShardKey) -> bool:
        """Remove ``key``; True if it was there."""

    @abstractmethod
    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        """For each chunk, the head ranges stored for it (empty when none)."""

    @abstractmethod
    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        """Every stored object, optionally only one namespace's."""

    def quota_refusal(self, field: str) -> str | None:
        """Why this tier (configured at ``field``, e.g. ``tiers[1]``) cannot keep a per-tenant quota (None: it
        can)."""
        if self.shares:
            return None
        return (f"the {type(self).__name__} keeps no per-tenant quotas (an engine can neither count nor list every "
                "engine's writes there); quotas apply to dram, filesystem, redis, s3 and mooncake tiers")

    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        """Count ``namespace``'s objects against the tenant share ``share`` of ``quota_bytes`` (None: no share),
        evicting inside the share when it is over (only where :attr:`shares`)."""
        raise NotImplementedError(f"tier {self.name} keeps no per-tenant quotas")

    def remove_records(self, namespaces: Collection[str]) -> int:
        """Remove what the tier keeps about ``namespaces`` beside their objects (which tenant share each counts
        against), once their objects are gone: ``kvtier tenant forget`` and a purge of a namespace leave nothing
        of it. How many records it removed; raises :class:`TierError`. An engine that writes to one of them again
        records it again. The default keeps none."""
        return 0

    def exists(self, key: ShardKey) -> bool:
        return key.heads in self.heads(key.namespace, [key.chunk])[0]

    def used_bytes(self) -> int | None:
        """Bytes stored, where the tier knows it cheaply."""
        return None

    def counters(self) -> dict[str, float]:
        """Events the tier counts itself (e.g. its own evictions), exported as metrics."""
        return {}

    def close(self) -> None:  # noqa: B027 optional to override: the default has nothing to release
        """Release connections and files; the default has none."""


TIERS: Registry[Tier] = Registry("tier type", Tier)
