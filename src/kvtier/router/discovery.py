"""Engines found while serving: the router config's ``discovery`` sources (docs/fleet.md).

Each source keeps the engines it sees now, as :class:`~kvtier.router.config.EngineConfig` of its role, weight and
ports, and calls ``changed`` when they change; :class:`Discovery` merges them with the config file's engines into
the fleet that :meth:`~kvtier.router.engines.Engines.update` applies (new engines join once replayed and healthy;
gone ones leave, their index entries cleared at once).

- :class:`DnsSource` asks for the A and AAAA records of a name (a Kubernetes headless Service's) every
  ``interval_s``. An answer, NXDOMAIN included, is the fleet; a failure to get one (a timeout, SERVFAIL) keeps the
  engines it had.
- :class:`KubernetesSource` lists a Service's EndpointSlices through the Kubernetes API with the official
  ``kubernetes`` client, then watches them from that list's resourceVersion, on a thread of its own (the client
  blocks); a watch that expired (410) lists again, and an API that fails keeps the engines it had and is watched
  again after ``interval_s``. Only ready endpoints are engines (a missing ``ready`` condition counts as ready,
  as the API defines it).

An engine's name is its pod's (Kubernetes), else ``LABEL-ADDRESS`` (the name's first label and the address, its
dots and colons as dashes). An engine whose address changed is another engine (its cache is not the old one's).
"""

from __future__ import annotations

import asyncio
import importlib
import ipaddress
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.router.config import DiscoveryConfig, EngineConfig
from kvtier.router.metrics import LogOnce

log = logging.getLogger(__name__)

_FIRST_LOOK_S = 10.0  # the longest the router waits at start for a source's first answer
_WATCH_S = 60  # a Kubernetes watch asked to end after this long (then watched again from where it was)


def engine_name(label: str, address: str) -> str:
    """``LABEL-ADDRESS``, within the 64 characters an engine's name may take."""
    suffix = re.sub(r"[.:%]", "-", address)
    return f"{label[:63 - len(suffix)]}-{suffix}"


def engine_at(source: DiscoveryConfig, name: str, address: str, ports: Mapping[str, int | None]) -> EngineConfig:
    """The engine of ``source`` at ``address`` (``ports``: api, events, replay)."""
    host = f"[{address}]" if ":" in address else address
    events, replay = ports.get("events"), ports.get("replay")
    return EngineConfig(name=name, url=f"{source.scheme}://{host}:{ports['api']}",
                        kv_events=f"tcp://{host}:{events}" if events else None,
                        kv_events_replay=f"tcp://{host}:{replay}" if events and replay else None,
                        weight=source.weight, role=source.role)


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
        found = {e.name: e for e in engines}
        self.answered.set()
        if found != self.engines:
            self.engines = found
            self._changed()

    async def run(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Called once, from the event loop, before the task running :meth:`run` is cancelled."""


class DnsSource(Source):
    """The A and AAAA records of ``name``, asked every ``interval_s``."""

    def __init__(self, config: DiscoveryConfig, field: str, changed: Callable[[], None], errors: LogOnce) -> None:
        super().__init__(config, field, changed, errors)
        resolvers = _extra("dns.asyncresolver", field)
        self._resolver = resolvers.Resolver(configure=config.nameserver is None)
        if config.nameserver is not None:
            host, _, port = config.nameserver.rpartition(":")
            self._resolver.nameservers = [host.strip("[]")]
            self._resolver.port = int(port)
        self._resolver.lifetime = min(5.0, config.interval_s)
        assert config.name is not None  # (checked by the config)
        self._label = config.name.split(".", 1)[0]

    async def lookup(self) -> list[str] | None:
        """The name's addresses (empty: it has none, or does not exist); None when no answer came."""
        import dns.exception  # (imported by the constructor: installed)
        import dns.resolver

        addresses: list[str] = []
        for kind in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(self.config.name, kind, search=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as exc:
                self._errors("dns", "discovery %s: no answer for %s %s (the engines it found are kept): %s",
                             self.field, self.config.name, kind, exc)
                return None
            addresses += [r.address for r in answer]
        return addresses

    async def run(self) -> None:
        ports: dict[str, int | None] = {}  # (numbers: a dns source's ports are, by its config's check)
        for kind, value in (("api", self.config.port), ("events", self.config.kv_events_port),
                            ("replay", self.config.kv_events_replay_port)):
            assert value is None or isinstance(value, int)
            ports[kind] = value
        while True:
            addresses = await self.lookup()
            if addresses is None:
                self.answered.set()
            else:
                self._set(engine_at(self.config, engine_name(self._label, a), a, ports)
                          for a in sorted(set(addresses)))
            await asyncio.sleep(self.config.interval_s)


class KubernetesSource(Source):
    """The ready endpoints of ``service``'s EndpointSlices, listed and then watched on a thread of its own."""

    def __init__(self, config: DiscoveryConfig, field: str, changed: Callable[[], None], errors: LogOnce) -> None:
        super().__init__(config, field, changed, errors)
        kubernetes = _extra("kubernetes", field)
        client, kube_config = kubernetes.client, kubernetes.config
        api_client = client.ApiClient(configuration=client.Configuration())
        try:
            if config.kubeconfig is not None:
                kube_config.load_kube_config(config_file=config.kubeconfig,
                                             client_configuration=api_client.configuration)
                namespace = kube_config.list_kube_config_contexts(config.kubeconfig)[1]["context"].get("namespace")
            else:
                kube_config.load_incluster_config(client_configuration=api_client.configuration)
                namespace = _pod_namespace()
        except (kube_config.ConfigException, OSError, TypeError, KeyError, ValueError) as exc:
            where = (f"{field}.kubeconfig: {config.kubeconfig!r} is not a usable kubeconfig" if config.kubeconfig
                     else f"{field}: not in a Kubernetes pod with a service account (give kubeconfig)")
            raise ConfigError(f"{where}: {exc}") from None
        self.namespace = config.namespace or namespace or "default"
        self._client = api_client
        self._api = client.DiscoveryV1Api(api_client)
        self._stopping = threading.Event()
        self._slices: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: Any = None

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        thread = threading.Thread(target=self._follow, name=f"kvtier-discovery-{self.config.service}", daemon=True)
        thread.start()
        await asyncio.Event().wait()  # until cancelled: the thread reports through the loop

    def stop(self) -> None:
        self._stopping.set()
        w = self._watch
        if w is not None:
            w.stop()
            response = getattr(w, "_resp", None)  # the watch's response: its socket shut, a blocked read ends
            if response is not None and hasattr(response, "shutdown"):
                response.shutdown()
        self._client.rest_client.pool_manager.clear()

    def _follow(self) -> None:
        """The thread: list, watch from the list's version, list again when the watch expired; on an API failure
        wait ``interval_s`` and start over (the engines found are kept meanwhile)."""
        from kubernetes.client.exceptions import ApiException

        while not self._stopping.is_set():
            try:
                self._list_and_watch()
            except ApiException as exc:
                if exc.status == 410:
                    continue  # the version watched from is gone: list again
                self._failed(f"HTTP {exc.status} {exc.reason}")
            except Exception as exc:  # noqa: BLE001 a connection refused or reset, a timeout, a bad answer
                self._failed(repr(exc))
            else:
                continue
            self._stopping.wait(self.config.interval_s)

    def _failed(self, why: str) -> None:
        if not self._stopping.is_set():
            self._errors("kubernetes", "discovery %s: the Kubernetes API failed for EndpointSlices of %s/%s (the "
                         "engines found are kept, watched again in %g s): %s", self.field, self.namespace,
                         self.config.service, self.config.interval_s, why)
            self._report(None)

    def _list_and_watch(self) -> None:
        from kubernetes import watch

        selector = f"kubernetes.io/service-name={self.config.service}"
        listed = self._api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector,
                                                          _request_timeout=(5, 30))
        self._slices = {s.metadata.name: s for s in listed.items}
        self._report(self._slices)
        version = listed.metadata.resource_version
        while not self._stopping.is_set():
            self._watch = w = watch.Watch()
            for event in w.stream(self._api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                                  resource_version=version, allow_watch_bookmarks=True, timeout_seconds=_WATCH_S,
                                  _request_timeout=(5, _WATCH_S + 30)):
                # (an ERROR event, such as 410 for a version no longer kept, is raised by the client)
                kind, obj = event["type"], event["object"]
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[obj.metadata.name] = obj
                elif kind == "DELETED":
                    self._slices.pop(obj.metadata.name, None)
                if kind != "BOOKMARK":
                    self._report(self._slices)
            version = w.resource_version or version

    def _report(self, slices: Mapping[str, Any] | None) -> None:
        """Hand the engines of ``slices`` (None: no answer) to the event loop."""
        engines = None if slices is None else self.engines_of(slices.values())
        loop = self._loop
        if loop is None or self._stopping.is_set():
            return
        try:
            loop.call_soon_threadsafe(self._apply, engines)
        except RuntimeError:  # the loop closed: the router stopped
            pass

    def _apply(self, engines: list[EngineConfig] | None) -> None:
        if engines is None:
            self.answered.set()
        else:
            self._set(engines)

    def engines_of(self, slices: Iterable[Any]) -> list[EngineConfig]:
        """The ready endpoints of ``slices``, each an engine (an address in two slices, as during a move, once)."""
        found: dict[str, EngineConfig] = {}
        for s in slices:
            ports = {kind: self._port(s, value) for kind, value in (
                ("api", self.config.port), ("events", self.config.kv_events_port),
                ("replay", self.config.kv_events_replay_port))}
            if ports["api"] is None or (self.config.kv_events_port is not None and ports["events"] is None):
                self._errors("port", "discovery %s: EndpointSlice %s has no port %r (or %r): its endpoints are "
                             "not engines", self.field, s.metadata.name, self.config.port, self.config.kv_events_port)
                continue
            for endpoint in s.endpoints or ():
                conditions = endpoint.conditions
                if conditions is not None and conditions.ready is False:
                    continue
                for address in endpoint.addresses[:1]:  # (the API gives one; more are the same endpoint)
                    try:
                        ipaddress.ip_address(address)
                    except ValueError:
                        continue  # an FQDN slice's: not an engine's address
                    ref = endpoint.target_ref
                    name = ref.name if ref is not None and ref.kind == "Pod" and ref.name else (
                        endpoint.hostname or engine_name(self.config.service or "engine", address))
                    found.setdefault(name, engine_at(self.config, name, address, ports))
        return list(found.values())

    @staticmethod
    def _port(endpoint_slice: Any, value: int | str | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        for port in endpoint_slice.ports or ():
            if port.name == value and port.port:
                return int(port.port)
        return None


def _extra(module: str, field: str) -> Any:
    """``module`` of the discovery extra; a ConfigError naming ``field`` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{field}.source: needs the discovery extra (pip install 'kvtier[discovery]')") from None


_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _pod_namespace() -> str | None:
    try:
        with open(_SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


SOURCES: dict[str, type[Source]] = {"dns": DnsSource, "kubernetes": KubernetesSource}


class Discovery:
    """The config file's engines and every source's, as one fleet (:meth:`fleet`): an engine named in the file,
    or by an earlier source, keeps its name; a later one under the same name is left out (logged)."""

    def __init__(self, sources: tuple[DiscoveryConfig, ...], changed: Callable[[], None], errors: LogOnce) -> None:
        self.sources = [SOURCES[c.source](c, f"discovery[{i}]", changed, errors) for i, c in enumerate(sources)]
        self._errors = errors
        self._tasks: list[asyncio.Task[None]] = []
        self._clashes: set[tuple[str, str]] = set()  # (source, engine name) left out, as last counted

    async def start(self) -> None:
        """Start every source and wait for each one's first answer (at most :data:`_FIRST_LOOK_S`)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(s.run()) for s in self.sources]
        if self.sources:
            waits = [asyncio.ensure_future(s.answered.wait()) for s in self.sources]
            await asyncio.wait(waits, timeout=_FIRST_LOOK_S)
            for wait in waits:
                wait.cancel()

    async def stop(self) -> None:
        for source in self.sources:
            source.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def fleet(self, configured: tuple[EngineConfig, ...]) -> tuple[EngineConfig, ...]:
        engines = {e.name: e for e in configured}
        clashes = set()
        for source in self.sources:
            for name, engine in source.engines.items():
                if name in engines:
                    if engines[name] != engine:
                        clashes.add((source.field, name))
                    continue
                engines[name] = engine
        for field, name in sorted(clashes - self._clashes):  # (each counted once, not at each look)
            self._errors("name", "discovery %s: engine %s is named already (by the config file or an earlier "
                         "source): left out", field, name)
        self._clashes = clashes
        return tuple(engines.values())
