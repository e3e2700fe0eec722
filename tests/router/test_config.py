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
