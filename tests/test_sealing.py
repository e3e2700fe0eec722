"""Encryption at rest: what a tier holds is sealed per tenant; a tier writer's forged, moved, altered or replayed
object is a miss; keys rotate with no lost hits; a forgotten tenant's KV is unreadable everywhere at once while
other tenants keep hitting; bad key sources are refused naming the field."""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash
import yaml

from kvtier import KVStore, Namespace, frame
from kvtier.cli import main
from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierError, TierError
from kvtier.keys import ShardKey, chunk_keys
from kvtier.sealing import KeyProvider, Keyring, Sealer, write_key_file
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.conftest import CLEAN_AUDIT, settled

T = 16


def key_file(path: Path) -> str:
    if not path.exists():
        write_key_file(str(path))
    return f"file:{path}"


def config(tmp_path: Path, *, key: str = "k1", old: tuple[str, ...] = (), tier: dict | None = None,
           refresh: float = 0.1, **extra: object) -> dict:
    tier = tier or {"type": "filesystem", "name": "disk", "path": str(tmp_path / "disk"), "queue_depth": 4096}
    return {"chunk_tokens": T, "dram": {"capacity_bytes": "8MiB", "page_bytes": "16KiB"}, "tiers": [tier],
            "encryption": {"key": key_file(tmp_path / key), "old_keys": [key_file(tmp_path / k) for k in old],
                           "keyring": str(tmp_path / "keyring"), "refresh_seconds": refresh}, **extra}


def ns(salt: str | None) -> Namespace:
    return Namespace(model="m", dtype="bfloat16", cache_salt=salt)


def objects(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "disk").rglob("*.kv"))


def cold(store: KVStore) -> KVStore:
    store.flush()
    store.drop_dram()
    return store


def test_a_tier_holds_only_sealed_objects_and_a_new_process_reads_them(tmp_path: Path) -> None:
    tokens = synthetic_tokens(1, 3 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path)) as store:
        store.put(ns("a"), tokens, kv)
        cold(store)
        assert torch.equal(store.get(ns("a"), tokens), kv)  # read back from the disk, decrypted into DRAM
    files = objects(tmp_path)
    assert len(files) == 3
    raw = kv[:, :, :, :T].contiguous().view(torch.uint8).numpy().tobytes()[:64]
    for path in files:
        blob = path.read_bytes()
        assert frame.decode_header(blob).sealing is not None
        assert raw not in blob  # no run of the plaintext is on disk
        with pytest.raises(frame.UnknownKey, match="no encryption key"):
            frame.decode(blob)
    with KVStore.from_config(config(tmp_path)) as store:  # a restart: the keyring gives the same tenant key
        assert torch.equal(store.get(ns("a"), tokens), kv)
        assert store.stats()["disk"]["hit_chunks_total"] == 3


def _rewrite_header(blob: bytes, key: ShardKey) -> bytes:
    """``blob`` with its header made to name ``key`` and its header checksum redone: what a tier writer can do."""
    head = bytearray(blob[:frame.SEALED_HEADER_LEN])
    head[32:48] = bytes.fromhex(key.namespace)
    head[48:64] = bytes.fromhex(key.chunk)
    head[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(head[:-8])))
    return bytes(head) + blob[frame.SEALED_HEADER_LEN:]


def test_a_tier_writer_cannot_forge_move_alter_or_replay_objects(tmp_path: Path) -> None:
    tokens = synthetic_tokens(2, 2 * T)
    other = synthetic_tokens(3, 2 * T)
    kv, other_kv = synthetic_kv(tokens), synthetic_kv(other)
    with KVStore.from_config(config(tmp_path)) as store:
        store.put(ns("a"), tokens, kv)
        store.put(ns("a"), other, other_kv)
        store.put(ns("b"), tokens, kv)
        store.flush()
        disk = store.tiers[0]
        by_key = {o.key: o for o in disk.list()}
        a_keys = [k for k in by_key if k.namespace == store.named(ns("a")).id]
        b_keys = [k for k in by_key if k.namespace == store.named(ns("b")).id]
        victim, neighbour = b_keys  # tenant b's two chunks
        attacks = {
            # a plain object, checksummed correctly: what anyone could write without a key
            "plain": lambda: frame.encode_header(victim, meta, [payload]) + payload,
            # the tenant's other chunk's sealed object, its header rewritten to name this key
            "moved": lambda: _rewrite_header(disk.get(neighbour), victim),
            # the right object with one ciphertext byte flipped
            "altered": lambda: flip(disk.get(victim)),
            # tenant a's object, renamed into tenant b's namespace (a replay across tenants)
            "replayed": lambda: _rewrite_header(disk.get(a_keys[0]), victim),
        }
        meta = frame.decode_header(disk.get(victim)).meta
        payload = synthetic_kv(tokens)[:, :, :, :T].contiguous().view(torch.uint8).numpy().tobytes()
        genuine = disk.get(victim)
        outcomes = {}
        for name, make in attacks.items():
            disk.put(victim, [make()])
            store.drop_dram()
            before = store.stats()["disk"]
            got = store.get(ns("b"), tokens)
            after = store.stats()["disk"]
            outcomes[name] = (got is None, after["corrupt_objects_total"] - before["corrupt_objects_total"],
                              after["unopened_objects_total"] - before["unopened_objects_total"])
            disk.put(victim, [genuine])
        assert outcomes == {"plain": (True, 1, 0), "moved": (True, 1, 0), "altered": (True, 1, 0),
                            "replayed": (True, 0, 1)}, outcomes
    with KVStore.from_config(config(tmp_path)) as store:  # (that engine now skips the key for a while)
        assert torch.equal(store.get(ns("b"), tokens), kv)  # the genuine object put back serves


def flip(blob: bytes) -> bytes:
    out = bytearray(blob)
    out[frame.SEALED_HEADER_LEN + 5] ^= 0x40
    return bytes(out)


def test_tenants_have_their_own_keys_and_a_store_without_the_key_reads_nothing(tmp_path: Path) -> None:
    tokens = synthetic_tokens(4, 2 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path)) as store:
        store.put(ns("a"), tokens, kv)
        store.put(ns("b"), tokens, kv)
        store.put(ns(None), tokens, kv)
        store.flush()
        ids = {frame.decode_header(p.read_bytes()).sealing.key_id for p in objects(tmp_path)}
        assert len(ids) == 3  # one key per tenant (no salt is a tenant too)
    plain = config(tmp_path)
    del plain["encryption"]
    # Another master key (the same keyring: the same names); no key at all (nor the keyring's names: none found).
    for cfg, salt, unopened in ((config(tmp_path, key="other"), "a", 1), (plain, "b", 0)):
        with KVStore.from_config(cfg) as store:
            assert store.get(ns(salt), tokens) is None
            assert store.get(ns(salt), tokens) is None  # the second get does not read the object again
            stats = store.stats()["disk"]
            assert (stats["unopened_objects_total"], stats["corrupt_objects_total"]) == (unopened, 0)  # not corrupt
    assert len(objects(tmp_path)) == 6  # left for the engines that hold the key
    with KVStore.from_config(config(tmp_path)) as store:
        assert torch.equal(store.get(ns("a"), tokens), kv)


def test_a_master_key_rotates_under_load_with_no_wrong_kv_and_no_lost_hits(tmp_path: Path, capsys) -> None:
    prompts = [synthetic_tokens(10 + i, 4 * T) for i in range(6)]
    kvs = [synthetic_kv(p) for p in prompts]
    with KVStore.from_config(config(tmp_path, key="k1")) as store:
        for i, (p, kv) in enumerate(zip(prompts, kvs)):
            store.put(ns(f"t{i % 3}"), p, kv)
    rotated = config(tmp_path, key="k2", old=("k1",))
    path = tmp_path / "rotated.yaml"
    path.write_text(yaml.safe_dump(rotated))
    stop = threading.Event()
    results: list[bool] = []

    def serve() -> None:  # an engine on the new key, reading throughout the rekey
        with KVStore.from_config(rotated) as store:
            while not stop.is_set():
                for i, (p, kv) in enumerate(zip(prompts, kvs)):
                    store.drop_dram()
                    got = store.get(ns(f"t{i % 3}"), p)
                    results.append(got is not None and torch.equal(got, kv))

    lagging: list[bool] = []

    def lag() -> None:  # an engine not yet given the new key: misses what is re-sealed, removes nothing
        with KVStore.from_config(config(tmp_path, key="k1")) as store:
            while not stop.is_set():
                for i, (p, kv) in enumerate(zip(prompts, kvs)):
                    got = store.get(ns(f"t{i % 3}"), p)
                    lagging.append(got is None or torch.equal(got, kv))
                    store.drop_dram()

    readers = [threading.Thread(target=serve), threading.Thread(target=lag)]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 120
        while len(results) < 12 and readers[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # the readers are under way (two passes)
        assert main(["cache", "rekey", "--config", str(path)]) == 0
        after = len(results)
        while len(results) < after + 12 and readers[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # and read on after it (two more passes)
        assert len(results) >= after + 12
    finally:
        stop.set()
        for reader in readers:
            reader.join()
    assert lagging and all(lagging)  # never wrong KV
    assert len(objects(tmp_path)) == 24  # and nothing removed
    out = capsys.readouterr().out
    assert "24 re-sealed, 0 already under the current key" in out, out
    assert all(results), (len(results), results.count(False))
    assert main(["cache", "rekey", "--config", str(path)]) == 0
    assert "0 re-sealed, 24 already under the current key" in capsys.readouterr().out
    with KVStore.from_config(config(tmp_path, key="k2")) as store:  # the old key retired: everything still opens
        for i, (p, kv) in enumerate(zip(prompts, kvs)):
            assert torch.equal(store.get(ns(f"t{i % 3}"), p), kv)


def test_forgetting_a_tenant_makes_its_kv_unreadable_everywhere_while_others_keep_hitting(tmp_path: Path,
                                                                                         capsys) -> None:
    tokens = synthetic_tokens(5, 3 * T)
    kv = synthetic_kv(tokens)
    cfg = config(tmp_path, audit_log=str(tmp_path / "audit.log"))
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with KVStore.from_config(cfg) as engine:  # a running engine holds both tenants in DRAM and on disk
        engine.put(ns("gone"), tokens, kv)
        engine.put(ns("stays"), tokens, kv)
        engine.flush()
        forget_key = next(iter(engine.tiers[0].list(engine.named(ns("gone")).id))).key
        kept = engine.tiers[0].get(forget_key)  # what an attacker copied from the tier before the forget
        assert main(["tenant", "forget", "gone", "--config", str(path)]) == 0
        out = capsys.readouterr().out
        assert "key destroyed" in out and "removed 3 objects" in out, out
        assert engine.get(ns("gone"), tokens) is None  # DRAM dropped too, within refresh_seconds
        assert torch.equal(engine.get(ns("stays"), tokens), kv)
        engine.tiers[0].put(forget_key, [kept])  # the copy put back: under a key nobody holds any more
        assert engine.get(ns("gone"), tokens) is None
        assert engine.stats()["disk"]["unopened_objects_total"] >= 1
    with KVStore.from_config(cfg) as store:  # a new process: the tenant starts afresh, nothing of before opens
        assert store.get(ns("gone"), tokens) is None
        assert torch.equal(store.get(ns("stays"), tokens), kv)
    audit = (tmp_path / "audit.log").read_text()
    assert '"action":"forget"' in audit and '"action":"forget-remove"' in audit and "gone" not in audit
    assert main(["tenant", "forget", "never-seen", "--config", str(path)]) == 1


def test_a_forget_reaches_a_tier_that_cannot_list(tmp_path: Path, mooncake_server, unique_prefix: str,
                                                  capsys) -> None:
    """Mooncake without its admin address cannot list: the objects stay, and no key opens them any more; a forget
    taken up again with a tier that lists removes them."""
    tokens = synthetic_tokens(6, 2 * T)
    kv = synthetic_kv(tokens)
    listing = {"type": "mooncake", "name": "mc", **mooncake_server.tier_options(), "key_prefix": unique_prefix}
    blind = {k: v for k, v in listing.items() if k != "admin_url"}
    cfg = config(tmp_path, tier=blind)
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with KVStore.from_config(cfg) as store:
        store.put(ns("x"), tokens, kv)
        store.put(ns("y"), tokens, kv)
    assert main(["tenant", "forget", "x", "--config", str(path)]) == 0
    assert "cannot remove the objects" in capsys.readouterr().out
    with KVStore.from_config(cfg) as store:
        assert store.get(ns("x"), tokens) is None  # still stored, opened by no key
        assert store.stats()["mc"]["unopened_objects_total"] == 1
        assert torch.equal(store.get(ns("y"), tokens), kv)
    with_listing = config(tmp_path, tier=listing)
    path.write_text(yaml.safe_dump(with_listing))
    assert main(["tenant", "forget", "x", "--config", str(path)]) == 0  # taken up again
    assert "tier mc: removed 2 objects" in capsys.readouterr().out
    with KVStore.from_config(with_listing) as store:
        assert [o.key.namespace for o in store.tiers[0].list()] == [store.named(ns("y")).id] * 2


def _create_tenant(path: str, barrier, out) -> None:
    keyring = Keyring(path)
    barrier.wait()
    out.put(keyring.secret(keyring.tenant_id("shared"), create=True)[0])


def test_processes_creating_one_tenant_at_once_agree_on_its_secret(tmp_path: Path) -> None:
    Keyring(str(tmp_path / "keyring"))
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_create_tenant, args=(str(tmp_path / "keyring"), barrier, out)) for _ in range(4)]
    for p in procs:
        p.start()
    secrets = {out.get(timeout=30) for _ in procs}
    for p in procs:
        p.join()
    assert len(secrets) == 1


class StaticProvider(KeyProvider):
    def load(self, name: str) -> bytes:
        return bytes.fromhex(self.options["keys"][name])


def test_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = synthetic_tokens(7, T)
    kv = synthetic_kv(tokens)
    hexkey = os.urandom(32).hex()
    (tmp_path / "k").write_text(hexkey + "\n")
    (tmp_path / "k").chmod(0o600)
    monkeypatch.setenv("KVTIER_TEST_KEY", hexkey)
    sources = [("file", f"file:{tmp_path / 'k'}", {}),
               ("env", "env:KVTIER_TEST_KEY", {}),
               ("provider", f"provider:{__name__}:StaticProvider#main", {"keys": {"main": hexkey}})]
    for name, source, options in sources:
        cfg = config(tmp_path)
        cfg["encryption"].update(key=source, provider_options=options)
        with KVStore.from_config(cfg) as store:
            if name == "file":
                store.put(ns("a"), tokens, kv)
            cold(store)
            assert torch.equal(store.get(ns("a"), tokens), kv), name  # one key, three sources


def written(path: Path, text: str, mode: int) -> str:
    path.write_text(text)
    path.chmod(mode)
    return f"file:{path}"


@pytest.mark.parametrize("change, message", [
    (lambda p: written(p / "loose", os.urandom(32).hex(), 0o644),
     r"encryption.key: key file .*loose refused: its mode 0644 lets others in"),
    (lambda p: written(p / "short", "abcd", 0o600), r"encryption.key \(.*short\): not a 256-bit key"),
    (lambda p: "file:" + str(p / "missing"), r"encryption.key: cannot open key file .*missing"),
    (lambda p: "env:KVTIER_UNSET_KEY", r"encryption.key: environment variable KVTIER_UNSET_KEY is not set"),
    (lambda p: "provider:nowhere.module:Thing", r"encryption.key: cannot load key provider plugin"),
    (lambda p: f"provider:{__name__}:StaticProvider#absent", r"encryption.key: key provider .* failed: KeyError"),
])
def test_bad_key_sources_are_refused_naming_the_field(tmp_path: Path, change, message: str) -> None:
    cfg = config(tmp_path)
    cfg["encryption"]["key"] = change(tmp_path)
    cfg["encryption"]["provider_options"] = {"keys": {}}
    with pytest.raises(ConfigError, match=message):
        KVStore.from_config(cfg)
    assert not (tmp_path / "disk").exists()  # refused before any tier opened


@pytest.mark.parametrize("encryption, message", [
    ({"key": "k"}, r"encryption.key: a key source"),
    ({"key": "env:K"}, r"encryption.keyring: required"),
    ({"key": "env:K", "keyring": "rel/dir"}, r"encryption.keyring: required, the absolute path"),
    ({"key": "env:K", "keyring": "/x", "old_keys": "env:J"}, r"encryption.old_keys: expected a list"),
    ({"key": "env:K", "keyring": "/x", "old_keys": ["J"]}, r"encryption.old_keys\[0\]: a key source"),
    ({"key": "env:K", "keyring": "/x", "refresh_seconds": 0}, r"encryption.refresh_seconds"),
    ({"key": "env:K", "keyring": "/x", "cipher": "des"}, r"encryption.cipher: unknown key; allowed: key, keyring"),
])
def test_bad_encryption_config_is_refused_naming_the_field(encryption: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"encryption": encryption})


def test_a_keyring_others_can_enter_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keyring").mkdir(mode=0o755)
    (tmp_path / "keyring").chmod(0o755)
    with pytest.raises(ConfigError, match=r"encryption.keyring: keyring directory .* refused: its mode 0755"):
        Sealer(load_config(config(tmp_path)).encryption)


def test_keygen_writes_a_private_key_and_never_overwrites(tmp_path: Path, capsys) -> None:
    path = tmp_path / "master.key"
    assert main(["keygen", str(path)]) == 0
    assert path.stat().st_mode & 0o777 == 0o600 and len(bytes.fromhex(path.read_text().strip())) == 32
    before = path.read_bytes()
    assert main(["keygen", str(path)]) == 2
    assert "never overwritten" in capsys.readouterr().err and path.read_bytes() == before


def test_verify_opens_sealed_objects(tmp_path: Path, capsys) -> None:
    tokens = synthetic_tokens(8, 2 * T)
    cfg = config(tmp_path)
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with KVStore.from_config(cfg) as store:
        store.put(ns("v"), tokens, synthetic_kv(tokens))
    assert main(["cache", "verify", "--config", str(path)]) == 0
    assert "2 ok, 0 bad" in capsys.readouterr().out
    victim = objects(tmp_path)[0]
    victim.write_bytes(flip(victim.read_bytes()))
    assert main(["cache", "verify", "--config", str(path)]) == 1
    assert "1 ok, 1 bad" in capsys.readouterr().out


def test_rekey_never_seals_a_plain_object_a_tier_writer_planted(tmp_path: Path, capsys) -> None:
    tokens = synthetic_tokens(9, 2 * T)
    kv = synthetic_kv(tokens)
    cfg = config(tmp_path, key="k2", old=("k1",))
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with KVStore.from_config(config(tmp_path, key="k1")) as store:
        store.put(ns("a"), tokens, kv)
        store.flush()
        victim = next(iter(store.tiers[0].list())).key
        forged = torch.zeros_like(kv[:, :, :, :T]).contiguous().view(torch.uint8).numpy().tobytes()
        meta = frame.decode_header(store.tiers[0].get(victim)).meta
        store.tiers[0].put(victim, [frame.encode_header(victim, meta, [forged]) + forged])
    assert main(["cache", "rekey", "--config", str(path)]) == 0
    assert "1 re-sealed, 0 already under the current key, 1 plain" in capsys.readouterr().out
    with KVStore.from_config(cfg) as store:
        assert store.get(ns("a"), tokens) is None  # the planted object is still refused
        assert store.stats()["disk"]["corrupt_objects_total"] == 1


def test_forget_is_taken_up_again_after_a_crash_at_any_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys) -> None:
    tokens = synthetic_tokens(11, 2 * T)
    cfg = config(tmp_path)
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for crash_at in ("secret", "tiers"):
        with KVStore.from_config(cfg) as store:
            store.put(ns("c"), tokens, synthetic_kv(tokens))
        real_unlink = os.unlink

        def crash(name, *args, **kw):  # os.unlink during this iteration only (undone at its end)
            if crash_at == "secret" and str(name).endswith(  # noqa: B023 used in this iteration only
                    Keyring(str(tmp_path / "keyring")).tenant_id("c")):
                raise KeyboardInterrupt("killed before the secret went")
            return real_unlink(name, *args, **kw)  # noqa: B023 used in this iteration only

        monkeypatch.setattr(os, "unlink", crash)
        if crash_at == "tiers":
            monkeypatch.setattr("kvtier.cli.encryption._remove", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            main(["tenant", "forget", "c", "--config", str(path)])
        monkeypatch.undo()
        assert len(objects(tmp_path)) == 2
        assert main(["tenant", "forget", "c", "--config", str(path)]) == 0, crash_at
        assert "removed 2 objects" in capsys.readouterr().out and not objects(tmp_path)
        tid = Keyring(str(tmp_path / "keyring")).tenant_id("c")
        assert [p.name for p in (tmp_path / "keyring").glob("t-*")] == [f"{tid}.forgotten"]  # its tombstone alone


def test_a_tenant_forgotten_while_a_put_runs_leaves_nothing_in_dram(tmp_path: Path) -> None:
    tokens = synthetic_tokens(12, 2 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path, refresh=60)) as store:
        keyring = Keyring(str(tmp_path / "keyring"))

        def source(first: int, dst: torch.Tensor) -> None:  # the forget lands while the put copies
            os.unlink(tmp_path / "keyring" / keyring.tenant_id("r"))
            store._tenancy.sealer.check_forgotten()
            dst.copy_(kv[:, :, :, first * T:(first + dst.shape[0]) * T].unflatten(3, (dst.shape[0], T))
                      .permute(3, 0, 1, 2, 4, 5))

        stored = store.put_from(ns("r"), tokens, source, layers=kv.shape[0], head_dim=kv.shape[4], dtype=kv.dtype,
                                kv_heads=kv.shape[2])
        assert stored == 0  # what it stored was dropped: it says so (the caller must not count it as stored)
        store.flush()
        assert store.get(ns("r"), tokens) is None
        assert not objects(tmp_path)  # and nothing was written under the destroyed key


def test_a_failing_keyring_costs_the_secondary_tiers_not_the_call(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = synthetic_tokens(13, 2 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path)) as store:
        def full(*args: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(Keyring, "add_namespace", full)
        store.put(ns("f"), tokens, kv)  # no exception into the engine
        assert torch.equal(store.get(ns("f"), tokens), kv)  # DRAM serves it
        store.flush()
        assert not objects(tmp_path)  # nothing sealed without a tenant key
        assert store.stats()["_store"]["keyring_errors_total"] >= 1


def test_the_keyring_watch_survives_a_failed_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = synthetic_tokens(14, T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path, refresh=0.05)) as store:
        store.put(ns("w"), tokens, kv)
        real = Keyring.secret
        fails = iter([True, True])

        def flaky(self, tenant, create):
            if next(fails, False):
                raise OSError(116, "Stale file handle")
            return real(self, tenant, create)

        monkeypatch.setattr(Keyring, "secret", flaky)
        time.sleep(0.3)  # two failed checks
        os.unlink(tmp_path / "keyring" / Keyring(str(tmp_path / "keyring")).tenant_id("w"))
        deadline = time.monotonic() + 5
        while store.get(ns("w"), tokens) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.get(ns("w"), tokens) is None  # the watch went on and saw the forget


def test_no_key_material_in_reprs(tmp_path: Path) -> None:
    with KVStore.from_config(config(tmp_path)) as store:
        tenant = store._tenancy.sealer.register(ns("r"))
        text = repr(tenant) + repr(store._tenancy.sealer.config)
        for _kid, key in tenant.keys:
            assert key.hex() not in text and repr(key) not in text
        assert tenant.secret.hex() not in text and repr(tenant.secret) not in text


@pytest.mark.parametrize("fault", ["altered", "unreadable"])
def test_a_fault_among_shards_read_ahead_and_decrypted_leaks_nothing(tmp_path: Path, fault: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Sealed shards are read ahead on the caller's thread and decrypted on another. A shard that fails ends the
    load with the chunks before it exact: altered, its decryption fails there and the load ends at its chunk;
    unreadable, the disk rests from that moment (an outage), so the load also drops the chunks read ahead before
    it (the shard is read READ_AHEAD chunks ahead of the one being taken). Every shard read ahead and not used
    gives its DRAM back, but only once its decryption has ended."""
    from kvtier.store import READ_AHEAD

    first_bad = READ_AHEAD + 1  # read once chunk 1 is taken: chunks 0 and 1 served before the disk rests
    tokens = synthetic_tokens(16, (first_bad + 3) * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path)) as store:
        store.put(ns("f"), tokens, kv)
        cold(store)
        disk = store.tiers[0]
        by_chunk = {o.key.chunk: o.key for o in disk.list()}
        keys = [by_chunk[c.hex()] for c in chunk_keys(store.named(ns("f")), tokens, T)]  # in chunk order
        bad = keys[first_bad]
        if fault == "altered":
            disk.put(bad, [flip(disk.get(bad))])
        else:
            real = disk.get_into
            eio = TierError(f"disk: cannot read {bad.name}: EIO")  # what the tier makes of a failed read

            monkeypatch.setattr(disk, "get_into", lambda key, *a: (_ for _ in ()).throw(eio)
                                if key == bad else real(key, *a))
        # One decryption is held until the load has returned, of a shard read ahead and not used (altered: the chunk
        # after the fault; unreadable: the one before it, dropped as the disk rests): its entry must stay reserved
        # until then (pages given back while a thread writes into them would be reused).
        held, release = keys[first_bad + 1 if fault == "altered" else first_bad - 1], threading.Event()
        read_into = store._reads.shards.read_into

        def slow(tier, key, entry, *args):
            if key == held:
                release.wait(10)
            return read_into(tier, key, entry, *args)

        monkeypatch.setattr(store._reads.shards, "read_into", slow)
        got = torch.zeros_like(kv)

        def sink(first: int, chunks: torch.Tensor) -> None:
            got[:, :, :, first * T:(first + chunks.shape[0]) * T] = chunks.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)

        served = store.load(ns("f"), tokens, sink, layers=kv.shape[0], head_dim=kv.shape[4], dtype=kv.dtype)
        assert served == (first_bad * T if fault == "altered" else 2 * T)
        assert torch.equal(got[:, :, :, :served], kv[:, :, :, :served])
        assert store.dram.audit()["pending"] >= 1  # the held shard's entry, its decryption still under way
        release.set()
        stats = store.stats()["disk"]
        assert (stats["corrupt_objects_total"], bad in {o.key for o in disk.list()}) == \
            ((1, False) if fault == "altered" else (0, True))
        assert settled(store) == CLEAN_AUDIT
        monkeypatch.undo()
        if fault == "unreadable":
            assert store.stats()["disk"]["read_errors_total"] >= 1
            time.sleep(1.1)  # the tier's reads rest after a failure (retry_seconds)
            assert torch.equal(store.get(ns("f"), tokens), kv)


def _forget_cli(tmp_path: Path, cfg: dict, salt: str) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["tenant", "forget", salt, "--config", str(path)]) == 0


def test_a_forget_drops_dram_of_a_tenant_pushed_out_of_the_key_cache(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A client sending requests under many salts pushes a tenant out of the process's bounded key cache (shrunk
    here): the keyring watch no longer checks it, yet once it is forgotten its DRAM entries are never served."""
    monkeypatch.setattr("kvtier.sealing._sealer._KEPT_TENANTS", 2)
    tokens = synthetic_tokens(20, 2 * T)
    kv = synthetic_kv(tokens)
    cfg = config(tmp_path, refresh=0.05)
    with KVStore.from_config(cfg) as engine:
        engine.put(ns("old"), tokens, kv)
        for i in range(3):  # the flood: "old" leaves the key cache
            engine.put(ns(f"flood{i}"), tokens[:T], kv[:, :, :, :T])
        assert len(engine.dram) == 2 + 3  # "old" still in DRAM
        _forget_cli(tmp_path, cfg, "old")
        assert engine.get(ns("old"), tokens) is None
        assert torch.equal(engine.get(ns("flood2"), tokens[:T]), kv[:, :, :, :T])


def test_a_forget_drops_dram_of_a_namespace_the_keyring_failed_to_record(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One failed keyring write (here EMFILE opening the tenant's namespace list) during a put leaves the namespace
    in no tenant's list: DRAM may serve it, no secondary tier gets it, and a forget still ends its service."""
    tokens = synthetic_tokens(21, 2 * T)
    kv = synthetic_kv(tokens)
    cfg = config(tmp_path, refresh=0.05)
    real_open = os.open

    def no_descriptors(path, flags, *args, **kwargs):
        if str(path).endswith(".ns") and flags & os.O_APPEND:
            raise OSError(24, "Too many open files")
        return real_open(path, flags, *args, **kwargs)

    with KVStore.from_config(cfg) as engine:
        monkeypatch.setattr(os, "open", no_descriptors)
        engine.put(ns("b"), tokens, kv)
        assert torch.equal(engine.get(ns("b"), tokens), kv)  # served from DRAM
        engine.flush()
        assert not objects(tmp_path)  # nothing sealed for a namespace forget could not find
        assert engine.stats()["_store"]["keyring_errors_total"] >= 1
        _forget_cli(tmp_path, cfg, "b")
        assert engine.get(ns("b"), tokens) is None


def test_a_forget_noticed_while_a_read_promotes_leaves_nothing_served(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard decrypted before the keyring watch noticed a forget and committed into DRAM after the watch's purge:
    neither the read under way nor any later one serves it (held here between decryption and commit)."""
    tokens = synthetic_tokens(22, T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path, refresh=60)) as store:  # the watch ticks only when told below
        store.put(ns("p"), tokens, kv)
        cold(store)
        decrypted, release = threading.Event(), threading.Event()
        read_into = store._reads.shards.read_into

        def held(tier, key, entry, *args):
            created = read_into(tier, key, entry, *args)
            decrypted.set()
            release.wait(10)
            return created

        monkeypatch.setattr(store._reads.shards, "read_into", held)
        got: list[torch.Tensor | None] = []
        reader = threading.Thread(target=lambda: got.append(store.get(ns("p"), tokens)))
        reader.start()
        try:
            assert decrypted.wait(10)
            keyring = Keyring(str(tmp_path / "keyring"))
            keyring.forget(keyring.tenant_id("p"))
            store._tenancy.sealer.check_forgotten()  # the watch's tick: its DRAM purge runs before the commit
        finally:
            release.set()
            reader.join(10)
        monkeypatch.undo()
        assert got == [None]
        assert store.get(ns("p"), tokens) is None
        assert len(store.dram) == 0


def test_an_unreadable_secret_fails_closed_for_its_tenant_only(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One secret the keyring cannot read (EIO) stops neither the watch's check of the others nor fails open: its
    tenant is not served while it stays unreadable (counted), and is again once it reads."""
    tokens = synthetic_tokens(23, 2 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path, refresh=60)) as store:
        store.put(ns("eio"), tokens, kv)  # checked first
        store.put(ns("gone"), tokens, kv)
        store.flush()
        keyring = Keyring(str(tmp_path / "keyring"))
        bad, real = keyring.tenant_id("eio"), Keyring.secret

        def flaky(self, tenant, create):
            if tenant == bad:
                raise OSError(5, "Input/output error")
            return real(self, tenant, create)

        monkeypatch.setattr(Keyring, "secret", flaky)
        keyring.forget(keyring.tenant_id("gone"))
        store._tenancy.sealer.check_forgotten()
        assert store.get(ns("gone"), tokens) is None  # the check went on past the unreadable secret
        assert store.get(ns("eio"), tokens) is None  # and did not keep serving the tenant it could not check
        assert store.stats()["_store"]["keyring_errors_total"] >= 1
        monkeypatch.undo()
        store.put(ns("eio"), tokens, kv)  # (what the tiers hold is taken as absent for a while: unopened)
        assert torch.equal(store.get(ns("eio"), tokens), kv)


@pytest.mark.parametrize("fault", ["secret missing", "short read", "keyring unmounted"])
def test_a_secret_missing_at_one_tick_and_back_unchanged_serves_its_tenant_again(tmp_path: Path, fault: str,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    """One watch tick that finds no secret (a keyring remount, a short read) must not disable the tenant for good:
    the secret read again, unchanged, is the same tenant (a real forget always makes a new secret), so its puts
    and reads are served again, from DRAM and from the tier."""
    tokens = synthetic_tokens(31, 2 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path, refresh=3600)) as store:  # no tick but ours
        store.put(ns("acme"), tokens, kv)
        store.flush()
        if fault == "secret missing":
            monkeypatch.setattr(Keyring, "secret", lambda self, tenant, create: None)
        elif fault == "short read":
            def short(self, tenant, create):
                raise KVTierError(f"keyring: {tenant} holds 7 bytes, not a 32-byte secret")
            monkeypatch.setattr(Keyring, "secret", short)
        else:
            monkeypatch.setattr(Keyring, "_read", lambda self, name: None)  # every file gone, the pepper too
        store._tenancy.sealer.check_forgotten()
        monkeypatch.undo()
        assert store.put(ns("acme"), tokens, kv) == 2 * T
        assert torch.equal(store.get(ns("acme"), tokens), kv)
        assert torch.equal(cold(store).get(ns("acme"), tokens), kv)
        if fault != "secret missing":  # the keyring could not say: counted, and no DRAM purge
            assert store.stats()["_store"]["keyring_errors_total"] == 1


def test_a_secret_read_before_a_forget_was_noticed_does_not_unmark_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a read begun after the watch marked a key id forgotten clears the mark: a put that read the secret
    just before the forget (and the watch's tick) ran stores nothing under the destroyed key."""
    tokens = synthetic_tokens(32, 2 * T)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(config(tmp_path, refresh=3600)) as store:
        sealer, real = store._tenancy.sealer, Keyring.secret
        armed = [True]

        def racing(self, tenant, create):
            value = real(self, tenant, create)
            if armed.pop() if armed else False:  # the put's read: then another thread's use, the forget, a tick
                sealer.register(store.named(ns("late")), create=False)
                self.forget(tenant)
                assert sealer.check_forgotten()
            return value

        monkeypatch.setattr(Keyring, "secret", racing)
        assert store.put(ns("late"), tokens, kv) == 0
        store.flush()
        assert store.get(ns("late"), tokens) is None and not objects(tmp_path)
