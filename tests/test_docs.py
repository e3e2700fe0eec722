"""The generated reference pages (kvtier.docs): the committed docs/reference/*.md are what the generator makes of
the code and benchmarks/results/ now, every config key has a help line, every metric a help text, and the pages
name every field, command, option and metric."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvtier import ConfigError, docs
from kvtier.docs import _markdown as md
from kvtier.docs import benchmarks, cli, configuration, metrics

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return docs.render(ROOT)


@pytest.mark.parametrize("name", docs.PAGES)
def test_each_committed_page_is_what_the_generator_makes(pages: dict[str, str], name: str) -> None:
    path = REFERENCE / name
    assert path.is_file(), f"docs/reference/{name} is missing: run `{docs.REGENERATE}` and commit it"
    assert path.read_text(encoding="utf-8") == pages[name], (
        f"docs/reference/{name} is out of date (a config field, command, option, metric or benchmark result "
        f"changed): run `{docs.REGENERATE}` and commit docs/reference/")


def test_the_generator_is_deterministic(pages: dict[str, str]) -> None:
    assert docs.render(ROOT) == pages


def test_every_config_field_has_a_one_line_help() -> None:
    missing = [f"{section.cls.__qualname__}.{f.name}" for section in configuration.all_sections()
               for f in section.fields() if not str(f.metadata.get("help", "")).strip()]
    assert not missing, "config fields without metadata={'help': ...}: " + ", ".join(missing)
    multiline = [k.path for s in configuration.all_sections() for k in configuration.keys(s) if "\n" in k.help]
    assert not multiline


def test_the_router_and_fleet_pages_name_every_key_a_loader_takes(pages: dict[str, str]) -> None:
    """Every key the router's and the fleet's loaders accept, nested ones included, has a row (a key added to a
    loader and not to its dataclass is refused by the loader, so it cannot be missed)."""
    import kvtier.fleet.config as fleet
    import kvtier.router.config as router

    router_page, fleet_page = pages["router-configuration.md"], pages["fleet-configuration.md"]
    for name in router._TOP:
        assert f"| `{name}` |" in router_page, name
    for prefix, cls in (("engines[].", router.EngineConfig), ("timeouts.", router.Timeouts),
                        ("costs.", router.Costs), ("limits.", router.Limits), ("events.", router.EventLimits),
                        ("pd.", router.PDConfig)):
        for f in dataclasses.fields(cls):
            assert f"| `{prefix}{f.name}` |" in router_page, (prefix, f.name)
    for name in fleet._KEYS:
        assert f"| `{name}` |" in fleet_page, name
    for prefix, cls in (("engines.", fleet.Pools), ("ports.", fleet.Ports), ("redis.", fleet.RedisConfig),
                        ("prometheus.", fleet.PrometheusConfig)):
        for f in dataclasses.fields(cls):
            assert f"| `{prefix}{f.name}` |" in fleet_page, (prefix, f.name)
    assert "| `listen` | host:port | `127.0.0.1:8000` |" in router_page
    assert "| `policy` | string | `cache_aware` | `cache_aware`, `round_robin`, `session` |" in router_page
    assert "| `limits.max_body_bytes` | byte size | `16MiB` |" in router_page
    assert "| `redis.maxmemory_bytes` | byte size | `1GiB` |" in fleet_page
    assert "| `model` | string | required |" in fleet_page


def test_a_fleet_file_of_only_a_model_gets_the_documented_defaults(tmp_path: Path) -> None:
    from kvtier.fleet.config import FleetFile, load_fleet_config

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "fleet.yaml").write_text("model: m\n")
    loaded = load_fleet_config(tmp_path / "fleet.yaml")
    for f in dataclasses.fields(FleetFile):
        if f.name in ("engines", "block_size", "max_model_len", "host", "ports", "health_timeout_s"):
            assert getattr(loaded, f.name) == f.default, f.name
    assert loaded.served_model_name == "m" and loaded.work_dir == tmp_path / "kvtier-fleet"
    assert loaded.redis is not None and loaded.prometheus is not None and len(loaded.cpus) == loaded.engines
    for part, keys in (("redis", "maxmemory_bytes"), ("prometheus", "scrape_interval_s, retention")):
        (tmp_path / "fleet.yaml").write_text(f"model: m\n{part}: 7\n")
        with pytest.raises(ConfigError, match=rf"^{part}: expected true, false or a mapping \({keys}\), got 7$"):
            load_fleet_config(tmp_path / "fleet.yaml")
        (tmp_path / "fleet.yaml").write_text(f"model: m\n{part}: false\n")
        assert getattr(load_fleet_config(tmp_path / "fleet.yaml"), part) is None


def test_the_configuration_page_names_every_field_of_every_tier_type(pages: dict[str, str]) -> None:
    from kvtier.tiers import TIERS

    for name in TIERS.names():
        options = TIERS.resolve(name, "tiers[].type").Options
        for f in dataclasses.fields(options):
            assert f"`tiers[].{f.name}`" in pages["configuration.md"], (name, f.name)
        assert f"`type: {name}`" in pages["configuration.md"]


def test_the_configuration_page_shows_types_defaults_and_allowed_values(pages: dict[str, str]) -> None:
    text = pages["configuration.md"]
    assert "| `dram.capacity_bytes` | byte size | `4GiB` |" in text
    assert "| `tiers[].durability` | string | `none` | `none`, `fsync` |" in text
    assert "`lru`, `prefix_lru`, `package.module:Class`" in text  # dram.eviction, from the policies' registry
    assert "| `tiers[].bucket` | string | required |" in text


def test_every_metric_has_a_help_and_is_on_the_page(pages: dict[str, str]) -> None:
    found = [m for group in metrics.groups() for m in group.metrics]
    assert len(found) > 40
    assert not [m.name for m in found if not m.help.strip()]
    for m in found:
        assert f"| `{m.name}` | {m.type} |" in pages["metrics.md"], m.name
    names = {m.name for m in found}
    assert {"kvtier_hit_chunks_total", "kvtier_tier_events_total", "kvtier_connector_errors_total",
            "kvtier_router_requests_total", "kvtier_put_seconds"} <= names
    assert len(names) == len(found), "a metric listed twice"


def test_every_command_and_option_is_on_the_page(pages: dict[str, str]) -> None:
    text = pages["cli.md"]
    progs = [command.prog for command in cli.commands()]
    assert {"kvtier", "kvtier cache ls", "kvtier fleet up", "kvtier decide"} <= set(progs)
    for command in cli.commands():
        assert f" `{command.prog}`\n" in text, command.prog
        for action in command.arguments():
            assert f"| `{cli.option_name(action)}` |" in text, (command.prog, action.dest)
            assert action.help, f"{command.prog} {cli.option_name(action)} has no help"


def test_every_benchmark_kind_has_its_latest_file(pages: dict[str, str]) -> None:
    results = benchmarks.latest(ROOT / "benchmarks" / "results")
    assert {"ttft", "store", "peers", "router"} <= {r.kind for r in results}
    for result in results:
        assert f"`benchmarks/results/{result.path.name}`" in pages["benchmarks.md"]
    ttft = next(r for r in results if r.kind == "ttft")
    assert ttft.path.name >= "ttft-2026-12-02.json"


def test_a_kind_reads_its_latest_plain_file(tmp_path: Path) -> None:
    for name in ("x-2026-01-01.json", "x-2026-01-02-run1.json", "x-2026-01-02.json", "x-2026-01-02-s3.json"):
        (tmp_path / name).write_text('{"rows": [{"name": "a", "ratio": 1.5}]}')
    [result] = benchmarks.latest(tmp_path)
    assert (result.kind, result.path.name, result.others) == ("x", "x-2026-01-02.json", 3)
    assert "| a | 1.5 |" in benchmarks.section(result)  # a kind without a reader: its rows' ratios


def test_paired_ttft_runs_show_each_hit_beside_vllms_own_and_their_agreement(tmp_path: Path) -> None:
    hit = {"ratio": 1.2, "interval": [1.1, 1.3], "pairs": 6, "kvtier_mean": 0.09, "engine_mean": 0.075,
           "floor": 1.05, "target": 1.15}
    (tmp_path / "ttft-2026-01-02-run1.json").write_text(json.dumps({"hits": {"kvtier, DRAM hit": hit}}))
    (tmp_path / "ttft-runs-2026-01-02.json").write_text(json.dumps({"limit": 0.05, "rows": [
        {"name": "kvtier, DRAM hit", "median": 1.2, "runs": [1.2, 1.26, 1.18], "max_deviation": 0.05,
         "within": True}], "missing": {"kvtier, s3 hit": [2]}}))
    pairs, runs = (benchmarks.section(r) for r in benchmarks.latest(tmp_path))
    assert "| kvtier, DRAM hit | 6 | 0.09 | 0.075 | 1.2 | 1.1 to 1.3 | 1.05 | \\<= 1.15: not met |" in pairs
    assert "| kvtier, DRAM hit | 1.2 | 1.2, 1.26, 1.18 | +5.0% | yes |" in runs
    assert "| kvtier, s3 hit |   | missing from 1 run(s) |   | not compared |" in runs


def test_codec_results_show_bytes_agreement_perplexity_and_speed(tmp_path: Path) -> None:
    (tmp_path / "codecs-2026-01-02.json").write_text(json.dumps({"kind": "codecs", "codecs": {
        "fp8": {"stored_over_raw": 0.53125, "agreement": [0.98, 1.0], "kl": [0.002, 0.004],
                "ppl_change": [0.01, -0.03], "ppl_change_pooled": -0.004, "encode_mb_s": 380.2,
                "decode_mb_s": 1072.0, "target_met": True},
        "fp8, a scale per token": {"agreement": [0.97], "kl": [0.005], "ppl_change": [0.02]}}}))
    [result] = benchmarks.latest(tmp_path)
    text = benchmarks.section(result)
    assert "| fp8 | 0.531 | 99.00% (min 98.00%) | 0.003 | -0.40% | -3.00% | 380 | 1.07e+03 | met |" in text
    assert "| fp8, a scale per token |   | 97.00% (min 97.00%) | 0.005 |   | +2.00% |   |   |   |" in text


def test_spreads_come_from_paired_runs() -> None:
    assert benchmarks.paired([2.0, 4.0], [1.0, 2.0]) == [2.0, 2.0]
    assert benchmarks.paired([2.0, 4.0], [1.0]) == []  # runs that do not pair up give no spread
    assert benchmarks.spread([1.5, 0.9, 1.2]) == "0.9 to 1.5 (n=3)"
    assert benchmarks.spread([1.0]) == ""


def test_markdown_text_is_escaped_outside_code() -> None:
    assert md.text("keys are <prefix>:<key>, 2**20, `a*b`") == r"keys are \<prefix\>:\<key\>, 2\*\*20, `a*b`"
    assert configuration.yaml_value(64 * 2**10, size=True) == "64KiB"
    assert configuration.yaml_value("kvtier:") == '"kvtier:"'
    assert configuration.yaml_value(None) == "null"


def test_check_names_a_stale_page_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    assert docs.main(["--root", str(tmp_path)]) == 0
    assert docs.main(["--root", str(tmp_path), "--check"]) == 0
    (tmp_path / "docs" / "reference" / "cli.md").write_text("old\n")
    capsys.readouterr()
    assert docs.main(["--root", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/reference/cli.md is out of date" in err and docs.REGENERATE in err
