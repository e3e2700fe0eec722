"""The router's discovery sources (docs/fleet.md): what each kind shares, and the DNS one.

Each source keeps the engines it sees now, as :class:`~kvtier.router.config.EngineConfig` of its role, weight and
ports (each checked as a config file's engine is), and calls ``changed`` when they change;
:class:`~kvtier.router.discovery.Discovery` merges them with the config file's engines into the fleet.

- :class:`DnsSource` asks for the records of a name (a Kubernetes headless Service's) every ``interval_s``: A
  records, or AAAA ones as ``address_family`` says. An answer is the fleet, but an empty one (NXDOMAIN included)
  only once the next answer is empty too: one lost record set (a DNS server restarting) does not empty the
  fleet. A failure to get an answer (a timeout, SERVFAIL) keeps the engines it had.
- :class:`~kvtier.router.discovery_k8s.KubernetesSource` follows a Service's EndpointSlices through the Kubernetes
  API with the official ``kubernetes`` client.

An engine's name is its pod's (Kubernetes, when a valid engine name), else ``LABEL-ADDRESS`` (the name's first
label or the Service, and the address, its dots and colons as dashes). An engine whose address changed is another
engine (its cache is not the old one's). A source finds at most ``max_engines``; an engine named, or at an
address, that the config file or an earlier source has already is left out (counted).
"""

from __future__ import annotations

import asyncio
import importlib
import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.router.config import DiscoveryConfig, EngineConfig
from kvtier.router.metrics import LogOnce


NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # an engine's name (EngineConfig.check)


def engine_name(label: str, address: str) -> str:
    """``LABEL-ADDRESS``, within the 64 characters an engine's name may take."""
    suffix = re.sub(r"[.:%]", "-", address)
    return f"{label[:63 - len(suffix)]}-{suffix}"


def engine_at(source: DiscoveryConfig, name: str, address: str, ports: Mapping[str, int | None]) -> EngineConfig:
    """The engine of ``source`` at ``address`` (``ports``: api, events, replay); raises ConfigError for one a
    config file could not name either (EngineConfig.check)."""
    host = f"[{address}]" if ":" in address else address
    events, replay = ports.get("events"), ports.get("replay")
    if not NAME.fullmatch(name):
        raise ConfigError(f"engine name {name!r}: 1-64 letters, digits, '_', '.' or '-'")
    engine = EngineConfig(name=name, url=f"{source.scheme}://{host}:{ports['api']}",
                          kv_events=f"tcp://{host}:{events}" if events else None,
                          kv_events_replay=f"tcp://{host}:{replay}" if events and replay else None,
                          weight=source.weight, role=source.role)
    engine.check(name)
    return engine


def family(address: str) -> int:
    """4 or 6; 0 for what is not an IP address."""
    try:
        return ipaddress.ip_address(address).version
    except ValueError:
        return 0


class Source:
    """One ``discovery`` entry: the engines it sees now (:attr:`engines`), and ``changed`` called when they do."""

    def __init__(self, config: DiscoveryConfig, field: str, changed: Callable[[], None],
                 errors: LogOnce) -> None:
        self.config = config
        self.field = field
        self.engines: dict[str, EngineConfig] = {}
        self.answered = asyncio.Event()  # the first answer came (or its failure)
        self._changed = changed
        self._errors = errors

    def count(self) -> int:
        return len(self.engines)

    def _set(self, engines: Iterable[EngineConfig]) -> None:
        found: dict[str, EngineConfig] = {}
        for engine in sorted(engines, key=lambda e: e.name):
            if len(found) == self.config.max_engines:
                self._errors("max_engines", "discovery %s: more than max_engines (%d) engines found: the rest "
                             "(by name) left out", self.field, self.config.max_engines)
                break
            found[engine.name] = engine
        self.answered.set()
        if found != self.engines:
            self.engines = found
            self._changed()

    def _engines(self, found: Iterable[tuple[str, str, Mapping[str, int | None]]]) -> list[EngineConfig]:
        """Engines of (name, address, ports); one a config file could not name is left out (counted)."""
        out = []
        for name, address, ports in found:
            try:
                out.append(engine_at(self.config, name, address, ports))
            except ConfigError as exc:
                self._errors("engine", "discovery %s: an engine at %r left out: %s", self.field, address, str(exc))
        return out

    async def run(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Called once, from the event loop, before the task running :meth:`run` is cancelled."""


class DnsSource(Source):
    """The A or AAAA records of ``name``, asked every ``interval_s``."""

    def __init__(self, config: DiscoveryConfig, field: str, changed: Callable[[], None], errors: LogOnce) -> None:
        super().__init__(config, field, changed, errors)
        resolvers = extra("dns.asyncresolver", field)
        self._resolver = resolvers.Resolver(configure=config.nameserver is None)
        if config.nameserver is not None:
            host, _, port = config.nameserver.rpartition(":")
            self._resolver.nameservers = [host.strip("[]")]
            self._resolver.port = int(port)
        self._resolver.lifetime = min(5.0, config.interval_s)
        assert config.name is not None  # (checked by the config)
        self._label = config.name.split(".", 1)[0]
        self._empty = 0  # empty answers in a row

    async def lookup(self) -> list[str] | None:
        """The name's addresses of the family asked for (empty: none, or no such name); None when no answer
        came."""
        import dns.exception  # (imported by the constructor: installed)
        import dns.resolver

        wanted = {"ipv4": ("A",), "ipv6": ("AAAA",), "prefer_ipv4": ("A", "AAAA")}[self.config.address_family]
        for kind in wanted:
            try:
                answer = await self._resolver.resolve(self.config.name, kind, search=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as exc:
                self._errors("dns", "discovery %s: no answer for %s %s (the engines it found are kept): %s",
                             self.field, self.config.name, kind, exc)
                return None
            return [r.address for r in answer]  # (prefer_ipv4: AAAA only when there is no A record)
        return []

    async def run(self) -> None:
        ports: dict[str, int | None] = {}  # (numbers: a dns source's ports are, by its config's check)
        for kind, value in (("api", self.config.port), ("events", self.config.kv_events_port),
                            ("replay", self.config.kv_events_replay_port)):
            assert value is None or isinstance(value, int)
            ports[kind] = value
        while True:
            try:
                addresses = await self.lookup()
            except Exception as exc:  # noqa: BLE001 a resolver's surprise: counted, the engines found kept
                self._errors("dns", "discovery %s: looking up %s failed: %r", self.field, self.config.name, exc)
                addresses = None
            self._empty = self._empty + 1 if addresses == [] else 0
            if addresses is None or (self._empty == 1 and self.engines):
                self.answered.set()  # no answer, or a first empty one: the engines found are kept
            else:
                self._set(self._engines((engine_name(self._label, a), a, ports) for a in sorted(set(addresses))))
            await asyncio.sleep(self.config.interval_s)


def extra(module: str, field: str) -> Any:
    """``module`` of the discovery extra; a ConfigError naming ``field`` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{field}.source: needs the discovery extra (pip install 'kvtier[discovery]')") from None
