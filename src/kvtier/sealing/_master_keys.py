"""The ``encryption`` section of a store config, and the master keys it names: from a file, an environment variable
or a :class:`KeyProvider` (a KMS client, loaded by module path)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from kvtier._config_values import unknown_key
from kvtier.errors import ConfigError
from kvtier.registry import Registry

SECRET_BYTES = 32  # a master key, a tenant secret, a tenant key: 256 bits each


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

    key: str = dataclasses.field(metadata={
        "help": "the current master key, which seals every new shard: file:/path (owner-only, 64 hex digits; "
                "`kvtier keygen` writes one), env:VARIABLE, or provider:package.module:Class[#name] (e.g. a KMS)"})
    keyring: str = dataclasses.field(metadata={
        "help": "absolute path of the keyring directory (per-tenant secrets, owner-only), shared by every engine "
                "of the deployment"})
    old_keys: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "help": "earlier master keys, in the same forms: they still open shards, never seal new ones"})
    provider_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, metadata={
        "help": "given to a provider class"})
    refresh_seconds: float = dataclasses.field(default=1.0, metadata={
        "help": "how soon a running process notices a forgotten tenant"})

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
        raise ConfigError(unknown_key("encryption", unknown[0], allowed))
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
        if len(key) == SECRET_BYTES:
            return key
    raise ConfigError(f"{where}: not a 256-bit key (64 hex digits or base64 of 32 bytes; `kvtier keygen FILE` "
                      "writes one)")


def owned_privately(st: os.stat_result) -> str | None:
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
            why = owned_privately(os.fstat(fd))
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
    if not isinstance(key, bytes) or len(key) != SECRET_BYTES:
        raise ConfigError(f"{field}: key provider {path} returned {type(key).__name__}, not 32 bytes")
    return key


def write_key_file(path: str) -> None:
    """A new random master key in a new file (mode 0600, never overwriting one), as 64 hex digits."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, os.urandom(SECRET_BYTES).hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
