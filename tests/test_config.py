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
    ({"chunk_tokens": 0}, r"chunk_tokens: must be an integer in \[1, 1048576\]"),
    ({"chunk_tokens": True}, r"chunk_tokens: expected int"),
    ({"dram": {"capacity_bytes": "lots"}}, r"dram.capacity_bytes: expected a byte size"),
    ({"dram": {"eviction": 3}}, r"dram.eviction: expected str"),
    ({"dram": {"size": 1}}, r"dram.size: unknown key; allowed: capacity_bytes, eviction, page_bytes, pin_memory"),
    ({"dram": {"capacity_bytes": 100}}, r"dram.capacity_bytes: must be at least page_bytes"),
    ({"tiers": {"type": "filesystem"}}, r"tiers: expected a list"),
    ({"tiers": [{"path": "/x"}]}, r"tiers\[0\].type: required"),
    ({"tiers": [{"type": "filesystem"}]}, r"tiers\[0\].path: required"),
    ({"tiers": [{"type": "tape", "path": "/x"}]}, r"tiers\[0\].type: unknown tier type 'tape'; known: filesystem"),
    ({"tiers": [{"type": "filesystem", "path": "/x", "queue_depth": 0}]}, r"tiers\[0\].queue_depth: must be in \[1, "),
    ({"tiers": [{"type": "filesystem", "path": "/x", "queue_bytes": 0}]}, r"tiers\[0\].queue_bytes: must be positive"),
    ({"tiers": [{"type": "filesystem", "path": "/x", "workers": 10**6}]}, r"tiers\[0\].workers: must be in \[1, 64\]"),
    ({"tiers": [{"type": "filesystem", "path": "/x", "retry_seconds": float("inf")}]},
     r"tiers\[0\].retry_seconds: must be a finite number"),
    ({"tiers": [{"type": "filesystem", "path": "/x", "retry_seconds": float("nan")}]},
     r"tiers\[0\].retry_seconds: must be a finite number"),
    ({"tiers": [{"type": "filesystem", "path": "/x", "name": "a/b"}]}, r"tiers\[0\].name: 1-64 letters"),
    ({"tiers": [{"type": "kvtier.keys:Namespace", "path": "/x"}]},
     r"tiers\[0\].type: plugin 'kvtier.keys:Namespace' is .*not a concrete subclass of kvtier.tiers.base.Tier"),
    ({"tiers": [{"type": "kvtier.keys:chunk_keys", "path": "/x"}]},
     r"tiers\[0\].type: plugin .* not a concrete subclass"),
    ({"dram": {"eviction": "kvtier.tiers.base:Tier"}}, r"dram.eviction: plugin .* not a concrete subclass of .*Policy"),
    ({"dram": {"eviction": "kvtier.eviction:EvictionPolicy"}}, r"dram.eviction: plugin .* not a concrete subclass"),
    ({"tiers": [{"type": "kvtier.tiers.base:Tier", "path": "/x"}]}, r"tiers\[0\].type: plugin .* not a concrete"),
    ({"tiers": [{"type": "kvtier.no_such:Tier", "path": "/x"}]}, r"tiers\[0\].type: cannot load tier type plugin"),
    ({"dram": {"capacity_bytes": "64TiB"}}, r"dram.capacity_bytes: .* more than the memory available now"),
    ({"metrics_port": 70000}, r"metrics_port: must be a TCP port in \[1, 65535\]"),
    ({"metrics_port": 0}, r"metrics_port: must be a TCP port"),
    ({"metrics_host": "a b"}, r"metrics_host: an address to serve metrics on"),
    ({"metrics_host": 0}, r"metrics_host: an address to serve metrics on"),
    ({"otlp_traces_endpoint": "collector:4318"}, r"otlp_traces_endpoint: expected an OTLP/HTTP URL"),
    ({"otlp_traces_endpoint": "http://c:99999/v1/traces"}, r"otlp_traces_endpoint"),
    ({"tiers": [{"type": "filesystem", "path": "/x", "retry_seconds": -1}]},
     r"tiers\[0\].retry_seconds: must be >= 0"),
    ({"tiers": [{"type": "redis", "url": "memcached://x"}]}, r"tiers\[0\].url: expected a redis://"),
    ({"tiers": [{"type": "filesystem", "path": "/a"}, {"type": "filesystem", "path": "/b"}]},
     r"tiers\[1\].name: tier name 'filesystem' is used twice"),
    ({"tiers": [{"type": "no.such.module:Tier", "path": "/x"}]}, r"tiers\[0\].type: cannot load tier type plugin"),
    ({"dram": {"eviction": "mru"}}, r"dram.eviction: unknown eviction policy 'mru'; known: lru, prefix_lru"),
    ({"metrics_port": "9000"}, r"metrics_port: expected int or null"),
    ({"dram": {"start_headroom_bytes": -1}}, r"dram.start_headroom_bytes: must not be negative, got -1"),
])
def test_bad_config_names_field_and_allowed_values(cfg: dict, message: str, tmp_path: Path) -> None:
    for tier in cfg.get("tiers", []) if isinstance(cfg.get("tiers"), list) else []:
        if "path" in tier:
            tier["path"] = str(tmp_path / tier["path"].strip("/"))
    with pytest.raises(ConfigError, match=message):
        KVStore.from_config(cfg).close()


def test_config_errors_never_echo_secrets() -> None:
    secret = "hunter2-very-secret"
    for cfg in ({"tiers": [{"type": "s3", "bucket": "b", "access_key_id": "k", "secret_access_key": 12345}]},
                {"tiers": [{"type": "s3", "bucket": "b", "access_key_id": "k", "secret_access_key": [secret]}]},
                {"tiers": [{"type": "redis", "url": f"memcached://user:{secret}@host:1"}]},
                {"tiers": [{"type": "redis", "url": f"redis://:{secret}@host:1", "cluster": "yes"}]},
                {"tiers": [{"type": "redis", "url": f"redis://user:{secret}@host:1", "ttl_seconds": -1}]}):
        with pytest.raises(ConfigError) as info:
            load_config(cfg) and KVStore.from_config(cfg).close()
        assert secret not in str(info.value) and "12345" not in str(info.value), str(info.value)


@pytest.mark.parametrize("url", ["redis://:Zq@9@host:1/0", "redis://user:Zq/9@host:1/0", "redis://Zq9@host:1",
                                 "redis://host:1/0?password=Zq9", "s3://h/b?secret_key=Zq9&x=1"])
def test_redact_hides_every_password_form(url: str) -> None:
    from kvtier.config import redact

    assert "Zq" not in redact(f"bad value {url!r} here")
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [url]})  # a URL where a tier mapping belongs: the error shows it, redacted
    assert ("Zq" not in str(info.value) and "host" in str(info.value)) or "h/b" in str(info.value), str(info.value)


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


def test_a_store_config_file_refuses_aliases_and_quotes_no_secret(tmp_path: Path) -> None:
    """The store's and the fleet's YAML go through the router's reader: no alias bomb, no line text in errors."""
    bomb = tmp_path / "bomb.yaml"
    laughs = ["&a0 [x, x]"] + [f"&a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, 40)]
    bomb.write_text("chunk_tokens: 32\nlaughs: [\n  " + ",\n  ".join(laughs) + "]\n")
    with pytest.raises(ConfigError, match=r"line 4, column \d+: YAML aliases"):
        load_config(bomb)
    broken = tmp_path / "broken.yaml"
    broken.write_text("tiers:\n  - type: redis\n    url: 'redis://:hunter2@127.0.0.1:6379\n")
    with pytest.raises(ConfigError) as info:
        load_config(broken)
    assert "hunter2" not in str(info.value) and "line" in str(info.value), info.value
