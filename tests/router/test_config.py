"""The router's configuration: what each bad value is told (the field, the allowed values, never a secret)."""

from __future__ import annotations

import re

import pytest

from kvtier.errors import ConfigError
from kvtier.router.config import load_router_config

BASE = {"tokenizer": "/m", "engines": [{"name": "a", "url": "http://127.0.0.1:1"}]}


def engine(**fields) -> dict:
    return {**BASE, "engines": [{"name": "a", "url": "http://127.0.0.1:1", **fields}]}


@pytest.mark.parametrize("endpoint", ["tcp://10.0.0.1:5557", "tcp://0.0.0.0:5557", "tcp://*:5557",
                                      "tcp://[::]:5557", "tcp://eth0:5557", "tcp://127.0.0.1.evil:5557"])
def test_a_bound_event_socket_must_be_one_only_this_host_reaches(endpoint):
    """Anyone who reaches a socket the router binds can publish events on it, and vLLM's publisher cannot
    authenticate itself (no CURVE): the router binds loopback and ipc only."""
    with pytest.raises(ConfigError, match=r"^engines\[0\]\.kv_events: with kv_events_bind .*loopback"):
        load_router_config(engine(kv_events=endpoint, kv_events_bind=True))


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://127.3.2.1:5557", "tcp://localhost:5557",
                                      "tcp://[::1]:5557", "ipc:///run/kvtier/e0"])
def test_loopback_and_ipc_event_sockets_may_be_bound(endpoint):
    config = load_router_config(engine(kv_events=endpoint, kv_events_bind=True))
    assert config.engines[0].kv_events_bind


@pytest.mark.parametrize("events, field", [
    ({"max_event_blocks": 0}, "events.max_event_blocks"), ({"max_engine_blocks": 0}, "events.max_engine_blocks"),
    ({"queue": 0}, "events.queue"), ({"replay_s": 1e-9}, "events.replay_s"), ({"replay_s": 600}, "events.replay_s"),
    ({"max_message_bytes": "1KiB"}, "events.max_message_bytes"), ({"slices": 3}, "events.slices"),
])
def test_event_limits_name_the_field_and_its_range(events, field):
    with pytest.raises(ConfigError, match="^" + re.escape(field)):
        load_router_config({**BASE, "events": events})
    assert load_router_config({**BASE, "events": {"queue": 8, "max_message_bytes": "1MiB"}}).events.queue == 8


# --- item 12: field errors only, no secret echoed ----------------------------------------------------------------

def refused(source, field: str) -> str:
    """The ConfigError's text for ``source``, checked to name ``field`` first."""
    with pytest.raises(ConfigError) as info:
        load_router_config(source)
    text = str(info.value)
    assert text.startswith(field), text
    return text


def yaml_file(tmp_path, text: str):
    path = tmp_path / "router.yaml"
    path.write_text(text)
    return path


def test_an_engine_url_with_another_scheme_is_refused_without_its_password():
    text = refused(engine(url="ftp://user:hunter2@x:1"), "engines[0].url")
    assert "hunter2" not in text and "http://host:port" in text and "ftp://user:***@x:1" in text


@pytest.mark.parametrize("url", ["http://[::1", "http://user:hunter2@[::1:80", "http://[not-an-ip]:80"])
def test_a_malformed_engine_url_is_a_field_error(url):
    assert "hunter2" not in refused(engine(url=url), "engines[0].url")


@pytest.mark.parametrize("listen", ["h:²", "h:٣", "h:", ":80", "h:99999", 8000])
def test_listen_takes_an_ascii_port(listen):
    assert "1-65535" in refused({**BASE, "listen": listen}, "listen")


def test_a_yaml_syntax_error_gives_the_line_and_column_not_the_text(tmp_path):
    path = yaml_file(tmp_path, "tokenizer: /m\nengines:\n  - name: a\n    url: http://u:hunter2@x:1 : [\n")
    with pytest.raises(ConfigError) as info:
        load_router_config(path)
    text = str(info.value)
    assert "hunter2" not in text and "line 4, column" in text and str(path) in text, text


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    """The billion laughs: each line doubles the one before; an error quoting the value never ended."""
    items = ["&a0 [x, x]"] + [f"&a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, 40)]
    path = yaml_file(tmp_path, "tokenizer: /m\nengines: [{name: a, url: 'http://127.0.0.1:1'}]\npolicy: [\n  "
                     + ",\n  ".join(items) + "]\n")
    with pytest.raises(ConfigError, match=r"line 5, column \d+: YAML aliases"):
        load_router_config(path)


@pytest.mark.parametrize("patch, field, low", [
    ({"health_interval_s": 1e-9}, "health_interval_s", "0.5"),
    ({"metrics_interval_s": 0.01}, "metrics_interval_s", "0.5"),
    ({"reserve_s": 1e-9}, "reserve_s", "0.01"),
    ({"timeouts": {"connect_s": 1e-9}}, "timeouts.connect_s", "0.1"),
    ({"timeouts": {"first_byte_s": 0.05}}, "timeouts.first_byte_s", "0.1"),
    ({"timeouts": {"idle_s": 1e-9}}, "timeouts.idle_s", "0.1"),
])
def test_intervals_and_timeouts_have_sane_lower_bounds(patch, field, low):
    assert f"[{low}, " in refused({**BASE, **patch}, field)


def test_the_cli_prints_a_field_error_not_a_traceback(tmp_path, capsys):
    from kvtier.cli import main

    path = yaml_file(tmp_path, "tokenizer: /m\nengines:\n  - {name: a, url: 'http://[::1'}\n")
    assert main(["router", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: engines[0].url") and "Traceback" not in err


@pytest.mark.parametrize("url", ["http://admin:S3CRET@10.0.0.1:8000", "https://S3CRET@e0:443", "http://:S3CRET@h:1"])
def test_an_engine_url_with_credentials_is_refused_for_engine_api_key(url):
    """aiohttp cannot send URL credentials with a client's own Authorization, nor with engine_api_key's: refused,
    pointing to engine_api_key, without the password."""
    message = refused(engine(url=url), "engines[0].url")
    assert "engine_api_key" in message and "S3CRET" not in message


def test_the_inflight_body_budget_holds_at_least_one_whole_body():
    refused({**BASE, "limits": {"max_body_bytes": 2**20, "max_inflight_body_bytes": 2**20 - 1}},
            "limits.max_inflight_body_bytes")
    assert load_router_config(BASE).limits.max_inflight_body_bytes == 256 * 2**20


def test_a_replay_budget_holds_at_least_one_whole_message():
    refused({**BASE, "events": {"max_message_bytes": 2**20, "replay_bytes": 2**20 - 1}}, "events.replay_bytes")
    assert load_router_config({**BASE, "events": {"replay_bytes": 2**30}}).events.replay_bytes == 2**30
