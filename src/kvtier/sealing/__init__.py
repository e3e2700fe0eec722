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

Modules: ``_master_keys`` (the config section, master keys and their providers), ``_keyring`` (the tenant secrets
on disk), ``_sealer`` (tenant keys, sealing and opening, the watch for forgotten tenants); all re-exported here.
"""

from kvtier.sealing._keyring import Keyring
from kvtier.sealing._master_keys import (PROVIDERS, SECRET_BYTES, EncryptionConfig, KeyProvider, load_key,
                                         parse_encryption, parse_key, write_key_file)
from kvtier.sealing._sealer import Sealer, Tenant, UnrecordedNamespace, key_id, object_key, tenant_key

__all__ = ["PROVIDERS", "SECRET_BYTES", "EncryptionConfig", "KeyProvider", "Keyring", "Sealer", "Tenant",
           "UnrecordedNamespace", "key_id", "load_key", "object_key", "parse_encryption", "parse_key", "tenant_key",
           "write_key_file"]
