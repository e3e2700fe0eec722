"""``kvtier cache`` (:mod:`kvtier.cli.cache`): stats, ls, verify, purge on the filesystem and the shared tiers;
errors and namespace ids refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from kvtier import KVStore, frame
from kvtier.cli import main
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.units import size_fixed
from tests.cli.conftest import OTHER, T, put_three_prompts
from tests.conftest import store_config


def test_stats(config: Path, capsys) -> None:
    assert main(["cache", "stats", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "objects:    7" in out and "namespaces: 2" in out


def test_ls_shows_keys_not_tokens(config: Path, capsys) -> None:
    assert main(["cache", "ls", "--config", str(config), "--namespace", OTHER.id]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and OTHER.id in lines[1] and "0-4of4" in lines[1]


def test_stats_and_ls_show_each_objects_codec_and_the_bytes_saved(tmp_path: Path, capsys) -> None:
    """Objects of two codecs in one tier (its codec changed from fp8 to none between two stores), and one whose header
    is damaged: each counted under its codec, the bytes before the codec beside those stored."""
    cfg = store_config(tmp_path / "fs", codec="fp8")
    with KVStore.from_config(cfg) as store:
        put_three_prompts(store)  # six shards, fp8
    with KVStore.from_config(store_config(tmp_path / "fs")) as store:
        tokens = synthetic_tokens(99, T)
        store.put(OTHER, tokens, synthetic_kv(tokens))  # one shard, none
    files = sorted((tmp_path / "fs").rglob("*.kv"))
    fp8 = [f for f in files if OTHER.id not in str(f)]
    raw = frame.decode_header(fp8[0].read_bytes()).meta.nbytes
    stored = fp8[0].stat().st_size - frame.HEADER_LEN
    damaged = bytearray(fp8[0].read_bytes())
    damaged[10] ^= 1  # its header's checksum fails
    fp8[0].write_bytes(damaged)
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["cache", "stats", "--config", str(path), "--codecs"]) == 0
    out = capsys.readouterr().out
    assert f"codec fp8: 5 objects, {size_fixed(5 * (frame.HEADER_LEN + stored))} stored of " \
           f"{size_fixed(5 * (frame.HEADER_LEN + raw))}, {size_fixed(5 * (raw - stored))} saved" in out
    assert "codec none: 1 objects" in out and "saved" not in out.split("codec none")[1].splitlines()[0]
    assert "codec unreadable: 1 objects" in out
    assert main(["cache", "stats", "--config", str(path)]) == 0
    assert "codec" not in capsys.readouterr().out  # (headers are read only when asked)
    assert main(["cache", "ls", "--config", str(path), "--codecs"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[-2:] == ["codec", "raw"]
    assert sorted(line.split()[-3] for line in lines[1:]) == ["fp8"] * 5 + ["none", "unreadable"]  # (sizes: "2.6 KiB")


def test_verify_decodes_objects_stored_with_a_codec(tmp_path: Path, capsys) -> None:
    """A lossless object whose checksum is right but whose stream does not decode is bad; one of a codec this
    release does not know is left."""
    import xxhash

    cfg = store_config(tmp_path / "fs", codec="lossless")
    with KVStore.from_config(cfg) as store:
        put_three_prompts(store)
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["cache", "verify", "--config", str(path)]) == 0
    assert "6 ok, 0 bad" in capsys.readouterr().out
    first, second = sorted((tmp_path / "fs").rglob("*.kv"))[:2]
    blob = bytearray(first.read_bytes())
    header = frame.decode_header(blob)
    stream = blob[frame.HEADER_LEN + 4 * header.meta.num_layers:]
    stream[4:8] = bytes(4)  # inside the first layer's zstd frame header
    blob[frame.HEADER_LEN + 4 * header.meta.num_layers:] = stream
    body = bytearray(blob[:frame.HEADER_LEN - 8])
    body[16:32] = frame.checksum([memoryview(blob)[frame.HEADER_LEN:]])  # its checksum made right again
    blob[:frame.HEADER_LEN] = bytes(body) + xxhash.xxh3_64_intdigest(bytes(body)).to_bytes(8, "little")
    first.write_bytes(blob)
    later = bytearray(second.read_bytes())
    body = bytearray(later[:frame.HEADER_LEN - 8])
    body[4 + 2 + 2 + 8 + 16 + 16 + 16 + 6 + 2 + 4 + 2 + 1] = 77  # a codec code no release knows yet
    later[:frame.HEADER_LEN] = bytes(body) + xxhash.xxh3_64_intdigest(bytes(body)).to_bytes(8, "little")
    second.write_bytes(later)
    assert main(["cache", "verify", "--config", str(path), "--repair"]) == 0
    out = capsys.readouterr().out
    assert "4 ok, 1 bad (removed)" in out and "1 under keys this config lacks or of codecs" in out
    assert "lossless: layer 0" in out  # its stream, not its checksum (that was made right)
    assert not first.exists() and second.exists()


def test_verify_finds_and_repairs_damage(config: Path, tmp_path: Path, capsys) -> None:
    assert main(["cache", "verify", "--config", str(config)]) == 0
    assert "7 ok, 0 bad" in capsys.readouterr().out
    victim = sorted((tmp_path / "fs").rglob("*.kv"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(data)
    assert main(["cache", "verify", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "6 ok, 1 bad" in out and "payload checksum mismatch" in out
    assert victim.exists()
    assert main(["cache", "verify", "--config", str(config), "--repair"]) == 0
    assert not victim.exists()
    assert main(["cache", "verify", "--config", str(config)]) == 0


def test_purge_by_namespace_age_and_all(config: Path, tmp_path: Path, capsys) -> None:
    assert main(["cache", "purge", "--config", str(config), "--namespace", OTHER.id]) == 0
    assert "removed 1 objects" in capsys.readouterr().out
    assert main(["cache", "purge", "--config", str(config), "--older-than", "1h"]) == 0
    assert "removed 0 objects" in capsys.readouterr().out
    time.sleep(1.1)
    assert main(["cache", "purge", "--config", str(config), "--older-than", "1s"]) == 0
    assert "removed 6 objects" in capsys.readouterr().out
    assert not list((tmp_path / "fs").rglob("*.kv"))
    assert main(["cache", "purge", "--config", str(config), "--all"]) == 0


def test_errors_are_clear(config: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{type: tape}]")
    assert main(["cache", "stats", "--config", str(bad)]) == 2
    assert "tiers[0].type: unknown tier type 'tape'" in capsys.readouterr().err
    assert main(["cache", "stats", "--config", str(config), "--tier", "nope"]) == 2
    assert "no tier named 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cache", "purge", "--config", str(config), "--older-than", "soon"])


@pytest.mark.parametrize("server", ["redis_server", "s3_server", "mooncake_server"])
def test_cache_commands_on_shared_tiers(server: str, tmp_path: Path, unique_prefix: str, capsys,
                                        request: pytest.FixtureRequest) -> None:
    srv = request.getfixturevalue(server)
    kind, prefix_key = {"redis_server": ("redis", "key_prefix"), "s3_server": ("s3", "prefix"),
                        "mooncake_server": ("mooncake", "key_prefix")}[server]
    tier = {"type": kind, **srv.tier_options(), prefix_key: unique_prefix}
    cfg = {"chunk_tokens": T, "dram": {"capacity_bytes": "8MiB", "page_bytes": "16KiB"}, "tiers": [tier]}
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with KVStore.from_config(cfg) as store:
        put_three_prompts(store)
    assert main(["cache", "stats", "--config", str(path)]) == 0
    assert "objects:    6" in capsys.readouterr().out
    assert main(["cache", "verify", "--config", str(path)]) == 0
    assert "6 ok, 0 bad" in capsys.readouterr().out
    assert main(["cache", "purge", "--config", str(path), "--all"]) == 0
    capsys.readouterr()
    assert main(["cache", "stats", "--config", str(path)]) == 0
    assert "objects:    0" in capsys.readouterr().out


@pytest.mark.parametrize("namespace", ["", "*", "a*", OTHER.id[:31], OTHER.id + "0", "g" * 32])
def test_namespace_must_be_a_namespace_id(config: Path, namespace: str, capsys) -> None:
    """An empty id or a glob would widen a purge to every namespace."""
    for command in ("purge", "ls"):
        with pytest.raises(SystemExit) as exit_info:
            main(["cache", command, "--config", str(config), "--namespace", namespace])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "argument --namespace: expected a namespace id: 32 hex digits" in err, err
    assert len(list((config.parent / "fs").rglob("*.kv"))) == 7  # nothing was purged


def test_namespace_id_in_capitals_is_the_same_id(config: Path, capsys) -> None:
    assert main(["cache", "ls", "--config", str(config), "--namespace", OTHER.id.upper()]) == 0
    assert OTHER.id in capsys.readouterr().out


def test_purge_all_leaves_a_deployment_with_a_longer_prefix(redis_server, tmp_path: Path, unique_prefix: str,
                                                           capsys) -> None:
    """``key_prefix: P`` and ``key_prefix: P + "staging:"`` on one server: purging P leaves staging's keys."""
    paths = {}
    for name, prefix in (("prod", unique_prefix), ("staging", unique_prefix + "staging:")):
        cfg = {"chunk_tokens": T, "dram": {"capacity_bytes": "8MiB", "page_bytes": "16KiB"},
               "tiers": [{"type": "redis", **redis_server.tier_options(), "key_prefix": prefix}]}
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg))
        with KVStore.from_config(cfg) as store:
            put_three_prompts(store)
    assert main(["cache", "purge", "--config", str(paths["prod"]), "--all"]) == 0
    assert "removed 6 objects" in capsys.readouterr().out
    assert main(["cache", "stats", "--config", str(paths["staging"])]) == 0
    assert "objects:    6" in capsys.readouterr().out
