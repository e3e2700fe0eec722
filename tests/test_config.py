from __future__ import annotations

from pathlib import Path

import pytest

from kvtier import ConfigError, KVStore, load_config
from kvtier.config import parse_size


def test_defaults_and_sizes() -> None:
    cfg = load_config({"dram": {"capacity_bytes": "1.5GiB"}})
    assert cfg.chunk_tokens == 256 and cfg.dram.capacity_bytes == 1536 * 2**20 and cfg.tiers == ()
    assert parse_size("4GB", "x") == 4 * 10**9 and parse_size(1024, "x") == 1024


@pytest.mark.parametrize(("cfg", "message"), [
    ({"chunk_size": 256}, r"chunk_size: unknown key; allowed: chunk_tokens, dram, tiers, metrics_port"),
    ({"chunk_tokens": "big"}, r"chunk_tokens: expected int"),
    ({"chunk_tokens": 0}, r"chunk_tokens: must be a positive integer"),
    ({"chunk_tokens": True}, r"chunk_tokens: expected int"),
    ({"dram": {"capacity_bytes": "lots"}}, r"dram.capacity_bytes: expected a byte size"),
    ({"dram": {"eviction": 3}}, r"dram.eviction: expected str"),
    ({"dram": {"size": 1}}, r"dram.size: unknown key; allowed: capacity_bytes, eviction, page_bytes, pin_memory"),
    ({"dram": {"capacity_bytes": 100}}, r"dram.capacity_bytes: must be at least page_bytes"),
    ({"tiers": {"type": "filesystem"}}, r"tiers: expected a list"),
    ({"tiers": [{"path": "/x"}]}, r"tiers\[0\].type: required"),
    ({"tiers": [{"type": "filesystem"}]}, r"tiers\[0\].path: required"),
    ({"tiers": [{"type": "tape", "path": "/x"}]}, r"tiers\[0\].type: unknown tier type 'tape'; known: filesystem"),
    ({"tiers": [{"type": "filesystem", "path": "/x", "queue_depth": 0}]}, r"tiers\[0\].queue_depth: must be >= 1"),
    ({"tiers": [{"type": "filesystem", "path": "/x", "retry_seconds": -1}]},
     r"tiers\[0\].retry_seconds: must be >= 0"),
    ({"tiers": [{"type": "redis", "url": "memcached://x"}]}, r"tiers\[0\].url: expected a redis://"),
    ({"tiers": [{"type": "filesystem", "path": "/a"}, {"type": "filesystem", "path": "/b"}]},
     r"tiers\[1\].name: tier name 'filesystem' is used twice"),
    ({"tiers": [{"type": "no.such.module:Tier", "path": "/x"}]}, r"tiers\[0\].type: cannot load tier type plugin"),
    ({"dram": {"eviction": "mru"}}, r"dram.eviction: unknown eviction policy 'mru'; known: lru, prefix_lru"),
    ({"metrics_port": "9000"}, r"metrics_port: expected int or null"),
])
def test_bad_config_names_field_and_allowed_values(cfg: dict, message: str, tmp_path: Path) -> None:
    for tier in cfg.get("tiers", []) if isinstance(cfg.get("tiers"), list) else []:
        if "path" in tier:
            tier["path"] = str(tmp_path / tier["path"].strip("/"))
    with pytest.raises(ConfigError, match=message):
        KVStore.from_config(cfg).close()


def test_yaml_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"""
chunk_tokens: 32
dram:
  capacity_bytes: 8MiB
  eviction: prefix_lru
tiers:
  - type: filesystem
    name: nvme
    path: {tmp_path / 'fs'}
    capacity_bytes: 1GiB
    ttl_seconds: 86400
""")
    with KVStore.from_config(path) as store:
        assert store.chunk_tokens == 32 and [t.name for t in store.tiers] == ["nvme"]
    monkeypatch.setenv("KVTIER_CONFIG", str(path))
    with KVStore.from_config() as store:
        assert store.tiers[0].options.ttl_seconds == 86400.0
    monkeypatch.delenv("KVTIER_CONFIG")
    with pytest.raises(ConfigError, match="KVTIER_CONFIG"):
        KVStore.from_config()
    (tmp_path / "bad.yaml").write_text("tiers: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
