from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier import Namespace, chunk_keys, fingerprint_model
from kvtier.keys import HeadRange, InputSpan, cover, tail_keys

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
