"""The Mooncake tier: shards in Mooncake Store, the distributed memory pool of the Mooncake serving stack.

Object names: ``<key_prefix><namespace>/<chunk>/<heads>``. Mooncake has no listing by prefix, so each namespace
also holds one small marker object, ``<key_prefix><namespace>/heads``, with the total KV-head counts stored
under it (one, as a namespace names one model): a lookup then asks, in one batched call, for every head range
a tensor-parallel rank can hold (equal slices of those counts). Writers rewrite the marker every 30 s, so it
comes back if the store evicted it.

Objects live in the memory segments that Mooncake clients mount (``global_segment_bytes``); by default this
process mounts none and uses the segments of dedicated clients (``mooncake_client``), so the KV outlives
engine restarts. ``kvtier cache ls`` needs the master's admin address
(``admin_url``) to list keys; it lists only names that are exactly ``<key_prefix><32 hex>/<32 hex>/<heads>``.

Per-tenant quotas are kept from the master's key list (:mod:`kvtier.quotas.listed`, which needs
``admin_url``), with one small object per namespace a share counts under ``<key_prefix>shares/``.

A damaged marker (not a short list of head counts) is an :class:`ObjectError` for lookups in its namespace, not
an outage of the tier; the next put in that namespace rewrites it.
"""

from __future__ import annotations

import builtins
import ctypes
import dataclasses
import http.client
import logging
import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Literal

from kvtier import threads
from kvtier.config import check_ttl, check_url_port
from kvtier.errors import ConfigError, ObjectError, TierError, WrongSize
from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas.listed import ListedShares
from kvtier.tiers.base import TIERS, Buffer, StoredObject, Tier

_MARKER = "heads"
_NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
_MARKER_REFRESH = 30.0  # seconds between rewrites of a namespace's marker by one process
# Bounds on what a marker may say: a lookup asks for every slice of every count, so a count of 10**8 written by
# a broken (or hostile) writer would make each lookup build 10**8 names.
_MAX_HEADS = 1024
_MAX_COUNTS = 16
_MARKER_RE = re.compile(rb"[0-9]{1,4}(,[0-9]{1,4}){0,%d}" % (_MAX_COUNTS - 1))
_KEYS_FRESH = 1.0  # seconds one key list from the master serves (a share's listing reads it once per namespace)
# Mooncake's TCP transport fails a transfer that made no progress for this many seconds (its own default: 30, so a
# stalled segment holder held each read that long, and a get with it); read when a store is set up.
_PROGRESS_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MooncakeOptions:
    """The keys of a ``type: mooncake`` tier: Mooncake Store, over TCP or RDMA."""

    master: str = dataclasses.field(metadata={"help": "host:port of the Mooncake master"})
    metadata_server: str = dataclasses.field(metadata={
        "help": "the metadata server: http://host:port/metadata, etcd://..., or P2PHANDSHAKE"})
    local_hostname: str = dataclasses.field(default="127.0.0.1", metadata={
        "help": "this host's address as the other Mooncake nodes reach it"})
    protocol: Literal["tcp", "rdma"] = dataclasses.field(default="tcp", metadata={"help": "the transport"})
    device_name: str = dataclasses.field(default="", metadata={"help": "RDMA devices, for protocol rdma"})
    global_segment_bytes: int = dataclasses.field(default=0, metadata={
        "help": "memory this process lends to the pool (0: objects live in dedicated clients)"})
    local_buffer_bytes: int = dataclasses.field(default=256 * 2**20, metadata={
        "help": "the transfer buffer; an object larger than this is refused (TierError)"})
    key_prefix: str = dataclasses.field(default="kvtier/", metadata={"help": "the prefix of every key"})
    admin_url: str | None = dataclasses.field(default=None, metadata={
        "help": "the master's admin address (http://master:9003), needed by `kvtier cache ls` and tenant quotas"})
    connect_timeout: float = dataclasses.field(default=10.0, metadata={
        "help": "wait this long at start for joining the master; after that, join in the background"})
    transfer_timeout: int = dataclasses.field(default=5, metadata={
        "help": "seconds a TCP transfer may make no progress before it fails (a stalled node holding the "
                "object): Mooncake's MC_TCP_PROGRESS_TIMEOUT_SEC, for every transfer of the process (the last "
                "tier set up wins), unless the environment sets it (Mooncake's default: 30)"})
    # Served no longer than this after it was written (the store checks each object's age as it reads it);
    # removed by `kvtier cache retain`. None: kept until evicted or purged.
    ttl_seconds: float | None = dataclasses.field(default=None, metadata={
        "help": "never served older than this (removal is left to Mooncake's eviction: it keeps no times); "
                "null: no limit"})
    # With per-tenant quotas: how old this engine's view of a share may get before a put lists it again (other
    # engines' writes are seen at the next listing; 0: every put lists first). See kvtier.quotas.listed.
    share_refresh_seconds: float = dataclasses.field(default=10.0, metadata={
        "help": "with tenant quotas (which need admin_url): list a share again when this engine's view is older"})

    def check(self, field: str) -> None:
        check_ttl(self.ttl_seconds, field)
        if not (self.share_refresh_seconds >= 0 and math.isfinite(self.share_refresh_seconds)):
            raise ConfigError(f"{field}.share_refresh_seconds: must be a number of seconds >= 0, got "
                              f"{self.share_refresh_seconds}")
        host, _, port = self.master.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"{field}.master: expected host:port of the Mooncake master (port 1-65535), got "
                              f"{self.master!r}")
        if not self.metadata_server:
            raise ConfigError(f"{field}.metadata_server: required (http://host:port/metadata, etcd://..., "
                              "or P2PHANDSHAKE)")
        for name in ("metadata_server", "admin_url"):
            url = getattr(self, name)
            if url is not None and url.startswith(("http://", "https://")):
                check_url_port(url, f"{field}.{name}")
        if self.global_segment_bytes < 0:
            raise ConfigError(f"{field}.global_segment_bytes: must be >= 0, got {self.global_segment_bytes}")
        if not (self.connect_timeout >= 0 and math.isfinite(self.connect_timeout)):
            raise ConfigError(f"{field}.connect_timeout: must be a number of seconds >= 0, got "
                              f"{self.connect_timeout}")
        if isinstance(self.transfer_timeout, bool) or not 1 <= self.transfer_timeout <= 3600:
            raise ConfigError(f"{field}.transfer_timeout: must be a whole number of seconds in [1, 3600], got "
                              f"{self.transfer_timeout!r}")
        if self.local_buffer_bytes <= 0:
            raise ConfigError(f"{field}.local_buffer_bytes: must be positive, got {self.local_buffer_bytes}")


_progress_ours: str | None = None  # the value this process's tiers last gave the variable (None: never set here)
_progress_lock = threading.Lock()


def _progress_timeout(tier: str, seconds: int) -> None:
    """Have Mooncake's TCP transfers fail after ``seconds`` without progress: its environment variable, which Mooncake
    reads for every transfer of the process, so the last tier set up wins (a change is said); one the user's
    environment set is kept (a different one said)."""
    global _progress_ours
    with _progress_lock:
        found = os.environ.get(_PROGRESS_ENV)
        if found is None or found == _progress_ours:
            if found is not None and found != str(seconds):
                log.warning("tier %s: transfer_timeout %d s now applies to every Mooncake transfer of this process "
                            "(it was %s s)", tier, seconds, found)
            os.environ[_PROGRESS_ENV] = _progress_ours = str(seconds)
        elif found != str(seconds):
            log.warning("tier %s: transfer_timeout %d s not applied: the environment sets %s=%s", tier, seconds,
                        _PROGRESS_ENV, found)


def _slices(total: int) -> list[HeadRange]:
    """Every head range a rank can hold: equal slices of ``total`` heads."""
    return [HeadRange(r * per, (r + 1) * per, total)
            for per in range(1, total + 1) if total % per == 0 for r in range(total // per)]


@TIERS.register("mooncake")
class MooncakeTier(Tier):
    """Shards in Mooncake Store, over TCP or RDMA."""

    Options = MooncakeOptions
    persistent = True  # in the segments of other clients, not of this process
    batch_reads = True  # a get's shards read by batch gets, a few shards each
    listed_times = False  # Mooncake reports no times: every listed object counts as new
    shares = True  # from the master's key list, per engine (kvtier.quotas.listed); needs admin_url

    def __init__(self, name: str, options: MooncakeOptions) -> None:
        super().__init__(name, options)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ConfigError(f"{name}: the mooncake tier needs Mooncake's Python package (pip install "
                              "'kvtier[mooncake]', or mooncake-transfer-engine on CUDA hosts)") from exc
        self._factory = MooncakeDistributedStore
        _progress_timeout(name, options.transfer_timeout)
        self._store_obj: Any = None
        self._closed = threading.Event()
        self._totals: dict[str, set[int]] = {}  # namespace -> KV-head totals, from markers read or written
        self._marked: dict[str, float] = {}  # namespace -> when this process last wrote its marker
        self._marker_lock = threading.Lock()
        # the master's last key list: (time.monotonic() when it came, its names, its shard names by namespace)
        self._keys: tuple[float, list[str], dict[str, list[re.Match[str]]]] | None = None
        self._keys_lock = threading.Lock()
        self._shares = ListedShares(self._share_members, lambda ns: self._listed(ns, fresh=False),
                                    self._record_member, options.share_refresh_seconds, times=False,
                                    record_every=_MARKER_REFRESH)
        # Joining a master that does not answer blocks for about 90 s inside Mooncake: join on a thread of our
        # own, wait for it briefly here, and let calls fail fast (TierError) until it has joined.
        self._joiner = threads.start(self._join, f"kvtier-{name}-join")  # Mooncake's own threads start there
        self._joiner.join(options.connect_timeout)

    # -- connection --------------------------------------------------------------------------------------------
    def _join(self) -> None:
        o = self.options
        warned = False
        while not self._closed.is_set():
            store = self._factory()
            rc = store.setup(o.local_hostname, o.metadata_server, o.global_segment_bytes, o.local_buffer_bytes,
                             o.protocol, o.device_name, o.master)
            if rc == 0:
                if self._closed.is_set():
                    store.close()
                else:
                    self._store_obj = store
                    if warned:
                        log.warning("tier %s: joined Mooncake master %s", self.name, o.master)
                return
            if not warned:
                log.warning("tier %s: cannot join Mooncake master %s (error %d); retrying in the background",
                            self.name, o.master, rc)
                warned = True
            self._closed.wait(5.0)

    def _store(self) -> Any:
        store = self._store_obj
        if store is None:
            raise TierError(f"{self.name}: not joined to Mooncake master {self.options.master} (yet)")
        return store

    def _check(self, rc: int, what: str) -> None:
        # Once joined, Mooncake's client reconnects to a restarted master by itself; errors are reported only.
        if rc < 0:
            raise TierError(f"{self.name}: {what} failed with Mooncake error {rc}")

    def _name(self, namespace: str, rest: str) -> str:
        return f"{self.options.key_prefix}{namespace}/{rest}"

    def _object(self, key: ShardKey) -> str:
        return self._name(key.namespace, f"{key.chunk}/{key.heads}")

    def _read_marker(self, namespace: str) -> set[int]:
        """The KV-head counts in the namespace's marker (empty when there is none); ObjectError if damaged."""
        raw = self._store().get(self._name(namespace, _MARKER))
        if not raw:
            return set()
        totals = {int(t) for t in raw.split(b",")} if _MARKER_RE.fullmatch(raw) else set()
        if not totals or not all(1 <= t <= _MAX_HEADS for t in totals):
            raise ObjectError(f"{self.name}: the marker of namespace {namespace} is damaged: {bytes(raw[:40])!r}")
        return totals

    def _known_totals(self, namespace: str) -> set[int]:
        totals = self._totals.get(namespace)
        if not totals:
            totals = self._totals[namespace] = self._read_marker(namespace)
        return totals

    def _marker_or_empty(self, namespace: str) -> set[int]:
        """For writers: a damaged marker counts as none, and is replaced by the write that follows."""
        try:
            return self._read_marker(namespace)
        except ObjectError as exc:
            log.warning("%s; rewriting it", exc)
            return set()

    # -- the tier interface ------------------------------------------------------------------------------------
    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        store = self._store()
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self.options.local_buffer_bytes:
            raise TierError(f"{self.name}: {key.name} is {size} bytes, above local_buffer_bytes "
                            f"({self.options.local_buffer_bytes}); raise it")
        self._shares.write(self.name, key, size, lambda: self._put(store, key, parts),
                           lambda victim: self._evict(store, victim))

    def _evict(self, store: Any, victim: ShardKey) -> bool:
        """Delete an object its share chose to evict; whether it is gone (else it is counted again). Forced, as
        :meth:`delete` is; one gone meanwhile (Mooncake's own eviction) is gone all the same."""
        rc = store.remove(self._object(victim), force=True)
        if rc >= 0 or rc == _NOT_FOUND:
            return True
        log.debug("tier %s: evicting %s from its share failed with error %d", self.name, victim.name, rc)
        return False

    def _put(self, store: Any, key: ShardKey, parts: Sequence[Buffer]) -> None:
        # upsert: a rewrite of a shard replaces it (a plain put leaves the old object in place).
        rc = store.upsert_parts(self._object(key), *parts)
        if rc < 0:  # the master may be restarting and lose every object, markers too: rewrite them next time
            self._marked.clear()
        self._check(rc, f"put {key.name}")
        self._mark(store, key.namespace, key.heads.total)

    def _mark(self, store: Any, namespace: str, total: int) -> None:
        """Record ``total`` in the namespace's marker: on a new count, and every so often, so a marker that the
        store evicted comes back. One writer at a time in this process; a write that fails because another
        process wrote at the same moment is fine if the marker now holds the count."""
        now = time.monotonic()
        with self._marker_lock:
            totals = self._totals.get(namespace) or self._marker_or_empty(namespace)
            if total in totals and now - self._marked.get(namespace, -_MARKER_REFRESH) < _MARKER_REFRESH:
                return
            if total not in totals:  # a new count: merge with what other writers recorded meanwhile
                totals = totals | self._marker_or_empty(namespace) | {total}
            self._totals[namespace] = totals
            rc = store.upsert(self._name(namespace, _MARKER), ",".join(str(t) for t in sorted(totals)).encode())
            if rc < 0 and total not in self._marker_or_empty(namespace):
                raise TierError(f"{self.name}: writing the marker of namespace {namespace} failed with Mooncake "
                                f"error {rc}")
            self._marked[namespace] = now

    def get(self, key: ShardKey) -> Buffer | None:
        store = self._store()
        name = self._object(key)
        present = store.is_exist(name)
        self._check(present, f"get {key.name}")
        if not present:
            return None
        blob: bytes | None = store.get(name)
        if not blob:
            return None  # evicted between the two calls: a miss
        self._shares.used(key)
        return blob

    def get_into(self, key: ShardKey, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
        """Over TCP, one call that lays the object out over a small header buffer and ``payload`` (e.g. DRAM
        pages): no object of its bytes, no copy, and no existence check first. Over RDMA the buffers would have
        to be registered with the transfer engine first (not done): there, :meth:`get` and a copy."""
        if self.options.protocol != "tcp":
            return super().get_into(key, header_len, payload)
        got = self.get_into_many([(key, header_len, payload)])[0]
        if isinstance(got, Exception):
            raise got
        return got

    def get_into_many(self, reads: Sequence[tuple[ShardKey, int, Sequence[memoryview]]]) \
            -> list[bytes | Exception | None]:
        """Over TCP, one batch get for all of ``reads``, each object laid out over its header buffer and payload;
        a failed one is then asked about alone (see :meth:`_failed_read`). Over RDMA, :meth:`get` and a copy each."""
        if self.options.protocol != "tcp":
            return super().get_into_many(reads)
        store = self._store()
        names, pointers, sizes, headers = [], [], [], []
        for key, header_len, payload in reads:
            header = bytearray(header_len)
            buffers = [b for b in (memoryview(header), *payload) if b.nbytes]
            names.append(self._object(key))
            pointers.append([ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in buffers])
            sizes.append([b.nbytes for b in buffers])
            headers.append(header)
        codes = store.batch_get_into_multi_buffers(names, pointers, sizes)
        if len(codes) != len(reads):
            codes = [-1] * len(reads)
        out: list[bytes | Exception | None] = []
        down: TierError | None = None  # the master unreachable: not asked again for each failed read
        for (key, _, _), name, size, header, rc in zip(reads, names, sizes, headers, codes):
            want = sum(size)
            if rc == want:
                out.append(bytes(header))
                self._shares.used(key)
            elif rc == _NOT_FOUND:
                out.append(None)
            elif down is not None:
                out.append(down)
            else:
                try:
                    self._failed_read(key, name, want)
                    out.append(None)
                except TierError as exc:
                    down = exc
                    out.append(exc)
                except Exception as exc:  # noqa: BLE001 this read's answer: what get_into would have raised
                    out.append(exc)
        return out

    def _failed_read(self, key: ShardKey, name: str, want: int) -> None:
        """Why a read failed: the master unreachable is the tier's error; an object of another size is
        malformed; an object there that could not be read (being replaced, say) is a miss, as a failed get always
        was."""
        store = self._store()
        present = store.is_exist(name)
        self._check(present, f"get {key.name}")
        size = store.get_size(name) if present else -1
        if size >= 0 and size != want:
            raise WrongSize(f"{self.name}: {key.name} is {size} bytes, expected {want}", size)
        return

    def delete(self, key: ShardKey) -> bool:
        store = self._store()
        name = self._object(key)
        present = store.is_exist(name)
        self._check(present, f"delete {key.name}")
        if not present:
            return False
        # force: skip the master's read lease. A delete removes a corrupt or purged object; a reader racing
        # with it gets a miss or bytes that fail their checksum, never wrong KV.
        self._shares.removed(key)
        self._check(store.remove(name, force=True), f"delete {key.name}")
        return True

    # -- tenant shares -----------------------------------------------------------------------------------------
    def quota_refusal(self, field: str) -> str | None:
        if self.options.admin_url is None:
            return (f"a quota on a Mooncake tier needs {field}.admin_url (the master's admin address, e.g. "
                    "http://master-host:9003), to list the share's keys")
        return None

    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        """Count ``namespace``'s objects against the tenant share ``share`` of ``quota_bytes`` (None: none), in
        this engine's view of the store's keys (:mod:`kvtier.quotas.listed`): a put that takes the share
        past its quota deletes the share's least recently used objects, whichever engine wrote them."""
        self._shares.set(namespace, share, quota_bytes)

    def share_bytes(self, share: str) -> int:
        return self._shares.bytes(share)

    def remove_records(self, namespaces: Collection[str]) -> int:
        """Each namespace's records in the tenant shares (``<prefix>shares/<id>/<namespace>``) and its KV-head
        marker (``<prefix><namespace>/heads``), unless objects of it are stored: lookups need the marker to find
        them, so one written while the marker was removed has it written again."""
        wanted = set(namespaces)
        names, by_ns = self._all_keys(fresh=True)
        shape = re.compile(re.escape(f"{self.options.key_prefix}shares/") + r"[0-9a-f]{32}/([0-9a-f]{32})")
        doomed = [n for n in names if (match := shape.fullmatch(n)) is not None and match[1] in wanted]
        unmarked = sorted(wanted - by_ns.keys())
        doomed += [self._name(namespace, _MARKER) for namespace in unmarked]
        store = self._store()
        removed = 0
        for name in doomed:
            present = store.is_exist(name)
            self._check(present, f"removing {name}")
            rc = store.remove(name, force=True) if present else _NOT_FOUND
            if rc != _NOT_FOUND:  # (gone meanwhile: Mooncake's eviction, another command)
                self._check(rc, f"removing {name}")
                removed += 1
        _, by_ns = self._all_keys(fresh=True)
        for namespace in unmarked:
            for total in {int(match[3].rsplit("of", 1)[1]) for match in by_ns.get(namespace, [])}:
                self._mark(store, namespace, total)  # written meanwhile: marked again
        return removed

    def _share_members(self, sid: str) -> tuple[builtins.list[str], float | None]:  # (`list`: the method)
        prefix = f"{self.options.key_prefix}shares/{sid}/"
        return [name[len(prefix):] for name in self._all_keys(fresh=True)[0] if name.startswith(prefix)], None

    def _record_member(self, sid: str, namespace: str) -> None:
        rc = self._store().upsert(f"{self.options.key_prefix}shares/{sid}/{namespace}", b"1")
        self._check(rc, f"recording namespace {namespace} in its share")

    def counters(self) -> dict[str, float]:
        return {"share_evictions": float(self._shares.evictions),
                "share_refused_writes": float(self._shares.refused),
                "share_view_failures": float(self._shares.view_failures)}

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        if not chunks:
            return []
        store = self._store()
        totals = self._known_totals(namespace)
        if not totals:
            return [[] for _ in chunks]
        ranges = [rng for total in sorted(totals) for rng in _slices(total)]
        names = [self._name(namespace, f"{chunk}/{rng}") for chunk in chunks for rng in ranges]
        found = store.batch_is_exist(names)
        if len(found) != len(names):
            raise TierError(f"{self.name}: lookup of {len(chunks)} chunks failed")
        for rc in found:
            self._check(rc, f"lookup of {len(chunks)} chunks")
        per = len(ranges)
        return [[rng for rng, hit in zip(ranges, found[i * per:(i + 1) * per]) if hit == 1]
                for i in range(len(chunks))]

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        return self._listed(namespace, fresh=True)

    def _listed(self, namespace: str | None, fresh: bool) -> Iterator[StoredObject]:
        """:meth:`list`, from a key list up to :data:`_KEYS_FRESH` old unless ``fresh`` (a share's listing)."""
        if namespace is not None and not re.fullmatch(r"[0-9a-f]{32}", namespace):
            return  # no namespace id looks like that
        _, by_ns = self._all_keys(fresh)
        matches = by_ns.get(namespace, []) if namespace is not None else \
            [m for found in by_ns.values() for m in found]
        now = time.time()
        for match in matches:
            try:
                key = ShardKey(match[1], match[2], HeadRange.parse(match[3]))
            except ValueError:
                continue
            size = self._store().get_size(match[0])
            if size == _NOT_FOUND:
                continue  # removed since the key list
            self._check(size, f"size of {key.name}")  # a failure fails the listing, never shrinks it
            # Mooncake reports no times: objects count as new, so age-based purges leave them to Mooncake's own
            # eviction.
            yield StoredObject(key, size, now, now)

    def _all_keys(self, fresh: bool) -> tuple[builtins.list[str], dict[str, builtins.list[re.Match[str]]]]:
        """Every key in the store, from the master's admin address, and kvtier's shard names in it by namespace
        (exactly ``<prefix><32 hex>/<32 hex>/<heads>``: markers, other deployments' longer prefixes and anything
        else in the store are never listed, so never purged). Unless ``fresh``, a list that came up to
        :data:`_KEYS_FRESH` ago serves (a share's listing asks once for its members, then once per namespace)."""
        if self.options.admin_url is None:
            raise TierError(f"{self.name}: listing Mooncake keys needs the master's admin address "
                            f"(tiers[].admin_url, e.g. http://master-host:9003)")
        with self._keys_lock:
            if not fresh and self._keys is not None and time.monotonic() - self._keys[0] < _KEYS_FRESH:
                return self._keys[1], self._keys[2]
            url = self.options.admin_url.rstrip("/")
            try:
                with urllib.request.urlopen(f"{url}/get_all_keys", timeout=10) as resp:
                    names = resp.read().decode(errors="replace").split()  # a non-UTF-8 name matches nothing
            except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
                raise TierError(f"{self.name}: listing keys at {url} failed: {exc!r}") from exc
            own = re.compile(re.escape(self.options.key_prefix) +
                             r"([0-9a-f]{32})/([0-9a-f]{32})/([0-9]+-[0-9]+of[0-9]+)")
            by_ns: dict[str, list[re.Match[str]]] = {}
            for name in names:
                match = own.fullmatch(name)
                if match is not None:
                    by_ns.setdefault(match[1], []).append(match)
            self._keys = (time.monotonic(), names, by_ns)
            return names, by_ns

    def close(self) -> None:
        self._closed.set()
        store, self._store_obj = self._store_obj, None
        if store is not None:
            store.close()

