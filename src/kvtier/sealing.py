"""Encryption at rest of the shards kvtier writes to secondary tiers, with a key per tenant that can be destroyed.

Key hierarchy::

    master key: 32 bytes from ``encryption.key`` (a file, an environment variable or a provider class)
    └── tenant key = HKDF-SHA256(master key, salt = tenant secret, info = "kvtier tenant key v1/" + tenant id)
          tenant secret: 32 random bytes in the keyring directory (``encryption.keyring``), one per cache salt
          (requests without a salt are one more tenant); ``kvtier tenant forget SALT`` deletes it
        └── each shard: a random 192-bit nonce; AES-256-GCM under HMAC(tenant key, the nonce's first half) with its
            second half, and the header up to the nonce (the shard's key, shape and the key id) as associated data
            (:mod:`kvtier.frame`, version 2)

A tenant's id is a keyed hash of its salt (the key, the keyring's ``pepper``, never leaves the keyring), so the
keyring's file names do not reveal salts. A shard's key id is a digest of the tenant key that sealed it: a reader
tries the tenant keys of the current master key and of each ``old_keys`` entry (rotation), and a shard under none
of them is a miss (:class:`~kvtier.frame.UnknownKey`), left in place for the engines that hold its key.

The keyring also records which namespaces each tenant used, so that ``forget`` can remove a tenant's objects where
a tier can list, and ``kvtier cache rekey`` can re-seal any tenant's objects. It is shared by every process of a
deployment: a directory on the engines' host (or a shared filesystem). Processes notice a forgotten tenant within
``refresh_seconds`` (its secret gone, or made anew) and drop its keys and DRAM entries. A DRAM entry of an encrypted
store carries the key id of the tenant key it was stored under (:attr:`Tenant.key_id`), and a read serves it only
under that key: a tenant this process no longer remembers (pushed out of its bounded key cache, or a namespace the
keyring failed to record) is looked up in the keyring again, and once forgotten its entries are never served.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import logging
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier import frame, threads
from kvtier.errors import ConfigError, KVTierError, SealError
from kvtier.registry import Registry

if TYPE_CHECKING:
    from kvtier.keys import Namespace, ShardKey

log = logging.getLogger(__name__)

KEY_BYTES = 32
_NONCE_BYTES = 24  # 192 random bits: half make the object's key (object_key), half are GCM's nonce
_KEY_ID_BYTES = 8
_KEPT_NAMESPACES = 65536  # namespace -> tenant entries a process remembers (one per salt, model and settings)
_KEPT_TENANTS = 16384  # tenants whose keys a process keeps derived
_NAME = re.compile(r"t-[0-9a-f]{32}")
_TENANT_FILE = re.compile(r"t-[0-9a-f]{32}(\.ns|\.ns\.forgetting|\.forgotten)?")  # a secret, its lists, a tombstone


class KeyProvider:
    """An out-of-tree source of master keys (a KMS client), named in config as ``provider:package.module:Class``
    (``#name`` after it picks one of its keys). Built once per store with ``encryption.provider_options``."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = options

    def load(self, name: str) -> bytes:
        """The 32-byte key called ``name`` ("" when the source gives none)."""
        raise NotImplementedError


PROVIDERS: Registry[KeyProvider] = Registry("key provider", KeyProvider)


@dataclasses.dataclass(frozen=True)
class EncryptionConfig:
    """The ``encryption`` section of a store config."""

    key: str  # the current master key's source: it seals every new shard
    keyring: str  # absolute path of the keyring directory
    old_keys: tuple[str, ...] = ()  # sources of earlier master keys: they still open shards, never seal
    provider_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    refresh_seconds: float = 1.0  # how soon a process notices a forgotten tenant

    def __repr__(self) -> str:  # sources may name an environment variable, never a key; still, keep it short
        return f"EncryptionConfig(key={self.key!r}, keyring={self.keyring!r}, old_keys={len(self.old_keys)})"


def parse_encryption(raw: object) -> EncryptionConfig | None:
    """Validate the ``encryption`` mapping of a store config (errors name the field); keys are loaded later, by
    :class:`Sealer`."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError("encryption: expected a mapping with 'key' and 'keyring'")
    allowed = ("key", "keyring", "old_keys", "provider_options", "refresh_seconds")
    unknown = sorted(map(str, set(raw) - set(allowed)))
    if unknown:
        raise ConfigError(f"encryption.{unknown[0]}: unknown key; allowed: {', '.join(allowed)}")
    key = _check_source(raw.get("key"), "encryption.key")
    old = raw.get("old_keys", []) or []
    if not isinstance(old, list):
        raise ConfigError(f"encryption.old_keys: expected a list of key sources, got {type(old).__name__}")
    for i, source in enumerate(old):
        _check_source(source, f"encryption.old_keys[{i}]")
    keyring = raw.get("keyring")
    if not isinstance(keyring, str) or not keyring.startswith("/"):
        raise ConfigError(f"encryption.keyring: required, the absolute path of the keyring directory (tenant "
                          f"secrets), got {keyring!r}")
    options = raw.get("provider_options", {}) or {}
    if not isinstance(options, Mapping):
        raise ConfigError("encryption.provider_options: expected a mapping (given to the key provider class)")
    refresh = raw.get("refresh_seconds", 1.0)
    if isinstance(refresh, bool) or not isinstance(refresh, (int, float)) or not 0.05 <= refresh <= 3600:
        raise ConfigError(f"encryption.refresh_seconds: a number of seconds in [0.05, 3600], got {refresh!r}")
    return EncryptionConfig(key, keyring, tuple(old), dict(options), float(refresh))


def _check_source(source: object, field: str) -> str:
    """``source``, checked to be a key source (else a ConfigError naming ``field`` is raised)."""
    if not isinstance(source, str) or not re.fullmatch(r"(file:/.+|env:[A-Za-z_][A-Za-z0-9_]*|provider:.+:.+)",
                                                       source):
        raise ConfigError(f"{field}: a key source: 'file:/absolute/path', 'env:VARIABLE' or "
                          f"'provider:package.module:Class[#name]', got {source!r}")
    return source


def parse_key(text: bytes, where: str) -> bytes:
    """A 32-byte key written as 64 hex digits or as base64 (what ``kvtier keygen`` writes is hex)."""
    value = text.strip()
    for decode in (bytes.fromhex, base64.b64decode):
        try:
            key = decode(value.decode("ascii"))
        except (ValueError, binascii.Error, UnicodeDecodeError):
            continue
        if len(key) == KEY_BYTES:
            return key
    raise ConfigError(f"{where}: not a 256-bit key (64 hex digits or base64 of 32 bytes; `kvtier keygen FILE` "
                      "writes one)")


def _owned_privately(st: os.stat_result) -> str | None:
    """Why a key file or keyring is not safe to trust, or None."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"it belongs to uid {st.st_uid}, not to this user ({os.geteuid()}) or root"
    if st.st_mode & 0o077:
        return f"its mode {stat.S_IMODE(st.st_mode):04o} lets others in (want 0600 for a file, 0700 for a directory)"
    return None


def load_key(source: str, field: str, options: Mapping[str, Any]) -> bytes:
    """The master key named by ``source`` (see :class:`EncryptionConfig`); errors name ``field``, never the key."""
    kind, _, rest = source.partition(":")
    if kind == "file":
        try:
            fd = os.open(rest, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ConfigError(f"{field}: cannot open key file {rest}: {exc.strerror}") from None
        try:
            why = _owned_privately(os.fstat(fd))
            if why is not None:
                raise ConfigError(f"{field}: key file {rest} refused: {why}")
            return parse_key(os.read(fd, 4096), f"{field} ({rest})")
        finally:
            os.close(fd)
    if kind == "env":
        value = os.environ.get(rest)
        if not value:
            raise ConfigError(f"{field}: environment variable {rest} is not set")
        return parse_key(value.encode(), f"{field} (${rest})")
    path, _, name = rest.partition("#")
    cls = PROVIDERS.resolve(path, field)
    try:
        key = cls(options).load(name)
    except Exception as exc:  # a provider (a KMS client) may fail in any way: the store cannot start
        # Its message is not shown: a client's error may quote its credentials. It is chained for a traceback.
        raise ConfigError(f"{field}: key provider {path} failed: {type(exc).__name__} (message withheld: it may "
                          f"hold credentials)") from exc
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ConfigError(f"{field}: key provider {path} returned {type(key).__name__}, not 32 bytes")
    return key


def write_key_file(path: str) -> None:
    """A new random master key in a new file (mode 0600, never overwriting one), as 64 hex digits."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, os.urandom(KEY_BYTES).hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


class Keyring:
    """The tenant secrets of one deployment, in a directory only its owner can enter.

    Files: ``pepper`` (the key of tenant ids), ``t-<id>`` (a tenant's 32-byte secret, written under a temporary
    name and linked into place: two processes creating one tenant at once agree on the first one linked, and a
    secret is never rewritten), ``t-<id>.ns`` (the namespaces the tenant used, one id per line, appended) and
    ``t-<id>.ns.forgetting`` (those of the forgets under way) and ``t-<id>.forgotten`` (a tombstone, empty: the
    tenant's last forget ended at its mtime). A directory with tenants' files but no pepper is refused (a pepper
    made anew would name every tenant and chunk otherwise); each engine logs :meth:`fingerprint` at start.
    """

    def __init__(self, path: str, field: str = "encryption.keyring", create: bool = True) -> None:
        self.path = path
        if create:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise ConfigError(f"{field}: cannot create keyring directory {path}: {exc.strerror}") from None
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError as exc:
            raise ConfigError(f"{field}: cannot use keyring directory {path}: {exc.strerror}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{field}: {path} is not a directory")
        why = _owned_privately(st)
        if why is not None:
            raise ConfigError(f"{field}: keyring directory {path} refused: {why}")
        pepper = self._read("pepper")
        if pepper is None and create:
            # A new keyring, unless tenants' files show it had a pepper (lost, or the wrong path): a new one would
            # name every tenant and chunk otherwise than the other engines. (Read again: another engine starting
            # beside this one may have made it, and a tenant, since.)
            pepper = self._read("pepper") if self._holds_tenants() else self._create_or_read("pepper")
        if pepper is None and self._holds_tenants():
            raise ConfigError(f"{field}: {path} holds tenants' files but no pepper (the keyring's naming key): "
                              f"restore it, or point {field} at the deployment's keyring")
        if pepper is None:
            raise ConfigError(f"{field}: {path} holds no keyring (no pepper file)")
        self._pepper = pepper

    def _holds_tenants(self) -> bool:
        """Whether the directory holds any tenant's secret, namespace list or tombstone (then it had a pepper)."""
        return any(_TENANT_FILE.fullmatch(name) for name in os.listdir(self.path))

    def tenant_id(self, salt: str | None) -> str:
        """The keyring's name for the tenant of ``salt`` (None: requests without a salt)."""
        data = b"\x00" if salt is None else b"s" + salt.encode("utf-8", "surrogatepass")
        return "t-" + hashlib.blake2b(data, key=self._pepper, digest_size=16).hexdigest()

    def naming_key(self) -> bytes:
        """The key of the deployment's object names (:attr:`kvtier.keys.Namespace.name_key`). From the pepper: the
        same in every process sharing the keyring, never rotated (``kvtier cache rekey`` keeps every name), and no
        tenant state to read before a lookup can name its chunks."""
        return hashlib.blake2b(b"kvtier object names v1", key=self._pepper, digest_size=32).digest()

    def intact(self) -> bool:
        """Whether the pepper this keyring was opened with is still there (not: the directory being remounted, or
        another keyring mounted in its place)."""
        pepper = self._read("pepper")
        return pepper is not None and hmac.compare_digest(pepper, self._pepper)

    def fingerprint(self) -> str:
        """8 hex digits of a digest of :meth:`naming_key` (never the key): equal in every engine of a deployment,
        so operators can compare them (logged at start)."""
        return hashlib.blake2b(self.naming_key(), digest_size=4, person=b"kvtier-fp").hexdigest()

    def secret(self, tenant: str, create: bool) -> bytes | None:
        """The tenant's secret; created when missing and ``create``, else None."""
        return self._create_or_read(tenant) if create else self._read(tenant)

    def _read(self, name: str) -> bytes | None:
        try:
            fd = os.open(os.path.join(self.path, name), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            value = os.read(fd, KEY_BYTES + 1)
        finally:
            os.close(fd)
        if len(value) != KEY_BYTES:
            raise KVTierError(f"keyring {self.path}: {name} holds {len(value)} bytes, not a {KEY_BYTES}-byte secret")
        return value

    def _create_or_read(self, name: str) -> bytes:
        for _ in range(3):
            value = self._read(name)
            if value is not None:
                return value
            tmp = os.path.join(self.path, f".tmp-{os.getpid()}-{os.urandom(6).hex()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, os.urandom(KEY_BYTES))
                os.fsync(fd)
                try:
                    os.link(tmp, os.path.join(self.path, name))
                    self._sync_dir()
                except FileExistsError:
                    pass  # made first by another process: theirs it is
            finally:
                os.close(fd)
                os.unlink(tmp)
        raise KVTierError(f"keyring {self.path}: {name} keeps vanishing as it is made (forgotten meanwhile?)")

    def _sync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def add_namespace(self, tenant: str, namespace: str) -> None:
        """Record that ``tenant`` used ``namespace`` (an append of one short line: atomic on a local disk)."""
        fd = os.open(os.path.join(self.path, tenant + ".ns"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                     0o600)
        try:
            os.write(fd, namespace.encode() + b"\n")
        finally:
            os.close(fd)

    def namespaces(self, tenant: str, suffix: str = ".ns") -> list[str]:
        try:
            fd = os.open(os.path.join(self.path, tenant + suffix), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return []
        with os.fdopen(fd, "rb") as f:
            lines = f.read().decode("ascii", "replace").split()
        return list(dict.fromkeys(ns for ns in lines if re.fullmatch(r"[0-9a-f]{32}", ns)))

    def tenants(self) -> Iterator[str]:
        for name in sorted(os.listdir(self.path)):
            if _NAME.fullmatch(name):
                yield name

    def forget(self, tenant: str) -> list[str] | None:
        """Destroy a tenant's secret; the namespaces whose objects are to be removed, or None if the tenant has
        neither a secret nor a forget under way.

        Crash-safe in this order: the tenant's namespace list joins the list of the forgets under way
        (``.ns.forgetting``, written whole and renamed into place), then the secret goes. A forget that stopped
        anywhere is taken up again by the next one; :meth:`forgotten` drops the list (for a tombstone) once the
        objects are removed. A tenant made again afterwards starts a list of its own."""
        final = os.path.join(self.path, tenant)
        has_secret = os.path.exists(final)
        merged = list(dict.fromkeys(self.namespaces(tenant, ".ns.forgetting") + self.namespaces(tenant)))
        if not has_secret and not os.path.exists(final + ".ns.forgetting") and not merged:
            return None
        tmp = os.path.join(self.path, f".tmp-{os.getpid()}-{os.urandom(6).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, "".join(f"{ns}\n" for ns in merged).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final + ".ns.forgetting")
        self._sync_dir()
        for name in (final, final + ".ns"):  # the secret first: the tenant is forgotten from here on
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
        self._sync_dir()
        return merged

    def forgotten(self, tenant: str) -> None:
        """The forget's objects are removed: its list of namespaces goes, a tombstone stays (:meth:`forgotten_at`)."""
        final = os.path.join(self.path, tenant)
        os.close(os.open(final + ".forgotten", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600))
        os.utime(final + ".forgotten")  # (its mtime: when the forget ended)
        try:
            os.unlink(final + ".ns.forgetting")
        except FileNotFoundError:
            pass

    def forgotten_at(self, tenant: str) -> float | None:
        """When the tenant's last forget ended (its tombstone), or None if none did: a repeated forget is told
        apart from a salt never seen."""
        try:
            st = os.stat(os.path.join(self.path, tenant + ".forgotten"), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_mtime if stat.S_ISREG(st.st_mode) else None


def key_id(tenant_key: bytes) -> bytes:
    return hmac.new(tenant_key, b"kvtier key id", hashlib.sha256).digest()[:_KEY_ID_BYTES]


def tenant_key(master: bytes, secret: bytes, tenant: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=secret,
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
        self._tenants: OrderedDict[str, Tenant] = OrderedDict()
        self._by_ns: OrderedDict[str, Tenant] = OrderedDict()
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
                self._by_ns.move_to_end(ns.id)
                self._tenants.move_to_end(tenant.id)
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
                tenant = self._tenants.setdefault(tid, made)
                while len(self._tenants) > _KEPT_TENANTS:  # attached again on next use
                    self._tenants.popitem(last=False)
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
            self._by_ns.move_to_end(namespace)
            while len(self._by_ns) > _KEPT_NAMESPACES:
                self._by_ns.popitem(last=False)
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
            tenants = list(self._tenants.values())
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
             created: float | None = None) -> list[memoryview | bytes]:
        """The parts of the sealed object for ``payload``: its header, then the ciphertext (in a buffer of this
        thread's, reused by its next seal: write it before sealing again)."""
        if sum(len(part) for part in payload) != meta.nbytes:
            raise ValueError(f"payload of {sum(len(p) for p in payload)} bytes for a shard of {meta.nbytes}")
        tenant = self._tenant(key.namespace)
        if tenant is None:
            raise SealError(f"no tenant key for namespace {key.namespace} in this process (forgotten since)")
        kid, data_key = tenant.keys[0]
        nonce = os.urandom(_NONCE_BYTES)
        aad = frame.sealed_aad(key, meta, kid, nonce, created)
        encryptor = Cipher(algorithms.AES(object_key(data_key, nonce)),
                           modes.GCM(nonce[_NONCE_BYTES // 2:])).encryptor()
        encryptor.authenticate_additional_data(aad)
        out = self._buffer(meta.nbytes)
        pos = 0
        for part in payload:
            pos += encryptor.update_into(part, out[pos:pos + len(part)])
        encryptor.finalize()
        return [frame.sealed_header(aad, encryptor.tag), out[:pos]]

    def _buffer(self, nbytes: int) -> memoryview:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._scratch.buf = memoryview(bytearray(nbytes))
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
        for part in payload:
            decryptor.update_into(part, part)
        try:
            decryptor.finalize()
        except InvalidTag:
            raise frame.FrameError("sealed object fails to authenticate (forged, altered, or moved from another "
                                   "key)") from None

    def close(self) -> None:
        self._closed.set()
