"""``kvtier fleet``'s YAML (:mod:`kvtier.fleet.config`) without starting anything: a fleet of prefill and decode
pools, the router config and the engines it makes of it, and the files it is refused for, each naming its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.errors import ConfigError
from kvtier.fleet.config import FleetConfig, load_fleet_config
from kvtier.fleet.run import Fleet
from kvtier.router.config import load_router_config


def load(tmp_path: Path, **keys: Any) -> FleetConfig:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"model": "m", "cpus": None, **keys}))
    return load_fleet_config(tmp_path / "fleet.yaml")


def test_a_count_of_engines_serves_whole_requests(tmp_path: Path) -> None:
    config = load(tmp_path, engines=2)
    assert config.roles == ("both", "both") and config.engines == 2
    engines = load_router_config(config.router_config()).engines
    assert [(e.name, e.role) for e in engines] == [("e0", "both"), ("e1", "both")]


def test_pools_name_their_engines_and_the_router_config_gives_each_its_role(tmp_path: Path) -> None:
    config = load(tmp_path, engines={"prefill": 1, "decode": 2}, ports={"engines": 8100, "kv_events": 5557},
                  router={"pd": {"local_tokens": 256, "wait_s": 1}})
    assert config.roles == ("prefill", "decode", "decode") and config.engines == 3 and len(config.cpus) == 3
    assert [config.engine_name(i) for i in range(3)] == ["p0", "d0", "d1"]
    # ports in engine order, the prefill pool first
    assert [config.engine_port(i) for i in range(3)] == [8100, 8101, 8102]
    assert config.events_ports(2) == (5561, 5562)
    assert "ports.engines (engine d1)" in config.listening_ports()

    fleet = Fleet(config)
    fleet.write_configs()
    router = load_router_config(config.work_dir / "router.yaml")  # what the router process will read
    assert [(e.name, e.role, e.url) for e in router.engines] == [
        ("p0", "prefill", "http://127.0.0.1:8100"), ("d0", "decode", "http://127.0.0.1:8101"),
        ("d1", "decode", "http://127.0.0.1:8102")]
    assert router.pd.local_tokens == 256 and router.pd.wait_s == 1  # the fleet's router settings pass through
    assert [p.name for p in fleet.engines] == ["p0", "d0", "d1"]
    # every engine runs the same store config; only the router knows roles
    stores = [yaml.safe_load((config.work_dir / f"kvtier-{n}.yaml").read_text()) for n in ("p0", "d0", "d1")]
    assert all({k: v for k, v in s.items() if k != "metrics_port"} == config.kvtier for s in stores)
    assert all("kvtier-d1.yaml" in " ".join(p.argv) for p in fleet.engines if p.name == "d1")
    assert '"topic": "kv@d1"' in " ".join(fleet.engines[2].argv)
    servers = {t["labels"]["server"] for job in fleet.prometheus_config()["scrape_configs"]
               for t in job["static_configs"] if "labels" in t}
    assert servers == {"p0", "d0", "d1"}


def test_pools_may_share_a_tier_the_fleet_does_not_start(tmp_path: Path) -> None:
    config = load(tmp_path, engines={"prefill": 2, "decode": 2}, redis=False,
                  kvtier={"chunk_tokens": 256, "tiers": [{"type": "redis", "url": "redis://10.0.0.9:6379/0"}]})
    assert config.roles.count("prefill") == 2 and config.redis is None


@pytest.mark.parametrize("keys, error", [
    ({"engines": 0}, "engines: must be an integer in [1, 64], got 0"),
    ({"engines": 65}, "engines: must be an integer in [1, 64]"),
    ({"engines": "two"}, "engines: how many engines (an integer in [1, 64]) or pools of them"),
    ({"engines": {"prefill": 1, "decode": 0}}, "engines.decode: must be an integer in [1, 63], got 0"),
    ({"engines": {"prefill": 0, "decode": 2}}, "engines.prefill: must be an integer in [1, 63], got 0"),
    ({"engines": {"prefill": 1}}, "engines.decode: required"),
    ({"engines": {"prefill": 40, "decode": 30}}, "engines: at most 64 engines in all, got 40 prefill and 30 decode"),
    ({"engines": {"prefill": 1, "decode": 1, "both": 1}}, "engines.both: unknown key; allowed: decode, prefill"),
    ({"engines": {"prefill": 1, "decode": 2}, "cpus": ["0", "1"]}, "cpus: one entry per engine"),
    # decode engines could never load what prefill engines stored
    ({"engines": {"prefill": 1, "decode": 1}, "redis": False}, "kvtier.tiers: prefill and decode engines need a tier"),
    ({"engines": {"prefill": 1, "decode": 1},
      "kvtier": {"chunk_tokens": 256, "tiers": [{"type": "filesystem", "path": "/tmp/kvtier-fleet-test"}]}},
     "kvtier.tiers: prefill and decode engines need a tier they all reach (mooncake, redis, s3; "),
    # the router's own checks, on the engines and roles the fleet gives it
    ({"engines": {"prefill": 1, "decode": 1}, "router": {"policy": "round_robin"}},
     "router.policy: engines with role prefill need policy cache_aware"),
    ({"router": {"pd": {"wait_s": 100}}}, "router.pd.wait_s: must be in [0, 60] seconds"),
    ({"router": {"pd": {"bogus": 1}}}, "router.pd.bogus: unknown key"),
    ({"router": {"engines": []}}, "router.engines: set by the fleet itself"),
])
def test_a_bad_fleet_of_pools_is_refused_naming_the_field(tmp_path: Path, keys: dict, error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, **keys)
    assert str(caught.value).startswith(error), str(caught.value)
