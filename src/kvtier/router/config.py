"""The router's configuration: a YAML file validated into frozen dataclasses (errors name the field).

    listen: 127.0.0.1:8000
    tokenizer: /models/llama-3-8b        # the engines' model directory: tokenizer and chat template
    block_size: 16                       # the engines' --block-size (all engines the same)
    policy: cache_aware                  # cache_aware | round_robin | session
    engines:
      - name: e0
        url: http://10.0.0.1:8000
        kv_events: tcp://10.0.0.1:5557          # the engine's --kv-events-config endpoint, as the router reaches it
        kv_events_replay: tcp://10.0.0.1:5558   # its replay_endpoint
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import typing
import urllib.parse
from collections.abc import Mapping
from typing import Any, Literal

from kvtier.config import FieldReader, build_dataclass, check_otlp_endpoint, check_url_port, read_mapping, shown
from kvtier.errors import ConfigError

Policy = Literal["cache_aware", "round_robin", "session"]
Role = Literal["both", "prefill", "decode"]
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ZMQ = re.compile(r"(tcp|ipc|inproc)://.+")
# What the router may bind an engine's events on: addresses only this host reaches (see EngineConfig.check)
_LOCAL_BIND = re.compile(r"tcp://(127(\.\d{1,3}){3}|localhost|\[::1\]):\d{1,5}|(ipc|inproc)://.+")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """One vLLM OpenAI API server of the fleet."""

    name: str = dataclasses.field(metadata={"help": "the engine's name in metrics, logs and X-KVTier-Engine"})
    url: str = dataclasses.field(metadata={"help": "the engine's OpenAI API server, http://host:port or https://"})
    kv_events: str | None = dataclasses.field(default=None, metadata={
        "help": "ZMQ endpoint of the engine's KV events (its --kv-events-config endpoint, as the router reaches "
                "it; null: routed without knowing its cache)"})
    kv_events_replay: str | None = dataclasses.field(default=None, metadata={
        "help": "the engine's replay endpoint: gaps and a router restart are refilled from it"})
    kv_events_bind: bool = dataclasses.field(default=False, metadata={
        "help": "the router binds kv_events (loopback or ipc only) and the engine connects to it"})
    weight: float = dataclasses.field(default=1.0, metadata={
        "help": "over 1: a faster engine; until calibrated, its prefill is taken as this much faster"})
    role: Role = dataclasses.field(default="both", metadata={
        "help": "both: serves whole requests; prefill: computes prompts for decode engines (disaggregated "
                "prefill, docs/pd.md); decode: serves requests, loading prompts a prefill engine computed"})

    def check(self, field: str) -> None:
        if not _NAME.fullmatch(self.name):
            raise ConfigError(f"{field}.name: 1-64 letters, digits, '_', '.' or '-', got {self.name!r}")
        try:
            parts = urllib.parse.urlsplit(self.url)
            hostname = parts.hostname
        except ValueError:  # e.g. an unclosed [ of an IPv6 address: urllib's text would repeat the URL
            parts, hostname = None, None
        if parts is None or parts.scheme not in ("http", "https") or not hostname:
            raise ConfigError(f"{field}.url: expected http://host:port or https://host:port, got "
                              f"{shown(field + '.url', self.url)}")
        if parts.username is not None or parts.password is not None:
            # aiohttp cannot send URL credentials beside an Authorization header (a client's own, or
            # engine_api_key's): every such request would fail. Nothing of the URL is echoed: it holds a password.
            raise ConfigError(f"{field}.url: credentials in the URL (user:password@) are not supported; give the "
                              f"engines' key as engine_api_key ('file:/path' or 'env:VARIABLE')")
        check_url_port(self.url, f"{field}.url", shown(field + ".url", self.url).strip("'"))
        for name in ("kv_events", "kv_events_replay"):
            value = getattr(self, name)
            if value is not None and not _ZMQ.fullmatch(value):
                raise ConfigError(f"{field}.{name}: expected a ZMQ endpoint (tcp://host:port, ipc://path or "
                                  f"inproc://name), got {value!r}")
        wildcard = re.compile(r"tcp://(\*|0\.0\.0\.0|\[?::\]?):")
        for name, binds in (("kv_events", self.kv_events_bind), ("kv_events_replay", False)):
            value = getattr(self, name)
            if value is not None and wildcard.match(value) and not binds:
                hint = "" if name == "kv_events_replay" else (", or for an engine on this host "
                                                              "tcp://127.0.0.1:PORT with kv_events_bind: true")
                raise ConfigError(f"{field}.{name}: {value!r} is an address to bind, not to connect to: give the "
                                  f"engine's host (tcp://HOST:PORT){hint}")
            if value is not None and value.startswith("tcp://") and not re.fullmatch(r"tcp://.+:\d{1,5}", value):
                raise ConfigError(f"{field}.{name}: expected tcp://HOST:PORT, got {value!r}")
        if self.kv_events_bind and self.kv_events is not None and not _LOCAL_BIND.fullmatch(self.kv_events):
            # A bound socket takes events from whoever connects, and vLLM's publisher cannot authenticate (it has
            # no CURVE keys): bound only where this host alone reaches it
            raise ConfigError(f"{field}.kv_events: with kv_events_bind the router binds only a loopback address "
                              f"(tcp://127.0.0.1:PORT, tcp://[::1]:PORT) or ipc://PATH, since anyone who reaches "
                              f"a bound socket can publish on it; for an engine on another host let the engine "
                              f"bind (its tcp://*:PORT) and give tcp://ENGINE_HOST:PORT here without "
                              f"kv_events_bind, got {shown(field + '.kv_events', self.kv_events)}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ConfigError(f"{field}.kv_events_replay: set only with kv_events")
        if not 0 < self.weight <= 100:
            raise ConfigError(f"{field}.weight: must be in (0, 100], got {self.weight}")


@dataclasses.dataclass(frozen=True)
class Timeouts:
    connect_s: float = dataclasses.field(default=5.0, metadata={
        "help": "seconds to open a connection to an engine (also the health check's)"})
    first_byte_s: float = dataclasses.field(default=600.0, metadata={
        "help": "seconds until the engine's first byte (a whole answer, when not streaming)"})
    idle_s: float = dataclasses.field(default=120.0, metadata={"help": "seconds between two chunks of a stream"})

    def check(self, field: str) -> None:
        for f in dataclasses.fields(self):
            # below 0.1 s every engine times out (the timeouts are also the health check's)
            if not 0.1 <= getattr(self, f.name) <= 86400:
                raise ConfigError(f"{field}.{f.name}: must be in [0.1, 86400] seconds, got {getattr(self, f.name)}")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client can make the router hold or do (see ``router/guards.py``)."""

    max_connections: int = dataclasses.field(default=512, metadata={
        "help": "client connections at once; one more takes the place of the oldest idle one (closed when none "
                "is idle)"})
    header_s: float = dataclasses.field(default=10.0, metadata={
        "help": "seconds from a connection's start (or its last answer) to a request's complete headers"})
    body_s: float = dataclasses.field(default=30.0, metadata={"help": "seconds to read a request's body"})
    max_body_bytes: int = dataclasses.field(default=16 * 2**20, metadata={
        "help": "a request's body once inflated (gzip, deflate): larger ones get 413"})
    # A few KiB of gzip each, held open, would otherwise make the router hold max_body_bytes per connection.
    max_inflight_body_bytes: int = dataclasses.field(default=256 * 2**20, metadata={
        "help": "the bodies of all requests being read and not yet keyed, router-wide, once inflated: a body "
                "that would take more gets 503"})
    workers: int = dataclasses.field(default=2, metadata={
        "help": "threads that parse, tokenize and key requests off the event loop (a completion body of at most "
                "1 KiB is read on the loop, with a fast tokenizer and blocks of 16 tokens or more); prompts that "
                "truncate (truncate_prompt_tokens) are encoded by at most min(workers, 8) of them at a time, each "
                "with a copy of the tokenizer"})
    queue: int = dataclasses.field(default=64, metadata={
        "help": "requests waiting for a worker; past it a body up to 32 KiB is routed without a prediction, a "
                "larger one answered 429"})
    # Keying and reserving a prompt's blocks takes the event loop ~10 us a block.
    max_prompt_tokens: int = dataclasses.field(default=131072, metadata={
        "help": "longer prompts (and those over the engines' max_model_len) are routed without a prediction"})

    def check(self, field: str) -> None:
        for name, low, high in (("max_connections", 1, 1_000_000), ("max_body_bytes", 1024, 2**31),
                                ("workers", 1, 64), ("queue", 0, 1_000_000), ("max_prompt_tokens", 1, 2**31)):
            if not low <= getattr(self, name) <= high:
                raise ConfigError(f"{field}.{name}: must be in [{low}, {high}], got {getattr(self, name)}")
        if not self.max_body_bytes <= self.max_inflight_body_bytes <= 2**40:
            raise ConfigError(f"{field}.max_inflight_body_bytes: must be in [max_body_bytes ({self.max_body_bytes}), "
                              f"2**40], so that one whole body fits, got {self.max_inflight_body_bytes}")
        for name in ("header_s", "body_s"):
            if not 0.1 <= getattr(self, name) <= 3600:
                raise ConfigError(f"{field}.{name}: must be in [0.1, 3600] seconds, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class EventLimits:
    """What one engine's KV events (or whoever publishes in its place) can make the router hold or do (see
    ``router/events.py`` and ``router/index.py``)."""

    max_event_blocks: int = dataclasses.field(default=16384, metadata={
        "help": "block hashes in one BlockStored or BlockRemoved; a batch with more is refused"})
    max_engine_blocks: int = dataclasses.field(default=1_000_000, metadata={
        "help": "distinct blocks credited to one engine (~0.7 KB each); past it the least recently stored go"})
    max_message_bytes: int = dataclasses.field(default=4 * 2**20, metadata={
        "help": "one event message; a larger one is dropped (a gap, replayed)"})
    queue: int = dataclasses.field(default=512, metadata={
        "help": "messages received and not yet read; more are dropped (a gap, replayed)"})
    replay_s: float = dataclasses.field(default=5.0, metadata={
        "help": "seconds a whole replay (all its rounds) may take: live events wait meanwhile"})
    replay_bytes: int = dataclasses.field(default=256 * 2**20, metadata={
        "help": "the messages of a whole replay (what a forged replay socket can make the router hold); past it "
                "the replay stops, and what is missing is a gap"})

    def check(self, field: str) -> None:
        for name, low, high in (("max_event_blocks", 1, 2**20), ("max_engine_blocks", 1, 10**9),
                                ("max_message_bytes", 2**16, 2**31), ("queue", 1, 1_000_000)):
            if not low <= getattr(self, name) <= high:
                raise ConfigError(f"{field}.{name}: must be in [{low}, {high}], got {getattr(self, name)}")
        if not self.max_message_bytes <= self.replay_bytes <= 2**40:
            raise ConfigError(f"{field}.replay_bytes: must be in [max_message_bytes ({self.max_message_bytes}), "
                              f"2**40], got {self.replay_bytes}")
        if not 0.1 <= self.replay_s <= 60:
            raise ConfigError(f"{field}.replay_s: must be in [0.1, 60] seconds, got {self.replay_s}")


@dataclasses.dataclass(frozen=True)
class Costs:
    """Starting points of the cost model. Prefill speed is calibrated online per engine; load speeds are what
    kvtier moves per second from each place into an engine (``kvtier bench`` measures them on your hardware)."""

    prefill_tokens_per_s: float = dataclasses.field(default=1000.0, metadata={
        "help": "an engine's prefill speed until calibrated online from its answers"})
    host_tokens_per_s: float = dataclasses.field(default=50_000.0, metadata={
        "help": "loading from kvtier DRAM on the engine's host"})
    disk_tokens_per_s: float = dataclasses.field(default=25_000.0, metadata={
        "help": "loading from an engine-local kvtier tier on storage"})
    shared_tokens_per_s: float = dataclasses.field(default=10_000.0, metadata={
        "help": "loading from a shared kvtier tier (Redis, S3, Mooncake)"})
    decode_s_per_request: float = dataclasses.field(default=0.01, metadata={
        "help": "seconds each request decoding on an engine adds to a new request's wait"})

    def check(self, field: str) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_tokens_per_s") and not 1 <= value <= 1e9:
                raise ConfigError(f"{field}.{f.name}: must be in [1, 1e9] tokens per second, got {value}")
        if not 0 <= self.decode_s_per_request <= 10:
            raise ConfigError(f"{field}.decode_s_per_request: must be in [0, 10] seconds, got "
                              f"{self.decode_s_per_request}")


@dataclasses.dataclass(frozen=True)
class PDConfig:
    """Disaggregated prefill and decode (engines with a ``role``; docs/pd.md)."""

    local_tokens: int = dataclasses.field(default=512, metadata={
        "help": "a request its decode engine would compute fewer uncached tokens of than this is served there "
                "whole (multi-turn follow-ups stay local); from this many on a prefill engine computes the prompt"})
    wait_s: float = dataclasses.field(default=2.0, metadata={
        "help": "seconds a decode engine waits for the KV a prefill engine stored to be visible in a tier "
                "before it computes what is missing"})
    prefill_timeout_s: float = dataclasses.field(default=120.0, metadata={
        "help": "seconds for a prefill engine's whole answer; past it the next prefill engine is tried, then the "
                "decode engine serves the request whole"})

    def check(self, field: str) -> None:
        if not 0 <= self.local_tokens <= 2**31:
            raise ConfigError(f"{field}.local_tokens: must be in [0, 2**31], got {self.local_tokens}")
        if not 0 <= self.wait_s <= 60:
            raise ConfigError(f"{field}.wait_s: must be in [0, 60] seconds, got {self.wait_s}")
        if not 0.1 <= self.prefill_timeout_s <= 3600:
            raise ConfigError(f"{field}.prefill_timeout_s: must be in [0.1, 3600] seconds, got "
                              f"{self.prefill_timeout_s}")


Source = Literal["dns", "kubernetes"]
_DNS_NAME = re.compile(r"(?=.{1,253}\.?$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.)*"
                       r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.?")
_K8S_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class DiscoveryConfig:
    """Engines found while serving (docs/fleet.md): each address a source gives is an engine of this role and
    weight, reached at these ports."""

    source: Source = dataclasses.field(metadata={
        "help": "dns: the A and AAAA records of ``name`` (a headless Service's), polled; kubernetes: the ready "
                "endpoints of ``service``'s EndpointSlices, watched through the Kubernetes API"})
    name: str | None = dataclasses.field(default=None, metadata={
        "help": "dns: the name to resolve, e.g. vllm.NAMESPACE.svc.cluster.local"})
    service: str | None = dataclasses.field(default=None, metadata={"help": "kubernetes: the Service"})
    namespace: str | None = dataclasses.field(default=None, metadata={
        "help": "kubernetes: the Service's namespace (null: the router's own, its service account's)"})
    port: int | str = dataclasses.field(default=8000, metadata={
        "help": "the engines' OpenAI API port: a number, or (kubernetes) the EndpointSlice port's name"})
    kv_events_port: int | str | None = dataclasses.field(default=None, metadata={
        "help": "the engines' KV events port (their --kv-events-config endpoint's), a number or a port's name "
                "(null: routed without knowing their caches)"})
    kv_events_replay_port: int | str | None = dataclasses.field(default=None, metadata={
        "help": "the engines' replay port, a number or a port's name"})
    scheme: Literal["http", "https"] = dataclasses.field(default="http", metadata={
        "help": "how the engines' API is reached"})
    role: Role = dataclasses.field(default="both", metadata={"help": "the role of every engine found (engines' role)"})
    weight: float = dataclasses.field(default=1.0, metadata={"help": "the weight of every engine found"})
    interval_s: float = dataclasses.field(default=5.0, metadata={
        "help": "dns: seconds between lookups; kubernetes: seconds before watching again after the API failed"})
    nameserver: str | None = dataclasses.field(default=None, metadata={
        "help": "dns: host:port of the DNS server to ask (null: the system's resolver, /etc/resolv.conf)"})
    kubeconfig: str | None = dataclasses.field(default=None, metadata={
        "help": "kubernetes: a kubeconfig file (null: in the cluster, the router pod's service account)"})
    address_family: Literal["prefer_ipv4", "ipv4", "ipv6"] = dataclasses.field(default="prefer_ipv4", metadata={
        "help": "which addresses are engines: prefer_ipv4: IPv4 ones, IPv6 where there are none (a dual-stack "
                "Service's pods are found once)"})
    max_engines: int = dataclasses.field(default=256, metadata={
        "help": "the most engines this source finds (the rest, by name, left out and counted): what a wrong or "
                "hostile answer can make the router follow"})

    def check(self, field: str) -> None:
        own = _SOURCE_FIELDS[self.source]
        for name in ("name", "service", "namespace", "nameserver", "kubeconfig"):
            value = getattr(self, name)
            if name == own[0] and value is None:
                raise ConfigError(f"{field}.{name}: required for source {self.source}")
            if value is not None and name not in own:
                raise ConfigError(f"{field}.{name}: not a setting of source {self.source} (its own: "
                                  f"{', '.join(own)})")
        if self.name is not None and (not _DNS_NAME.fullmatch(self.name) or "." not in self.name.rstrip(".")):
            raise ConfigError(f"{field}.name: expected a fully qualified DNS name (asked as it is, no search "
                              f"domains), e.g. vllm.NAMESPACE.svc.cluster.local, got {self.name!r}")
        for name in ("service", "namespace"):
            value = getattr(self, name)
            if value is not None and not _K8S_NAME.fullmatch(value):
                raise ConfigError(f"{field}.{name}: expected a Kubernetes name (lowercase letters, digits and '-', "
                                  f"at most 63), got {value!r}")
        for name in ("port", "kv_events_port", "kv_events_replay_port"):
            value = getattr(self, name)
            if isinstance(value, int) and not 1 <= value <= 65535:
                raise ConfigError(f"{field}.{name}: a port in 1-65535, got {value}")
            if isinstance(value, str) and (self.source == "dns" or not _K8S_NAME.fullmatch(value) or len(value) > 15):
                raise ConfigError(f"{field}.{name}: expected a port number" + (
                    "" if self.source == "dns" else " or an EndpointSlice port's name (at most 15 lowercase "
                    "letters, digits and '-')") + f", got {value!r}")
        if self.kv_events_replay_port is not None and self.kv_events_port is None:
            raise ConfigError(f"{field}.kv_events_replay_port: set only with kv_events_port")
        if not 0 < self.weight <= 100:
            raise ConfigError(f"{field}.weight: must be in (0, 100], got {self.weight}")
        if not 0.1 <= self.interval_s <= 3600:
            raise ConfigError(f"{field}.interval_s: must be in [0.1, 3600] seconds, got {self.interval_s}")
        if not 1 <= self.max_engines <= 4096:
            raise ConfigError(f"{field}.max_engines: must be in [1, 4096], got {self.max_engines}")
        if self.nameserver is not None:
            host, sep, port = self.nameserver.rpartition(":")
            try:
                ipaddress.ip_address(host.strip("[]"))
            except ValueError:
                host = ""
            if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ConfigError(f"{field}.nameserver: expected IP:port (or [IPv6]:port) of a DNS server, got "
                                  f"{self.nameserver!r}")


_SOURCE_FIELDS = {"dns": ("name", "nameserver"), "kubernetes": ("service", "namespace", "kubeconfig")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
    engines: tuple[EngineConfig, ...] = dataclasses.field(default=(), metadata={
        "help": "the fleet's vLLM API servers, each a mapping (below); at least one unless discovery finds them",
        "yaml": "list of mappings"})
    tokenizer: str = dataclasses.field(metadata={
        "help": "the engines' model directory: its tokenizer and chat template key the prompts"})
    block_size: int = dataclasses.field(default=16, metadata={
        "help": "the engines' --block-size (every engine the same)"})
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "written as listen: HOST:PORT"})
    port: int = dataclasses.field(default=8000, metadata={"help": "written as listen: HOST:PORT"})
    policy: Policy = dataclasses.field(default="cache_aware", metadata={
        "help": "cache_aware: the engine with the lowest predicted time to first token; round_robin; session: "
                "a session keeps its engine (by the session header; round robin without one)"})
    session_header: str = dataclasses.field(default="X-Session-ID", metadata={
        "help": "the header that names a session (policy: session)"})
    timeouts: Timeouts = dataclasses.field(default=Timeouts(), metadata={"help": "the router's calls to engines"})
    costs: Costs = dataclasses.field(default=Costs(), metadata={"help": "the cost model's starting points"})
    limits: Limits = dataclasses.field(default=Limits(), metadata={"help": "what one client can make it hold"})
    events: EventLimits = dataclasses.field(default=EventLimits(), metadata={
        "help": "what one engine's KV events can make it hold"})
    pd: PDConfig = dataclasses.field(default=PDConfig(), metadata={
        "help": "disaggregated prefill and decode, for engines with role prefill or decode"})
    admin_listen: str | None = dataclasses.field(default=None, metadata={
        "help": "host:port of a second listener for /metrics and /health's per-engine detail (null: both on the "
                "client listener)"})
    engine_api_key: str | None = dataclasses.field(default=None, metadata={
        "help": "the engines' vLLM --api-key, sent on the router's own calls: 'file:/absolute/path' or "
                "'env:VARIABLE'"})
    retries: int = dataclasses.field(default=1, metadata={
        "help": "other engines tried when one fails before its first byte"})
    health_interval_s: float = dataclasses.field(default=2.0, metadata={
        "help": "seconds between health checks of each engine"})
    metrics_interval_s: float = dataclasses.field(default=5.0, metadata={
        "help": "seconds between reads of each engine's /metrics (its queue, for the cost model)"})
    reload_s: float = dataclasses.field(default=2.0, metadata={
        "help": "seconds between looks at the config file for a change to its engines, applied while serving "
                "(SIGHUP applies it at once; 0: on SIGHUP only). Other settings take a restart"})
    ttft_slo_s: float = dataclasses.field(default=2.0, metadata={
        "help": "the time to first token a streamed request should see: kvtier_router_ttft_slo_requests_total "
                "counts the requests within it and over it (the autoscaling signal and the KVTierRouterAddEngines "
                "alert read it)"})
    discovery: tuple[DiscoveryConfig, ...] = dataclasses.field(default=(), metadata={
        "help": "where more engines are found while serving: DNS records or a Kubernetes Service's "
                "EndpointSlices, each a mapping (below)", "yaml": "list of mappings"})
    balance_requests: int | None = dataclasses.field(default=2, metadata={
        "help": "cache_aware: an engine with more than this many requests in flight sharing the prefix it holds of "
                "a prompt (all of them when it holds none), beyond the least busy engine's requests in flight, gives "
                "the request to that one (a hot prefix spreads; null: never)"})
    reserve_s: float = dataclasses.field(default=10.0, metadata={
        "help": "seconds the blocks a routed request will compute count before the engine's events confirm them"})
    # They tell a client whether a prefix is cached somewhere: only for trusted clients.
    explain_headers: bool = dataclasses.field(default=False, metadata={
        "help": "answers carry X-KVTier-Engine, -Route-Reason, -Predicted-Cached-Tokens and -Predicted-TTFT "
                "(tests, benchmarks, debugging)"})
    otlp_traces_endpoint: str | None = dataclasses.field(default=None, metadata={
        "help": "OTLP/HTTP collector URL for the router's spans (null: no traces)"})


_TOP = {f.name for f in dataclasses.fields(RouterConfig)} - {"host", "port"} | {"listen"}
# host and port are written as one key, listen
DEFAULT_LISTEN = "{}:{}".format(*(f.default for f in dataclasses.fields(RouterConfig) if f.name in ("host", "port")))


def load_router_config(source: Mapping[str, object] | str | os.PathLike[str]) -> RouterConfig:
    """Validate a mapping, or read a YAML file, into a :class:`RouterConfig`."""
    raw = dict(read_mapping(source, "router config", sorted(_TOP)))
    listen = raw.pop("listen", DEFAULT_LISTEN)
    host, sep, port = str(listen).rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"listen: expected host:port with a port in 1-65535, got {shown('listen', listen)}")
    discovery_raw = raw.pop("discovery", None) or []
    if not isinstance(discovery_raw, list):
        raise ConfigError("discovery: expected a list of sources (source: dns or kubernetes, and its settings)")
    discovery = tuple(build_dataclass(DiscoveryConfig, d, f"discovery[{i}]") for i, d in enumerate(discovery_raw))
    engines_raw = raw.pop("engines", None)
    if engines_raw is None and discovery:
        engines_raw = []
    if not isinstance(engines_raw, list) or not (engines_raw or discovery):
        raise ConfigError("engines: required (unless discovery finds them), a list of engines (name, url, "
                          "kv_events, kv_events_replay)")
    engines = tuple(build_dataclass(EngineConfig, e, f"engines[{i}]") for i, e in enumerate(engines_raw))
    names = [e.name for e in engines]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ConfigError(f"engines[{i}].name: {name!r} is used twice; give each engine a distinct name")
    timeouts = build_dataclass(Timeouts, raw.pop("timeouts", {}) or {}, "timeouts")
    costs = build_dataclass(Costs, raw.pop("costs", {}) or {}, "costs")
    limits = build_dataclass(Limits, raw.pop("limits", {}) or {}, "limits")
    events = build_dataclass(EventLimits, raw.pop("events", {}) or {}, "events")
    pd = build_dataclass(PDConfig, raw.pop("pd", {}) or {}, "pd")
    raw.setdefault("tokenizer", None)
    if not isinstance(raw["tokenizer"], str) or not raw["tokenizer"]:
        raise ConfigError("tokenizer: required, the engines' model directory (its tokenizer and chat template)")
    hints, reader = typing.get_type_hints(RouterConfig), FieldReader()
    scalars: dict[str, Any] = {name: reader.typed(hints[name], value, name, size=False) for name, value in raw.items()}
    config = RouterConfig(engines=engines, host=host.strip("[]"), port=int(port), timeouts=timeouts, costs=costs,
                          limits=limits, events=events, pd=pd, discovery=discovery, **scalars)
    if not 1 <= config.block_size <= 4096:
        raise ConfigError(f"block_size: must be the engines' --block-size, in [1, 4096], got {config.block_size}")
    if config.balance_requests is not None and not 0 <= config.balance_requests <= 10_000:
        raise ConfigError(f"balance_requests: must be in [0, 10000] or null, got {config.balance_requests}")
    if not 0 <= config.retries <= 16:
        raise ConfigError(f"retries: must be in [0, 16], got {config.retries}")
    # Lower bounds a working fleet needs: a health check's timeout is twice its interval (an engine answering
    # /health in under 1 s is healthy), and a reservation shorter than 10 ms covers no request
    for name, low in (("health_interval_s", 0.5), ("metrics_interval_s", 0.5), ("reserve_s", 0.01),
                      ("ttft_slo_s", 0.01)):
        if not low <= getattr(config, name) <= 3600:
            raise ConfigError(f"{name}: must be in [{low}, 3600] seconds, got {getattr(config, name)}")
    if config.reload_s != 0 and not 0.1 <= config.reload_s <= 3600:
        raise ConfigError(f"reload_s: 0 (on SIGHUP only) or in [0.1, 3600] seconds, got {config.reload_s}")
    check_otlp_endpoint(config.otlp_traces_endpoint, "otlp_traces_endpoint")
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", config.session_header):
        raise ConfigError(f"session_header: an HTTP header name, got {config.session_header!r}")
    _check_admin(config.admin_listen, config.engine_api_key)
    _check_roles(config)
    return config


def _check_roles(config: RouterConfig) -> None:
    """Prefill engines need an engine that decodes; P/D needs the cache-aware policy (which predicts the
    decode engine's cost of loading a prefix)."""
    roles = [e.role for e in config.engines] + [d.role for d in config.discovery]
    if "prefill" not in roles:
        return
    if all(role == "prefill" for role in roles):
        raise ConfigError("engines: every engine has role prefill; give at least one role decode or both (the "
                          "engines that answer clients)")
    if config.policy != "cache_aware":
        raise ConfigError(f"policy: engines with role prefill need policy cache_aware, got {config.policy!r}")


def _check_admin(admin_listen: str | None, engine_api_key: str | None) -> None:
    if admin_listen is not None:
        host, sep, port = admin_listen.rpartition(":")
        if not sep or not host or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"admin_listen: expected host:port with a port in 1-65535, got {admin_listen!r}")
    if engine_api_key is not None and not re.fullmatch(r"file:/.+|env:[A-Za-z_][A-Za-z0-9_]*", engine_api_key):
        raise ConfigError("engine_api_key: expected 'file:/absolute/path' or "
                          "'env:VARIABLE' (the key itself never goes in the config)")
