"""Sealing and opening shards under their tenants' keys, derived from the master keys and the keyring's secrets;
the watch that drops a forgotten tenant's keys."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier import codecs, frame, threads
from kvtier.errors import KVTierError, SealError
from kvtier.recent import RecentMap
from kvtier.sealing._keyring import Keyring
from kvtier.sealing._master_keys import SECRET_BYTES, EncryptionConfig, load_key

if TYPE_CHECKING:
    from kvtier.keys import Namespace, ShardKey

log = logging.getLogger(__name__)

_NONCE_BYTES = 24  # 192 random bits: half make the object's key (object_key), half are GCM's nonce
_KEY_ID_BYTES = 8
_KEPT_NAMESPACES = 65536  # namespace -> tenant entries a process remembers (one per salt, model and settings)
_KEPT_TENANTS = 16384  # tenants whose keys a process keeps derived
_OPEN_PIECE = 1 << 18  # bytes decrypted at a time in open_into (a quarter MiB: it stays in the cache)


def key_id(tenant_key: bytes) -> bytes:
    return hmac.new(tenant_key, b"kvtier key id", hashlib.sha256).digest()[:_KEY_ID_BYTES]


def tenant_key(master: bytes, secret: bytes, tenant: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=SECRET_BYTES, salt=secret,
                info=b"kvtier tenant key v1/" + tenant.encode()).derive(master)


def object_key(tenant_key: bytes, nonce: bytes) -> bytes:
    """The key of one object: the tenant key hashed with the first half of the object's random 192-bit nonce (GCM
    gets the second half), so a tenant key may seal any number of objects (with one key and random 96-bit nonces,
    GCM is safe for about 2**32)."""
    return hmac.new(tenant_key, b"kvtier object key/" + nonce[:_NONCE_BYTES // 2], hashlib.sha256).digest()


@dataclasses.dataclass(eq=False)
class Tenant:
    """A tenant's keys as one process derived them: what :meth:`Sealer.register` returns."""

    id: str
    secret: bytes = dataclasses.field(repr=False)
    keys: list[tuple[bytes, bytes]] = dataclasses.field(repr=False)  # (key id, tenant key), the current master's first
    namespaces: set[str] = dataclasses.field(default_factory=set)

    @property
    def key_id(self) -> bytes:
        """The id of the tenant key that seals its shards now: what its DRAM entries carry (their owner)."""
        return self.keys[0][0]

    def key_for(self, wanted: bytes) -> bytes | None:
        return next((k for kid, k in self.keys if hmac.compare_digest(kid, wanted)), None)


class UnrecordedNamespace(KVTierError):
    """The tenant's secret is at hand but the keyring could not record that it used this namespace (a failed
    write: ENOSPC, EMFILE). A forget could not find the namespace's objects, so none may be sealed; DRAM may hold
    its KV, owned by :attr:`tenant` (a forget still ends its service: see :attr:`Tenant.key_id`)."""

    def __init__(self, tenant: Tenant, namespace: str) -> None:
        super().__init__(f"keyring: cannot record namespace {namespace} of tenant {tenant.id}")
        self.tenant = tenant


class Sealer:
    """Seals shards for the tiers and opens what they return (a :class:`~kvtier.frame.Opener`), for the
    namespaces of the tenants it has seen. Thread-safe."""

    def __init__(self, config: EncryptionConfig, on_forgotten: Callable[[set[bytes]], None] | None = None,
                 create: bool = True, on_unreadable: Callable[[Exception], None] | None = None) -> None:
        """``on_forgotten`` gets the key ids (:attr:`Tenant.key_id`) of the tenants the watch found forgotten;
        ``on_unreadable`` each error reading a secret there (to count). ``create=False``: for a command, which must
        not make a keyring (or a tenant) where none is."""
        self.config = config
        self._masters = [load_key(config.key, "encryption.key", config.provider_options)]
        self._masters += [load_key(s, f"encryption.old_keys[{i}]", config.provider_options)
                          for i, s in enumerate(config.old_keys)]
        self.keyring = Keyring(config.keyring, create=create)
        log.info("keyring %s: naming key fingerprint %s", config.keyring, self.keyring.fingerprint())
        self._on_forgotten = on_forgotten
        self._on_unreadable = on_unreadable
        self._lock = threading.Lock()
        self._tenants: RecentMap[str, Tenant] = RecentMap(_KEPT_TENANTS)  # pushed out: attached again on next use
        self._by_ns: RecentMap[str, Tenant] = RecentMap(_KEPT_NAMESPACES)
        # Key ids the watch found forgotten (one per forget: few), each with the serial of its mark: a secret read
        # again after the mark, unchanged, clears it (see _attach).
        self._forgotten: dict[bytes, int] = {}
        self._marks = 0
        self._scratch = threading.local()
        self._closed = threading.Event()
        self._watch_failed = False
        self._watcher = threads.start(self._watch, "kvtier-keyring")

    # -- tenants -----------------------------------------------------------------------------------------------
    def register(self, ns: Namespace, create: bool = True) -> Tenant | None:
        """Make ``ns``'s tenant key available before its shards are sealed or opened here; its secret is made on
        first use when ``create`` (a put), not for a read (nothing is stored under a tenant that has none).
        Returns the tenant (None: it has no secret). Raises :class:`UnrecordedNamespace` when the namespace could
        not be recorded, OSError or :class:`KVTierError` when the keyring cannot be read or written."""
        with self._lock:
            tenant = self._by_ns.get(ns.id)
            if tenant is not None and self._tenants.get(tenant.id) is tenant:
                self._by_ns.touch(ns.id)
                self._tenants.touch(tenant.id)
                return tenant
        return self._attach(self.keyring.tenant_id(ns.cache_salt), ns.id, create)

    def current(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` (from :meth:`register`) was not found forgotten since. Read under the lock the watch
        marks it under, and the watch marks before it purges DRAM: what a caller commits and then checks here is
        either refused here or purged by the watch."""
        with self._lock:
            return tenant.key_id not in self._forgotten

    def _attach(self, tid: str, namespace: str, create: bool, record: bool = True) -> Tenant | None:
        with self._lock:
            tenant = self._tenants.get(tid)
            marks = self._marks
        if tenant is None:
            secret = self.keyring.secret(tid, create)
            if secret is None:
                return None
            keys = [tenant_key(m, secret, tid) for m in self._masters]
            made = Tenant(tid, secret, [(key_id(k), k) for k in keys])
            with self._lock:
                if self._forgotten.get(made.key_id, marks + 1) <= marks:
                    # Marked before this read began, and the secret is there unchanged: the tick that marked it
                    # saw it missing for a moment (a remount). A forget always makes a new secret, so a key id
                    # forgotten for real never reads again; one read from before a mark is not cleared by it.
                    del self._forgotten[made.key_id]
                    log.info("keyring: tenant %s is back with its secret unchanged; served again", tid)
                tenant = self._tenants.get(tid)
                if tenant is None:  # (else attached by another thread meanwhile: theirs it is)
                    tenant = made
                    self._tenants[tid] = made
        if namespace not in tenant.namespaces:
            if record:
                try:
                    self.keyring.add_namespace(tid, namespace)
                except OSError as exc:  # not in _by_ns, so nothing of it is sealed; tried again on next use
                    raise UnrecordedNamespace(tenant, namespace) from exc
            with self._lock:
                tenant.namespaces.add(namespace)
        with self._lock:
            self._by_ns[namespace] = tenant
        return tenant

    def load_keyring(self) -> int:
        """Attach every tenant in the keyring with the namespaces it recorded (for the maintenance commands, which
        meet namespaces without their salts); how many namespaces."""
        count = 0
        for tid in self.keyring.tenants():
            for namespace in self.keyring.namespaces(tid):
                if self._attach(tid, namespace, create=False, record=False) is not None:
                    count += 1
        return count

    def _tenant(self, namespace: str) -> Tenant | None:
        """``namespace``'s tenant, to seal or open with: None when not cached, or found forgotten (a tenant whose
        secret was read just before its forget was noticed is cached under a marked key id: see :meth:`_attach`)."""
        with self._lock:
            tenant = self._by_ns.get(namespace)
            if tenant is None or self._tenants.get(tenant.id) is not tenant or tenant.key_id in self._forgotten:
                return None
            return tenant

    def current_key_id(self, namespace: str) -> bytes | None:
        tenant = self._tenant(namespace)
        return None if tenant is None else tenant.keys[0][0]

    def _watch(self) -> None:
        """Every ``refresh_seconds``: drop the tenants whose secret is gone or was made anew (forgotten). A failed
        check is logged (once) and tried again at the next tick: the watch never stops."""
        while not self._closed.wait(self.config.refresh_seconds):
            try:
                self.check_forgotten()
            except Exception:
                if not self._watch_failed:
                    self._watch_failed = True
                    log.exception("keyring %s: checking for forgotten tenants failed; retrying every %.1f s (further "
                                  "failures are not logged)", self.keyring.path, self.config.refresh_seconds)

    def check_forgotten(self) -> set[bytes]:
        """Drop the keys of forgotten tenants now; their key ids (also given to ``on_forgotten``). A secret that
        cannot be read (EIO, ESTALE, a short read), or missing from a keyring whose pepper is missing too (being
        remounted), fails closed for its tenant alone: its keys are dropped from the cache, so each read asks the
        keyring again (and serves nothing while it fails), and the check goes on. A secret missing from an intact
        keyring is a forget; should it come back unchanged, :meth:`_attach` serves the tenant again."""
        with self._lock:
            tenants = self._tenants.values()
        gone: set[bytes] = set()
        for tenant in tenants:
            try:
                secret = self.keyring.secret(tenant.id, create=False)
                if secret is None and not self.keyring.intact():
                    raise KVTierError(f"keyring {self.keyring.path}: its pepper is missing or changed (unmounted?)")
            except (OSError, KVTierError) as exc:
                with self._lock:
                    self._uncache_locked(tenant)
                if self._on_unreadable is not None:
                    self._on_unreadable(exc)
                continue
            if secret is not None and hmac.compare_digest(secret, tenant.secret):
                continue
            with self._lock:
                self._marks += 1
                self._forgotten[tenant.key_id] = self._marks  # before the purge below: see current()
                self._uncache_locked(tenant)
            gone.add(tenant.key_id)
            log.info("keyring: tenant %s was forgotten; its keys and DRAM entries are dropped", tenant.id)
        if gone and self._on_forgotten is not None:
            self._on_forgotten(gone)
        return gone

    def _uncache_locked(self, tenant: Tenant) -> None:
        if self._tenants.get(tenant.id) is tenant:
            del self._tenants[tenant.id]

    # -- sealing -----------------------------------------------------------------------------------------------
    def seal(self, key: ShardKey, meta: frame.ShardMeta, payload: Sequence[memoryview],
             created: float | None = None, codec: codecs.Codec = codecs.NONE) -> list[memoryview | bytes]:
        """The parts of the sealed object for ``payload`` (the shard as ``codec`` stores it): its header, then the
        ciphertext (in a buffer of this thread's, reused by its next seal: write it before sealing again)."""
        length = sum(len(part) for part in payload)
        if not codec.valid_len(meta.shape, meta.dtype, length):
            raise ValueError(f"payload of {length} bytes for a shard of {meta.nbytes} stored with codec {codec.name}")
        tenant = self._tenant(key.namespace)
        if tenant is None:
            raise SealError(f"no tenant key for namespace {key.namespace} in this process (forgotten since)")
        kid, data_key = tenant.keys[0]
        nonce = os.urandom(_NONCE_BYTES)
        aad = frame.sealed_aad(key, meta, kid, nonce, created, codec, length)
        encryptor = Cipher(algorithms.AES(object_key(data_key, nonce)),
                           modes.GCM(nonce[_NONCE_BYTES // 2:])).encryptor()
        encryptor.authenticate_additional_data(aad)
        out = self._buffer(length)
        pos = 0
        for part in payload:
            pos += encryptor.update_into(part, out[pos:pos + len(part)])
        encryptor.finalize()
        return [frame.sealed_header(aad, encryptor.tag), out[:pos]]

    def _buffer(self, nbytes: int, name: str = "buf") -> memoryview:
        """This thread's scratch buffer ``name``, at least ``nbytes`` long."""
        buf = getattr(self._scratch, name, None)
        if buf is None or len(buf) < nbytes:
            buf = memoryview(bytearray(nbytes))
            setattr(self._scratch, name, buf)
        return buf

    def open_into(self, header: frame.Header, payload: Sequence[memoryview]) -> None:
        sealing = header.sealing
        assert sealing is not None
        tenant = self._tenant(header.key.namespace)
        data_key = None if tenant is None else tenant.key_for(sealing.key_id)
        if data_key is None:
            raise frame.UnknownKey(f"sealed under key {sealing.key_id.hex()}, which this process does not hold")
        decryptor = Cipher(algorithms.AES(object_key(data_key, sealing.nonce)),
                           modes.GCM(sealing.nonce[_NONCE_BYTES // 2:], sealing.tag)).decryptor()
        decryptor.authenticate_additional_data(sealing.aad)
        # In place, a piece at a time through a scratch piece that stays in the CPU's cache: cryptography (from
        # 51) refuses an output that overlaps the input, and GCM's output is as long as its input.
        scratch = self._buffer(_OPEN_PIECE + 15, "opening")  # update_into wants a block's room to spare
        for part in payload:
            part = part.cast("B") if part.format != "B" else part
            for at in range(0, len(part), _OPEN_PIECE):
                piece = part[at:at + _OPEN_PIECE]
                n = decryptor.update_into(piece, scratch)
                assert n == len(piece), "GCM's output is as long as its input"
                piece[:n] = scratch[:n]
        try:
            decryptor.finalize()
        except InvalidTag:
            raise frame.FrameError("sealed object fails to authenticate (forged, altered, or moved from another "
                                   "key)") from None

    def close(self) -> None:
        self._closed.set()
