"""Names of stored KV: prefix-chained chunk and tail keys, namespaces, head ranges, model fingerprints; with
encryption, names keyed by the keyring (nothing in a tier confirms a guessed prompt; stable across a rekey)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from kvtier import KVStore, Namespace, chunk_keys, fingerprint_model
from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.keys import HeadRange, InputSpan, ShardKey, cover, tail_keys
from kvtier.sealing import write_key_file
from kvtier.testing import synthetic_kv, synthetic_tokens

NS = Namespace(model="m", dtype="bfloat16")


def test_keys_chain_the_whole_prefix() -> None:
    a = list(range(64))
    b = [999] + a[1:]  # differs only in the first token
    ka, kb = chunk_keys(NS, a, 16), chunk_keys(NS, b, 16)
    assert len(ka) == 4 and all(len(k) == 16 for k in ka)  # 128-bit keys
    assert all(x != y for x, y in zip(ka, kb))  # one changed token changes every later key
    assert chunk_keys(NS, a[:48], 16) == ka[:3]
    assert chunk_keys(NS, a[:47], 16) == ka[:2]  # a partial trailing chunk has no key


def test_same_chunk_after_different_prefix_has_another_key() -> None:
    x, y, z = [1] * 16, [2] * 16, [3] * 16
    assert chunk_keys(NS, x + z, 16)[1] != chunk_keys(NS, y + z, 16)[1]


def test_token_input_forms_agree() -> None:
    ids = list(range(100, 132))
    assert chunk_keys(NS, ids, 16) == chunk_keys(NS, torch.tensor(ids), 16) == chunk_keys(
        NS, torch.tensor(ids, dtype=torch.int32).numpy(), 16)


def test_namespace_fields_all_reach_the_digest() -> None:
    base = Namespace(model="m", dtype="bfloat16", lora=None, cache_salt=None)
    variants = [Namespace(model="m2", dtype="bfloat16"), Namespace(model="m", dtype="float16"),
                Namespace(model="m", dtype="bfloat16", lora="x"), Namespace(model="m", dtype="bfloat16",
                                                                           cache_salt="s"),
                Namespace(model="m", dtype="bfloat16", layout_version=2)]
    digests = {base.digest} | {v.digest for v in variants}
    assert len(digests) == 6
    assert Namespace(model="m", dtype=torch.bfloat16) == base


def test_settings_reach_the_digest_and_old_namespaces_keep_their_ids() -> None:
    assert Namespace(model="m", dtype="bfloat16", settings="kv:fp8").id != NS.id
    # The id of a namespace without settings is what it was before the field existed: its stored KV stays.
    assert NS.id == "d2cdc8b436f62ce8eec92e8d1097825e"


def test_inputs_name_the_chunks_they_cover_and_every_later_one() -> None:
    tokens = [7] * 64  # placeholder ids: the same for every image
    a = Namespace(model="m", dtype="bfloat16", inputs=(InputSpan(20, 10, "image-a"),))
    b = Namespace(model="m", dtype="bfloat16", inputs=(InputSpan(20, 10, "image-b"),))
    moved = Namespace(model="m", dtype="bfloat16", inputs=(InputSpan(21, 9, "image-a"),))
    ka, kb, km, plain = (chunk_keys(ns, tokens, 16) for ns in (a, b, moved, NS))
    assert ka[0] == kb[0] == km[0] == plain[0]  # the chunk before the image is the same KV
    assert all(len({x, y, z, w}) == 4 for x, y, z, w in zip(ka[1:], kb[1:], km[1:], plain[1:]))
    assert a.id == NS.id  # one namespace in the tiers: text prefixes are shared across images
    assert Namespace(model="m", dtype="bfloat16", inputs=[(20, 10, "image-a")]) == a
    assert a.describe()["inputs"] == 1 and "image-a" not in str(a.describe())


def test_a_tail_has_a_key_of_its_own() -> None:
    """A tail's key names its parent, its length, its tokens and the inputs over it: never a whole chunk's key,
    nor a shorter tail's, nor one after another prefix."""
    ns = Namespace(model="m", dtype="bfloat16")
    tokens = list(range(100, 140))  # 2 chunks of 16 and 8 tokens more
    keys = chunk_keys(ns, tokens, 16, tail=True)
    assert keys[:2] == chunk_keys(ns, tokens, 16) and len(keys) == 3
    assert keys[2] == tail_keys(ns, keys[1], tokens[32:], 32, [8])[0]
    tails = tail_keys(ns, keys[1], tokens[32:], 32, [8, 4, 1])
    assert len(set(tails)) == 3 and keys[2] == tails[0]
    assert tail_keys(ns, keys[0], tokens[32:], 32, [8])[0] != keys[2]  # another parent
    assert tail_keys(ns, ns.digest, tokens[:16], 0, [15]) [0] not in chunk_keys(ns, tokens, 16)
    assert chunk_keys(ns, tokens[:32], 16, tail=True) == keys[:2]  # no tokens after the chunks: no tail
    image = Namespace(model="m", dtype="bfloat16", inputs=(InputSpan(36, 10, "img"),))
    assert chunk_keys(image, tokens, 16, tail=True)[:2] == keys[:2]  # the image starts in the tail
    assert chunk_keys(image, tokens, 16, tail=True)[2] != keys[2]
    assert tail_keys(image, keys[1], tokens[32:], 32, [4]) == tail_keys(ns, keys[1], tokens[32:], 32, [4])
    with pytest.raises(ValueError, match=r"tail lengths must be in \[1, 8\], got \[9\]"):
        tail_keys(ns, keys[1], tokens[32:], 32, [9])


def test_namespace_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="model"):
        Namespace(model="", dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        Namespace(model="m", dtype="")
    with pytest.raises(ValueError, match="inputs"):
        Namespace(model="m", dtype="bf16", inputs=(InputSpan(0, 0, "x"),))


def test_describe_hides_the_salt() -> None:
    assert Namespace(model="m", dtype="bf16", cache_salt="tenant-secret").describe()["cache_salt"] == "<set>"


def test_fingerprint_changes_with_any_weight_or_config(tmp_path: Path) -> None:
    config = {"hidden_size": 8, "num_layers": 2}
    weights = {"w": torch.ones(4, 4, dtype=torch.bfloat16), "b": torch.zeros(4)}
    fp = fingerprint_model(config, weights)
    assert fp == fingerprint_model(dict(config), {k: v.clone() for k, v in weights.items()})
    bumped = {k: v.clone() for k, v in weights.items()}
    bumped["w"][3, 3] = 1.0078125  # one bf16 ulp
    assert fingerprint_model(config, bumped) != fp
    assert fingerprint_model({**config, "num_layers": 3}, weights) != fp
    with pytest.raises(ValueError, match="state_dict"):
        fingerprint_model(config)


def test_fingerprint_of_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"\x01" * 1000)
    (tmp_path / "README.md").write_text("ignored")
    fp = fingerprint_model(tmp_path)
    (tmp_path / "README.md").write_text("changed, still ignored")
    assert fingerprint_model(tmp_path) == fp
    (tmp_path / "model.safetensors").write_bytes(b"\x01" * 999 + b"\x02")
    assert fingerprint_model(tmp_path) != fp
    with pytest.raises(ValueError, match="no weight files"):
        fingerprint_model(_empty_dir(tmp_path))


def _empty_dir(tmp_path: Path) -> Path:
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_cover_picks_pieces_across_degrees() -> None:
    r = [HeadRange(0, 2, 8), HeadRange(2, 4, 8), HeadRange(0, 8, 8)]
    assert cover(r, 2, 6) == [(HeadRange(0, 8, 8), 2, 6)]
    assert cover([HeadRange(0, 2, 8), HeadRange(2, 4, 8)], 1, 4) == [
        (HeadRange(0, 2, 8), 1, 2), (HeadRange(2, 4, 8), 2, 4)]
    assert cover([HeadRange(0, 2, 8)], 0, 4) is None
    assert HeadRange.parse("2-4of8") == HeadRange(2, 4, 8)
    with pytest.raises(ValueError):
        HeadRange.parse("4-2of8")


# -- keyed names (encryption on): a tier's contents confirm no guessed prompt -------------------------------------
NAME_KEY = bytes(range(32))


def _unkeyed_child(parent: bytes, tokens: list[int]) -> bytes:
    """What anyone can compute from a chunk's name shown in a tier: its child's name, were names unkeyed."""
    h = hashlib.blake2b(parent, digest_size=16, person=b"kvtier-chunk")
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


def test_a_keyed_namespace_names_nothing_checkable_without_its_key() -> None:
    tokens = list(range(48))
    plain, keyed = chunk_keys(NS, tokens, 16), chunk_keys(NS.keyed(NAME_KEY), tokens, 16)
    # Unkeyed, a shown name extends to the next chunk's for a guessed prompt: the attack the key defeats.
    assert _unkeyed_child(plain[0], tokens[16:32]) == plain[1]
    assert _unkeyed_child(keyed[0], tokens[16:32]) != keyed[1]
    assert not set(plain) & set(keyed) and NS.keyed(NAME_KEY).id != NS.id
    other = NS.keyed(bytes(32))
    assert other.id != NS.keyed(NAME_KEY).id and chunk_keys(other, tokens, 16)[0] != keyed[0]
    tail = chunk_keys(NS.keyed(NAME_KEY), tokens[:40], 16, tail=True)[2]
    assert tail != chunk_keys(NS, tokens[:40], 16, tail=True)[2]
    assert NS.keyed(NAME_KEY).keyed(NAME_KEY) == NS.keyed(NAME_KEY) != NS  # two names, two namespaces
    assert NS.keyed(NAME_KEY).keyed(b"") == NS
    assert NAME_KEY.hex() not in repr(NS.keyed(NAME_KEY)) and "name_key" not in NS.keyed(NAME_KEY).describe()
    with pytest.raises(ValueError, match="name_key must be 16 to 64 bytes"):
        NS.keyed(b"short")


def _sealed(tmp_path: Path, key: str = "k1", old: tuple[str, ...] = ()) -> dict:
    def source(name: str) -> str:
        if not (tmp_path / name).exists():
            write_key_file(str(tmp_path / name))
        return f"file:{tmp_path / name}"

    return {"chunk_tokens": 16, "dram": {"capacity_bytes": "8MiB", "page_bytes": "16KiB"},
            "tiers": [{"type": "filesystem", "name": "disk", "path": str(tmp_path / "disk"), "queue_depth": 4096}],
            "encryption": {"key": source(key), "old_keys": [source(k) for k in old],
                           "keyring": str(tmp_path / "keyring")}}


def _names(store: KVStore) -> set[ShardKey]:
    return {o.key for o in store.tiers[0].list()}


def test_with_encryption_a_tier_shows_keyed_names_that_every_store_of_the_keyring_computes(tmp_path: Path) -> None:
    tenant = Namespace(model="m", dtype="bfloat16", cache_salt="tenant-a")
    tokens = synthetic_tokens(1, 40)  # two chunks and a tail
    kv = synthetic_kv(tokens[:32])
    with KVStore.from_config(_sealed(tmp_path)) as a:
        a.put(tenant, tokens[:32], kv)
        a.flush()
        stored = _names(a)
        assert {k.namespace for k in stored} == {a.named(tenant).id} and tenant.id != a.named(tenant).id
    unkeyed = {k.hex() for k in chunk_keys(tenant, tokens, 16, tail=True)}
    assert len(stored) == 2 and not {k.chunk for k in stored} & unkeyed
    assert not any(tenant.id in str(p) or name in str(p) for p in (tmp_path / "disk").rglob("*") for name in unkeyed)
    # Nor does a shown name extend to its child's for the prompt's next tokens.
    assert not {_unkeyed_child(bytes.fromhex(k.chunk), tokens[16:32]).hex() for k in stored} & {k.chunk for k in stored}
    # Another engine of the deployment (its own sealer, sharing only the keyring directory) finds the same names.
    with KVStore.from_config(_sealed(tmp_path)) as b:
        assert b.lookup(tenant, tokens) == 32
        assert torch.equal(b.get(tenant, tokens[:32]), kv)
        assert b.stats()["disk"]["hit_chunks_total"] == 2
    # A deployment with its own keyring names the same prompt otherwise: the names come from the keyring.
    (tmp_path / "other").mkdir()
    elsewhere = _sealed(tmp_path / "other")
    with KVStore.from_config(elsewhere) as c:
        assert c.named(tenant).id != tenant.id and c.named(tenant).id not in {k.namespace for k in stored}


def test_a_master_key_rotation_keeps_every_name(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tenant = Namespace(model="m", dtype="bfloat16", cache_salt="tenant-a")
    tokens = synthetic_tokens(2, 48)
    kv = synthetic_kv(tokens)
    with KVStore.from_config(_sealed(tmp_path)) as store:
        store.put(tenant, tokens, kv)
        store.flush()
        before = _names(store)
    rotated = tmp_path / "rotated.yaml"
    rotated.write_text(yaml.safe_dump(_sealed(tmp_path, key="k2", old=("k1",))))
    assert main(["cache", "rekey", "--config", str(rotated)]) == 0
    assert "3 re-sealed" in capsys.readouterr().out
    with KVStore.from_config(_sealed(tmp_path, key="k2")) as store:  # the old master key retired
        assert _names(store) == before
        assert torch.equal(store.get(tenant, tokens), kv)
        assert store.stats()["disk"]["hit_chunks_total"] == 3


def test_without_encryption_names_stay_unkeyed(tmp_path: Path) -> None:
    tokens = synthetic_tokens(3, 32)
    cfg = {"chunk_tokens": 16, "dram": {"capacity_bytes": "8MiB", "page_bytes": "16KiB"},
           "tiers": [{"type": "filesystem", "name": "disk", "path": str(tmp_path / "disk")}]}
    with KVStore.from_config(cfg) as store:
        assert store.named(NS) is NS
        store.put(NS, tokens, synthetic_kv(tokens))
        store.flush()
        assert {(k.namespace, k.chunk) for k in _names(store)} == {(NS.id, k.hex()) for k in chunk_keys(NS, tokens, 16)}


@pytest.mark.parametrize("left", ["secret", "tombstone"])
def test_a_keyring_that_lost_its_pepper_is_refused_and_engines_log_one_naming_fingerprint(
        tmp_path: Path, left: str, caplog: pytest.LogCaptureFixture) -> None:
    """An engine that made a new pepper beside tenants' files would name every chunk, tenant and secret otherwise
    than its peers (silent misses); it refuses to start, naming the field. Engines log a short fingerprint of
    the naming key (never the key) for operators to compare."""
    tenant = Namespace(model="m", dtype="bfloat16", cache_salt="tenant-a")
    tokens = synthetic_tokens(3, 16)
    fingerprints = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level("INFO", logger="kvtier.sealing"), KVStore.from_config(_sealed(tmp_path)) as store:
            store.put(tenant, tokens, synthetic_kv(tokens))
            key = store._tenancy.name_key
        (line,) = [r.getMessage() for r in caplog.records if "naming key fingerprint" in r.getMessage()]
        assert key.hex() not in line and key.hex()[:8] not in line
        fingerprints.append(line.rsplit(" ", 1)[-1])
    assert fingerprints[0] == fingerprints[1] and len(fingerprints[0]) == 8
    keyring = tmp_path / "keyring"
    if left == "tombstone":  # a forgotten tenant's trace alone
        for path in keyring.glob("t-*"):
            if "." in path.name:
                path.unlink()
            else:
                path.rename(keyring / f"{path.name}.forgotten")
    (keyring / "pepper").unlink()
    with pytest.raises(ConfigError, match=r"encryption\.keyring: .* holds tenants' files but no pepper"):
        KVStore.from_config(_sealed(tmp_path))
    assert not (keyring / "pepper").exists()


def test_named_chunks_are_keyed_by_name_under_the_namespace() -> None:
    """Chunks an engine names itself (vLLM's offload keys): each name's key depends on the namespace (and its naming
    key) and on nothing else; no tails, no inputs; the length counts chunk_tokens a name."""
    from kvtier.keys import NamedChunks

    names = [b"a" * 36, b"b" * 36]
    chunks = NamedChunks(names, 16)
    assert len(chunks) == 32
    keys = chunk_keys(NS, chunks, 16)
    assert len(keys) == 2 and keys[0] != keys[1] and all(len(k) == 16 for k in keys)
    assert chunk_keys(NS, NamedChunks(names[1:], 16), 16) == keys[1:]  # no chain: each stands alone
    assert chunk_keys(Namespace(model="other", dtype="bfloat16"), chunks, 16) != keys
    assert chunk_keys(NS.keyed(b"k" * 32), chunks, 16) != keys  # keyed names: a tier's names confirm nothing
    assert keys[0] not in chunk_keys(NS, list(range(16)), 16)
    with pytest.raises(ValueError, match="named chunks of 16 tokens"):
        chunk_keys(NS, chunks, 32)
    with pytest.raises(ValueError, match="no tails"):
        chunk_keys(NS, chunks, 16, tail=True)
    with pytest.raises(ValueError, match="no Namespace.inputs"):
        chunk_keys(Namespace(model="m", dtype="bfloat16", inputs=(InputSpan(0, 4, "img"),)), chunks, 16)
    with pytest.raises(ValueError, match="non-empty bytes"):
        NamedChunks([b""], 16)
