"""docs/reference/configuration.md, router-configuration.md and fleet-configuration.md: every key of a store config,
a router config and a fleet file, read from the dataclasses each is validated into (:mod:`kvtier.config`, each
tier type's ``Options``, :mod:`kvtier.placement`, :mod:`kvtier.sealing`; :mod:`kvtier.router.config`;
:mod:`kvtier.fleet.config`).

A key's YAML path, type and default come from its dataclass field; its description is the field's one-line
``metadata["help"]``; its allowed values from a ``Literal`` type or, for names, from the registry that resolves
them. A field whose YAML form is not its Python type says so in ``metadata["yaml"]``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from kvtier import config
from kvtier.docs import _markdown as md
from kvtier.eviction import POLICIES
from kvtier.fleet.config import FleetFile, Pools, Ports, PrometheusConfig, RedisConfig
from kvtier.placement import PlacementRule
from kvtier.registry import Registry
from kvtier.router.config import (DEFAULT_LISTEN, Costs, DiscoveryConfig, EngineConfig, EventLimits, Limits,
                                  PDConfig, RouterConfig, Timeouts)
from kvtier.sealing import EncryptionConfig
from kvtier.tiers import TIERS

_PLUGIN = "package.module:Class"
# Keys whose value is a name that a registry resolves (or a plugin's module path).
_NAMED: dict[str, Registry[Any]] = {"dram.eviction": POLICIES, "tiers[].type": TIERS}
_HINT_NAMES = {"EncryptionConfig": EncryptionConfig, "PlacementRule": PlacementRule}
_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


@dataclasses.dataclass(frozen=True)
class Key:
    """One documented config key."""

    path: str  # as written in YAML: dram.capacity_bytes, tiers[].queue_depth
    type: str
    default: str
    allowed: str
    help: str


@dataclasses.dataclass(frozen=True)
class Section:
    """The keys of one mapping of the config: ``cls``'s fields (those in ``only``, when given) under ``prefix``."""

    title: str
    prefix: str
    cls: type[Any]  # a dataclass
    intro: str = ""
    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()  # fields written otherwise in YAML (see ``extra``)
    extra: tuple[Key, ...] = ()  # keys that are no field of ``cls``, listed first

    def fields(self) -> list[dataclasses.Field[Any]]:
        return [f for f in dataclasses.fields(self.cls)
                if f.init and (not self.only or f.name in self.only) and f.name not in self.skip]


def sections() -> list[Section]:
    """Every mapping of a store config, in the order the page lists them."""
    found = [
        Section("Top level", "", config.StoreConfig),
        Section("`dram`", "dram.", config.DramConfig, "The primary tier: a preallocated pool of host memory."),
        Section("`tiers[]`", "tiers[].", config.TierSpec, "Each secondary tier: its `type`, the keys every type "
                "takes, and the keys of its type (below).", only=("type",)),
        Section("`tiers[]`, every type", "tiers[].", config._TierCommon),
    ]
    for name in TIERS.names():
        options = TIERS.resolve(name, "tiers[].type").Options
        found.append(Section(f"`tiers[]` with `type: {name}`", "tiers[].", options, _first_line(options)))
    found += [
        Section("`placement[]`", "placement[].", PlacementRule, "Rules of which secondary tiers a tenant's KV may "
                "reach, tried in order: the first that matches a request decides."),
        Section("`encryption`", "encryption.", EncryptionConfig, "Seal every object in the secondary tiers "
                "(needs `kvtier[encryption]`)."),
        Section("`admission`", "admission.", config.AdmissionConfig, "Which prefixes are stored: with "
                "`store_after: 2` a prefix is stored once it comes again, so prompts that never return cost no "
                "copies or cascade writes."),
    ]
    return found


def router_sections() -> list[Section]:
    """Every mapping of a router config (``kvtier router --config``)."""
    listen = Key(path="listen", type="host:port", default=md.code(DEFAULT_LISTEN), allowed="",
                 help="where the router answers clients (0.0.0.0:PORT: every interface)")
    return [
        Section("Top level", "", RouterConfig, skip=("host", "port"), extra=(listen,)),
        Section("`engines[]`", "engines[].", EngineConfig, _first_line(EngineConfig)),
        Section("`discovery[]`", "discovery[].", DiscoveryConfig, "Engines found while serving (docs/fleet.md): "
                "each address a source gives is an engine of this role and weight, reached at these ports."),
        Section("`timeouts`", "timeouts.", Timeouts, "The router's calls to the engines."),
        Section("`costs`", "costs.", Costs, _first_line(Costs)),
        Section("`limits`", "limits.", Limits, _first_line(Limits)),
        Section("`events`", "events.", EventLimits, _first_line(EventLimits)),
        Section("`pd`", "pd.", PDConfig, "Disaggregated prefill and decode, for engines with `role: prefill` or "
                "`role: decode` (docs/pd.md)."),
    ]


def fleet_sections() -> list[Section]:
    """Every mapping of a fleet file (``kvtier fleet up``)."""
    return [
        Section("Top level", "", FleetFile),
        Section("`engines` (pools)", "engines.", Pools, "`engines: 2` is two engines that serve whole requests; "
                "`engines: {prefill: 1, decode: 2}` is disaggregated prefill and decode (docs/pd.md), a pool of "
                "engines of each role (at most 64 in all), which need a tier they all reach."),
        Section("`ports`", "ports.", Ports, "The first port of each kind; engine i adds i (or 2i) to it."),
        Section("`redis`", "redis.", RedisConfig, "The Redis the fleet starts (`redis: false`: none)."),
        Section("`prometheus`", "prometheus.", PrometheusConfig,
                "The Prometheus the fleet starts (`prometheus: false`: none)."),
    ]


def all_sections() -> list[Section]:
    return sections() + router_sections() + fleet_sections()


def keys(section: Section) -> Iterator[Key]:
    yield from section.extra
    hints = typing.get_type_hints(section.cls, localns=_HINT_NAMES)
    for f in section.fields():
        path = section.prefix + f.name
        registry = _NAMED.get(path)
        yield Key(path=path, type=f.metadata.get("yaml") or _type(hints[f.name], f.name), default=_default(f),
                  allowed=_allowed(hints[f.name], registry), help=f.metadata.get("help", ""))


def _tables(found: list[Section]) -> list[str]:
    parts = []
    for section in found:
        rows = [[md.code(k.path), md.text(k.type), k.default, k.allowed, md.text(k.help)] for k in keys(section)]
        intro = f"{md.text(section.intro)}\n\n" if section.intro else ""
        parts.append(f"## {section.title}\n\n{intro}"
                     + md.table(["Key", "Type", "Default", "Allowed values", "Description"], rows))
    return parts


def render_router() -> str:
    intro = """
The YAML file of `kvtier router --config FILE` (and the `router:` mapping of a fleet file, less the keys the fleet
sets). Unknown keys and values out of range are a `ConfigError` naming the key (`engines[1].url`). A minimal one:

```yaml
listen: 127.0.0.1:8000
tokenizer: /models/llama-3-8b
engines:
  - {name: e0, url: "http://10.0.0.1:8000", kv_events: "tcp://10.0.0.1:5557"}
```
"""
    return md.page("Router configuration reference", intro, _tables(router_sections()))


def render_fleet() -> str:
    intro = """
The YAML file of `kvtier fleet up FILE`: a whole fleet on one host (engines, router, Redis, Prometheus). Paths are
relative to the file. Unknown keys and values out of range are a `ConfigError` naming the key, found before
anything starts. Only `model` is required.
"""
    return md.page("Fleet configuration reference", intro, _tables(fleet_sections()))


def render() -> str:
    parts = _tables(sections())
    intro = """
A store config is a mapping or a YAML file: `kvtier ... --config FILE`, `$KVTIER_CONFIG`, or the vLLM connector's
`kv_connector_extra_config: {"config": ...}`. Unknown keys, wrong types and unknown names are a `ConfigError` naming
the key (`tiers[0].capacity_bytes`). Byte sizes take an integer or a number with a unit (`512MiB`, `4GB`). Names of
the form `package.module:Class` import that module: a config is code, trust it like code.
"""
    return md.page("Configuration reference", intro, parts)


def _first_line(cls: type) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""


def _type(tp: Any, name: str) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a, name) for a in args if a is not type(None)) + (
            " or null" if type(None) in args else "")
    if origin is Literal:
        return "string"
    if origin is tuple:
        return f"list of {_type(args[0], name)}s"
    if (origin is not None and issubclass(origin, Mapping)) or dataclasses.is_dataclass(tp):
        return "mapping"
    if tp is int:
        return "byte size" if name.endswith("_bytes") else "integer"
    return {float: "number", bool: "boolean", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _allowed(tp: Any, registry: Registry[Any] | None) -> str:
    if registry is not None:
        return ", ".join(md.code(n) for n in [*registry.names(), _PLUGIN])
    literals = [a for arg in (typing.get_args(tp) or (tp,)) if typing.get_origin(arg) is Literal
                for a in typing.get_args(arg)]
    if typing.get_origin(tp) is Literal:
        literals = list(typing.get_args(tp))
    return ", ".join(md.code(a) for a in literals)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(its keys' defaults)"
    return md.code(yaml_value(value, f.name.endswith("_bytes")))


def yaml_value(value: object, size: bool = False) -> str:
    """How a default is written in YAML: ``null``, ``true``, ``4GiB`` (a byte size in the largest exact unit)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if size and isinstance(value, int) and value:
        unit, scale = next(((u, s) for u, s in _UNITS if value % s == 0), ("", 1))
        return f"{value // scale}{unit}"
    if isinstance(value, str):
        return value if value and value.strip() == value and not value.endswith(":") else json.dumps(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)
