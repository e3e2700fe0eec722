"""Configuration: a mapping or a YAML file, validated into frozen dataclasses.

Every error is a :class:`ConfigError` that names the field (``tiers[0].capacity_bytes``) and what is allowed: the
fields are read by the one config field reader (:class:`FieldReader`, :func:`build_dataclass`, from
:mod:`kvtier._config_values`). Byte sizes accept integers or strings with a unit (``"512MiB"``, ``"4GB"``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from kvtier._config_values import CONFIG_FIELDS, shown, unknown_key
from kvtier._config_values import (  # re-exported: part of this API
    FieldReader as FieldReader, build_dataclass as build_dataclass, parse_size as parse_size, redact as redact,
    redact_url as redact_url)
from kvtier import codecs
from kvtier.errors import ConfigError
from kvtier.placement import PlacementRule, parse_placement

if typing.TYPE_CHECKING:
    from kvtier.sealing import EncryptionConfig

CONFIG_ENV = "KVTIER_CONFIG"

def check_url_port(url: str, field: str, shown: str = "") -> None:
    """A :class:`ConfigError` naming ``field`` unless the URL's port, if it has one, is a number in 1-65535.

    The message never quotes urllib's own error, which repeats the text it took for a port: part of a password
    holding an unescaped ``/``. ``shown`` is a redacted form of the URL to include, if any.
    """
    try:
        port = urllib.parse.urlsplit(url).port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"{field}: the port must be a number in 1-65535" + (f", in {shown!r}" if shown else ""))


def check_ttl(value: float | None, field: str) -> None:
    """A tier's ``ttl_seconds``: None (no limit) or a positive, finite number of seconds."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{field}.ttl_seconds: must be a positive number of seconds, got {value}")


@dataclasses.dataclass(frozen=True)
class DramConfig:
    """The primary tier: a preallocated pool of host memory."""

    capacity_bytes: int = dataclasses.field(default=4 * 2**30, metadata={
        "help": "the pool, allocated and touched at start; more than the memory available is refused"})
    # prefix_lru: never below LRU on the traces `kvtier simulate` replays (README)
    eviction: str = dataclasses.field(default="prefix_lru", metadata={
        "help": "the eviction policy, by name or as package.module:Class (a subclass of kvtier.EvictionPolicy)"})
    page_bytes: int = dataclasses.field(default=2**20, metadata={
        "help": "allocation unit inside the pool (at least 4096)"})
    pin_memory: bool | None = dataclasses.field(default=None, metadata={
        "help": "pin the pool's pages for faster copies to the GPU; null: pin when CUDA is available"})
    start_headroom_bytes: int = dataclasses.field(default=2**30, metadata={
        "help": "memory touched and given back at start, after the pool (at most the pool's size, and never what "
                "the pool leaves available less 256 MiB): the pool takes memory the OS had ready, and where memory "
                "is backed lazily (a VM) the engine's first requests would wait on fresh pages instead; none for a "
                "pinned pool (a GPU host); 0: none"})

    def check(self, field: str) -> None:
        if self.page_bytes < 4096:
            raise ConfigError(f"{field}.page_bytes: must be at least 4096, got {self.page_bytes}")
        if self.capacity_bytes < self.page_bytes:
            raise ConfigError(
                f"{field}.capacity_bytes: must be at least page_bytes ({self.page_bytes}), got {self.capacity_bytes}"
            )


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    """Which prefixes are stored: a chunk only once it has been put ``store_after`` times (each put counts a
    sighting of its chunks). Where most prompts never come back, storing only those seen again saves the copy and
    every cascade write of the rest, and a prefix that does come back is a hit from its next time on."""

    store_after: int = dataclasses.field(default=1, metadata={
        "help": "store a chunk at its Nth put (1-16); 1: every put is stored, 2: a prefix once it comes again"})
    remember_chunks: int = dataclasses.field(default=262_144, metadata={
        "help": "chunks whose sightings are remembered (the most recent; about 150 bytes each); a prompt with "
                "more chunks than this is never stored once store_after > 1"})

    def check(self, field: str) -> None:
        if not 1 <= self.store_after <= 16:
            raise ConfigError(f"{field}.store_after: must be an integer in [1, 16], got {self.store_after}")
        if not 1 <= self.remember_chunks <= 2**26:
            raise ConfigError(f"{field}.remember_chunks: must be an integer in [1, {2**26}], got "
                              f"{self.remember_chunks}")


_MAX_WORKERS = 64
_MAX_QUEUE_DEPTH = 1_000_000


@dataclasses.dataclass(frozen=True)
class TierSpec:
    """One secondary tier as configured; ``options`` are checked by the tier class itself."""

    type: str = dataclasses.field(metadata={
        "help": "the tier type, by name or as package.module:Class (an out-of-tree subclass of kvtier.Tier)"})
    name: str
    options: Mapping[str, object]
    queue_depth: int = 64
    queue_bytes: int = 512 * 2**20
    handoff_queue_bytes: int = 256 * 2**20
    workers: int = 1
    retry_seconds: float = 1.0
    codec: codecs.Codec = codecs.NONE
    accept_codecs: tuple[codecs.Codec, ...] = ()  # besides the exact ones and its own codec

    @property
    def accepts(self) -> frozenset[codecs.Codec]:
        """The codecs this tier's reads take (:func:`kvtier.codecs.accepted`)."""
        return codecs.accepted(self.codec, self.accept_codecs)


@dataclasses.dataclass(frozen=True)
class _TierCommon:
    """The keys every tier type takes, beside its own options."""

    queue_depth: int = dataclasses.field(default=64, metadata={
        "help": "cascade writes waiting for this tier; beyond it writes are dropped and counted"})
    queue_bytes: int = dataclasses.field(default=512 * 2**20, metadata={
        "help": "the DRAM bytes the waiting writes may pin (one write always fits)"})
    handoff_queue_bytes: int = dataclasses.field(default=256 * 2**20, metadata={
        "help": "the DRAM bytes waiting handoff writes may pin besides (a disaggregated prefill's KV, which a "
                "decode engine waits for: written first, never dropped for queue_depth or queue_bytes; past "
                "this, dropped and counted as handoff_budget)"})
    workers: int = dataclasses.field(default=1, metadata={"help": "threads writing to this tier (1-64)"})
    retry_seconds: float = dataclasses.field(default=1.0, metadata={
        "help": "after a failed call the tier rests this long (reads miss, writes drop), doubling up to 30 s"})
    name: str | None = dataclasses.field(default=None, metadata={
        "help": "the tier's name in metrics, placement rules and --tier (1-64 letters, digits, _ . -); "
                "null: the type; names must differ"})
    codec: str = dataclasses.field(default="none", metadata={
        "help": "how this tier stores KV: none (as it is), lossless (byte planes + zstandard; exact), fp8 (keys "
                "and values in float8 e4m3, scaled: about half the bytes, lossy), k16v8 (keys as they are, values "
                "in fp8: about three quarters, lossy); encoded on the cascade writer threads"})
    accept_codecs: list[str] = dataclasses.field(default_factory=list, metadata={
        "help": "lossy codecs this tier's reads accept besides its own codec (none and lossless, being exact, "
                "always are): an object stored with any other is a miss, left in place, counted"})

    def check(self, field: str) -> None:
        if not 1 <= self.queue_depth <= _MAX_QUEUE_DEPTH:
            raise ConfigError(f"{field}.queue_depth: must be in [1, {_MAX_QUEUE_DEPTH}], got {self.queue_depth}")
        for name in ("queue_bytes", "handoff_queue_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{field}.{name}: must be positive, got {getattr(self, name)}")
        if not 1 <= self.workers <= _MAX_WORKERS:
            raise ConfigError(f"{field}.workers: must be in [1, {_MAX_WORKERS}], got {self.workers}")
        if self.retry_seconds < 0:
            raise ConfigError(f"{field}.retry_seconds: must be >= 0, got {self.retry_seconds}")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ConfigError(f"{field}.name: 1-64 letters, digits, '_', '.' or '-', got {self.name!r}")


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """The whole store: chunking, the DRAM tier and the ordered secondary tiers."""

    chunk_tokens: int = dataclasses.field(default=256, metadata={
        "help": "tokens per chunk, 1 to 2**20 (a multiple of the engine's block size)"})
    dram: DramConfig = dataclasses.field(default=DramConfig(), metadata={"help": "the primary tier, in host memory"})
    tiers: tuple[TierSpec, ...] = dataclasses.field(default=(), metadata={
        "help": "secondary tiers, in lookup order; every chunk is cascaded to each"})
    metrics_port: int | None = dataclasses.field(default=None, metadata={
        "help": "serve Prometheus metrics on metrics_host:PORT (taken: the next free of 8); null: not served"})
    metrics_host: str = dataclasses.field(default="127.0.0.1", metadata={
        "help": "the address metrics_port listens on (0.0.0.0: every interface, e.g. in a pod)"})
    otlp_traces_endpoint: str | None = dataclasses.field(default=None, metadata={
        "help": "OTLP/HTTP collector URL for kvtier's spans (needs kvtier[tracing]); null: no traces"})
    placement: tuple[PlacementRule, ...] = dataclasses.field(default=(), metadata={
        "help": "which secondary tiers a tenant's KV may reach; the first matching rule decides (kvtier.placement)"})
    audit_log: str | None = dataclasses.field(default=None, metadata={
        "help": "absolute path of an append-only log: kvtier's commands record who removed what (kvtier.audit)"})
    encryption: EncryptionConfig | None = dataclasses.field(default=None, metadata={
        "help": "seal every object the secondary tiers hold (needs kvtier[encryption]; kvtier.sealing)"})
    admission: AdmissionConfig = dataclasses.field(default=AdmissionConfig(), metadata={
        "help": "which prefixes are stored (kvtier.store.admission); default: every put"})


_TOP_KEYS = ("chunk_tokens", "dram", "tiers", "metrics_port", "metrics_host", "otlp_traces_endpoint", "placement",
             "audit_log", "encryption", "admission")


def check_otlp_endpoint(value: object, field: str) -> str | None:
    """An OTLP/HTTP traces endpoint (``http://collector:4318/v1/traces``), or None."""
    if value is None:
        return None
    parts = urllib.parse.urlsplit(value) if isinstance(value, str) else None
    if not isinstance(value, str) or parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{field}: expected an OTLP/HTTP URL such as http://collector:4318/v1/traces, got "
                          f"{shown(field, value)}")
    check_url_port(value, field)
    return value


def _parse_tier(raw: object, index: int, seen: set[str]) -> TierSpec:
    field = f"tiers[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{field}: expected a mapping with a 'type' key, got {shown(field, raw)}")
    if "type" not in raw or not isinstance(raw["type"], str):
        raise ConfigError(f"{field}.type: required, a tier type name")
    common_keys = {f.name for f in dataclasses.fields(_TierCommon)}
    accept = _codec_names(raw.get("accept_codecs", []), f"{field}.accept_codecs")
    common = build_dataclass(_TierCommon, {k: v for k, v in raw.items() if k in common_keys - {"accept_codecs"}},
                             field)
    codec = codecs.by_name(common.codec, f"{field}.codec")
    name = common.name or raw["type"]
    if name in seen or name == "dram":
        raise ConfigError(f"{field}.name: tier name {name!r} is used twice; give each tier a distinct 'name'")
    seen.add(name)
    options = {k: v for k, v in raw.items() if k not in common_keys | {"type"}}
    return TierSpec(type=raw["type"], name=name, options=options, queue_depth=common.queue_depth,
                    queue_bytes=common.queue_bytes, handoff_queue_bytes=common.handoff_queue_bytes,
                    workers=common.workers, retry_seconds=common.retry_seconds,
                    codec=codec, accept_codecs=accept)


def _codec_names(value: object, field: str) -> tuple[codecs.Codec, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{field}: expected a list of codec names ({', '.join(sorted(codecs.CODECS))}), got "
                          f"{shown(field, value)}")
    return tuple(codecs.by_name(name, f"{field}[{i}]") for i, name in enumerate(value))


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without aliases (``*name``): an alias stands for its anchor's whole value, so a few lines can stand for
    billions of values (the "billion laughs"), and an error message quoting one would never end."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "YAML aliases (*name) are not accepted: write the "
                                              "value out", self.peek_event().start_mark)
        return super().compose_node(parent, index)


def read_yaml(path: str | os.PathLike[str], what: str) -> object:
    """A YAML file's document, without aliases; a syntax error says where (line, column), never the text
    there, which may hold a secret (a URL's password, a token)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc}") from exc
    try:
        return yaml.load(text, Loader=_NoAliasLoader) or {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        # PyYAML's own words, but what they quote of the text (a token, a tag) goes
        problem = re.sub(r"'[^']{3,}'|\"[^\"]{3,}\"", "'...'", exc.problem or "")
        raise ConfigError(f"{what} file {path} is not valid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} file {path} is not valid YAML ({type(exc).__name__})") from None


def read_mapping(source: Mapping[str, object] | str | os.PathLike[str], what: str,
                 allowed: Sequence[str]) -> Mapping[str, object]:
    """A config mapping as given, or read from a YAML file; refused unless a mapping of ``allowed`` keys only.
    ``what`` names the config in errors ("config", "router config", ...)."""
    raw = read_yaml(source, what) if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{what}: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(map(str, set(raw) - set(allowed)))
    if unknown:
        raise ConfigError(unknown_key("", unknown[0], allowed))
    return raw


def load_config(cfg: Mapping[str, object] | str | os.PathLike[str] | None) -> StoreConfig:
    """Validate a config mapping, or read one from a YAML file (``$KVTIER_CONFIG`` when ``cfg`` is None)."""
    if cfg is None:
        env = os.environ.get(CONFIG_ENV)
        if not env:
            raise ConfigError(f"no config given and ${CONFIG_ENV} is not set")
        cfg = env
    cfg = read_mapping(cfg, "config", _TOP_KEYS)
    chunk_tokens = CONFIG_FIELDS.typed(int, cfg.get("chunk_tokens", 256), "chunk_tokens", size=False)
    assert isinstance(chunk_tokens, int)
    if not 1 <= chunk_tokens <= 2**20:
        raise ConfigError(f"chunk_tokens: must be an integer in [1, {2**20}], got {chunk_tokens}")
    dram = build_dataclass(DramConfig, cfg.get("dram", {}) or {}, "dram")
    raw_tiers = cfg.get("tiers", []) or []
    if not isinstance(raw_tiers, list):
        raise ConfigError(f"tiers: expected a list of tier mappings, got {type(raw_tiers).__name__}")
    seen: set[str] = set()
    tiers = tuple(_parse_tier(raw, i, seen) for i, raw in enumerate(raw_tiers))
    metrics_port = CONFIG_FIELDS.typed(int | None, cfg.get("metrics_port"), "metrics_port", size=False)
    assert metrics_port is None or isinstance(metrics_port, int), "typed as int | None"
    if metrics_port is not None and not 1 <= metrics_port <= 65535:
        raise ConfigError(f"metrics_port: must be a TCP port in [1, 65535], got {metrics_port}")
    metrics_host = cfg.get("metrics_host", "127.0.0.1")
    if not isinstance(metrics_host, str) or not re.fullmatch(r"[A-Za-z0-9.:-]{1,253}", metrics_host):
        raise ConfigError(f"metrics_host: an address to serve metrics on (127.0.0.1, 0.0.0.0, a host name), got "
                          f"{shown('metrics_host', metrics_host)}")
    traces = check_otlp_endpoint(cfg.get("otlp_traces_endpoint"), "otlp_traces_endpoint")
    placement = parse_placement(cfg.get("placement"), [t.name for t in tiers])
    audit_log = cfg.get("audit_log")
    if audit_log is not None and (not isinstance(audit_log, str) or not audit_log.startswith("/")):
        raise ConfigError(f"audit_log: an absolute path to an append-only log file, got {audit_log!r}")
    encryption = None
    if cfg.get("encryption") is not None:  # kvtier.sealing needs the encryption extra: a plain install loads too
        try:
            from kvtier.sealing import parse_encryption
        except ImportError as exc:
            raise ConfigError(f"encryption: needs the cryptography package (pip install 'kvtier[encryption]'): "
                              f"{exc}") from exc
        encryption = parse_encryption(cfg["encryption"])
    admission = build_dataclass(AdmissionConfig, cfg.get("admission", {}) or {}, "admission")
    return StoreConfig(chunk_tokens=chunk_tokens, dram=dram, tiers=tiers, metrics_port=metrics_port,
                       metrics_host=metrics_host, otlp_traces_endpoint=traces, placement=placement,
                       audit_log=audit_log, encryption=encryption, admission=admission)
