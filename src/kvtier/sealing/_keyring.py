"""The keyring: one deployment's tenant secrets and namespace lists, in a directory only its owner can enter."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from collections.abc import Iterator

from kvtier.errors import ConfigError, KVTierError
from kvtier.sealing._master_keys import SECRET_BYTES, owned_privately

_NAME = re.compile(r"t-[0-9a-f]{32}")
_TENANT_FILE = re.compile(r"t-[0-9a-f]{32}(\.ns|\.ns\.forgetting|\.forgotten)?")  # a secret, its lists, a tombstone


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
        why = owned_privately(st)
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
            value = os.read(fd, SECRET_BYTES + 1)
        finally:
            os.close(fd)
        if len(value) != SECRET_BYTES:
            raise KVTierError(f"keyring {self.path}: {name} holds {len(value)} bytes, not a {SECRET_BYTES}-byte secret")
        return value

    def _create_or_read(self, name: str) -> bytes:
        for _ in range(3):
            value = self._read(name)
            if value is not None:
                return value
            tmp = os.path.join(self.path, f".tmp-{os.getpid()}-{os.urandom(6).hex()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, os.urandom(SECRET_BYTES))
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
