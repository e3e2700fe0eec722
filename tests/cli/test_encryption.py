"""The encryption key commands (:mod:`kvtier.cli.encryption`) against what runs beside them: a forget removes
what an engine wrote during its wait, a rekey never writes back an object deleted while it ran, the tenant of
requests without a salt can be forgotten, and a repeated forget is told apart from a mistyped salt."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import yaml

from kvtier import KVStore, codecs
from kvtier.cli import encryption, main
from kvtier.config import load_config
from kvtier.sealing import Keyring, Sealer
from kvtier.store import open_tiers
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.test_sealing import T, config, ns, objects


def written(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_forget_removes_what_an_engine_wrote_during_its_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys) -> None:
    """An engine that has not noticed the forget yet (its watch ticks every minute here) writes more of the
    tenant's KV while the forget waits: the forget lists the tiers after its wait and removes that too."""
    tokens, later = synthetic_tokens(30, 2 * T), synthetic_tokens(31, 2 * T)
    cfg = config(tmp_path, refresh=60)
    path = written(tmp_path, cfg)
    with KVStore.from_config(cfg) as engine:
        engine.put(ns("kept"), tokens, synthetic_kv(tokens))
        engine.flush()
        kept = {namespace(p) for p in objects(tmp_path)}
        engine.put(ns("w"), tokens, synthetic_kv(tokens))
        engine.flush()

        def during_the_wait(seconds: float) -> None:
            engine.put(ns("w"), later, synthetic_kv(later))
            engine.flush()

        monkeypatch.setattr(encryption, "time", types.SimpleNamespace(sleep=during_the_wait))
        assert main(["tenant", "forget", "w", "--config", path]) == 0
        assert "removed 4 objects" in capsys.readouterr().out
    assert len(objects(tmp_path)) == 2 and {namespace(p) for p in objects(tmp_path)} == kept


def namespace(path: Path) -> str:
    """The namespace id of a filesystem tier's object file (ROOT/<namespace>/<chunk[:2]>/<file>)."""
    return path.parent.parent.name


def test_rekey_never_writes_back_an_object_deleted_while_it_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys) -> None:
    """A purge (here another process's delete) lands between rekey's read of an object and its write: the object
    stays deleted."""
    tokens = synthetic_tokens(32, 2 * T)
    with KVStore.from_config(config(tmp_path, key="k1")) as store:
        store.put(ns("a"), tokens, synthetic_kv(tokens))
    cfg = config(tmp_path, key="k2", old=("k1",))
    (purger,) = open_tiers(load_config(cfg))  # its own index of the directory, as another process has
    real_seal, deleted = Sealer.seal, []

    def purged_meanwhile(self, key, meta, payload, created=None, codec=codecs.NONE):
        if not deleted:
            deleted.append(key)
            assert purger.delete(key)
        return real_seal(self, key, meta, payload, created, codec)

    monkeypatch.setattr(Sealer, "seal", purged_meanwhile)
    try:
        assert main(["cache", "rekey", "--config", written(tmp_path, cfg)]) == 0
    finally:
        purger.close()
    out = capsys.readouterr().out
    assert "1 re-sealed, 0 already under the current key" in out and "1 gone or replaced during the walk" in out
    assert len(objects(tmp_path)) == 1
    assert not list(tmp_path.joinpath("disk").rglob(f"{deleted[0].chunk}*"))


def test_the_tenant_without_a_salt_can_be_forgotten(tmp_path: Path, capsys) -> None:
    tokens = synthetic_tokens(33, 2 * T)
    kv = synthetic_kv(tokens)
    cfg = config(tmp_path, refresh=0.05)
    path = written(tmp_path, cfg)
    with KVStore.from_config(cfg) as engine:
        engine.put(ns(None), tokens, kv)
        engine.put(ns(""), tokens, kv)  # an empty salt is a tenant of its own
        engine.flush()
        assert main(["tenant", "forget", "--unsalted", "--config", path]) == 0
        assert "removed 2 objects" in capsys.readouterr().out
        assert engine.get(ns(None), tokens) is None
        assert torch.equal(engine.get(ns(""), tokens), kv)
    for argv in (["tenant", "forget", "--config", path], ["tenant", "forget", "x", "--unsalted", "--config", path]):
        assert main(argv) == 2
        assert "or --unsalted" in capsys.readouterr().err


def test_a_repeated_forget_and_a_mistyped_salt_say_different_things(tmp_path: Path, capsys) -> None:
    tokens = synthetic_tokens(34, T)
    cfg = config(tmp_path)
    path = written(tmp_path, cfg)
    with KVStore.from_config(cfg) as engine:
        engine.put(ns("tenant-1"), tokens, synthetic_kv(tokens))
    assert main(["tenant", "forget", "tenant-1", "--config", path]) == 0
    capsys.readouterr()
    assert main(["tenant", "forget", "tenant-1", "--config", path]) == 0  # done already: nothing to do
    assert "forgotten already" in capsys.readouterr().out
    assert main(["tenant", "forget", "tenant-l", "--config", path]) == 1  # a typo
    assert "never seen in this keyring" in capsys.readouterr().out
    keyring = Keyring(str(tmp_path / "keyring"))
    assert keyring.forgotten_at(keyring.tenant_id("tenant-1")) is not None
    assert keyring.forgotten_at(keyring.tenant_id("tenant-l")) is None
