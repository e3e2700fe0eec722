"""The ``kubernetes`` discovery source: a Service's EndpointSlices through the Kubernetes API (docs/fleet.md).

:class:`KubernetesSource` lists the Service's EndpointSlices with the official ``kubernetes`` client, then watches
them from that list's resourceVersion, on a thread of its own (the client blocks). Engines are the endpoints that
are ready and not terminating (a missing ``ready`` condition counts as ready, as the API defines it), of the
IPv4 slices or the IPv6 ones (``address_family``; ``prefer_ipv4``: IPv6 only for a Service without IPv4 slices).

- A watch that expired (410) is listed again; one the API ended early without an event (a proxy closing
  streams) is watched again. Both wait first, from 0.2 s doubling up to ``interval_s`` while they repeat, and
  are counted: a misbehaving API is never asked in a tight loop.
- An API that fails (an error, a refused or reset connection, a rejected token) keeps the engines found and is
  listed again after ``interval_s``.
- A watch is asked to end every :data:`_WATCH_S`, and a read waits at most :data:`_READ_S`: a connection that
  went silent (half open) is noticed within that.
- The engines seen are handed to the event loop, where changes within :data:`_SETTLE_S` are applied as one (an
  endpoint moved from one slice to another is not a leave and a join).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.router.config import DiscoveryConfig, EngineConfig
from kvtier.router.sources import NAME, Source, engine_name, extra, family
from kvtier.router.metrics import LogOnce

_WATCH_S = 30  # a watch asked to end after this long (then watched again from where it was)
_READ_S = 45  # the longest one read of a watch waits for bytes
_SETTLE_S = 0.2  # changes the watch reports within this long are applied as one
_FIRST_WAIT_S = 0.2  # the first wait before watching or listing again after a 410 or an early end
_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class _EndedEarly(Exception):
    """The API ended a watch within a second, without an event."""


class KubernetesSource(Source):
    """The ready endpoints of ``service``'s EndpointSlices, listed and then watched on a thread of its own."""

    def __init__(self, config: DiscoveryConfig, field: str, changed: Callable[[], None], errors: LogOnce) -> None:
        super().__init__(config, field, changed, errors)
        kubernetes = extra("kubernetes", field)
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
        self._pending: list[EngineConfig] | None = None  # the latest engines the thread reported, not yet applied
        self._settling = False

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

    # --- the thread ----------------------------------------------------------------------------------------
    def _follow(self) -> None:
        """List, watch from the list's version, and list again when the watch expired; on an API failure wait
        ``interval_s`` and start over (the engines found are kept meanwhile)."""
        from kubernetes.client.exceptions import ApiException

        wait = 0.0
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                self._list_and_watch()
            except ApiException as exc:
                if exc.status != 410:
                    self._failed(f"HTTP {exc.status} {exc.reason}")
                    wait = self.config.interval_s
                else:  # the version watched from is gone (a compaction, an API server restart): listed again
                    self._errors("expired", "discovery %s: the watch of %s/%s expired (410): listed again",
                                 self.field, self.namespace, self.config.service)
                    wait = self._backoff(wait, began)
            except _EndedEarly:
                self._errors("watch_ended", "discovery %s: the Kubernetes API ended a watch of %s/%s at once: "
                             "watched again after a wait", self.field, self.namespace, self.config.service)
                wait = self._backoff(wait, began)
            except Exception as exc:  # noqa: BLE001 a connection refused or reset, a timeout, a bad answer
                self._failed(repr(exc))
                wait = self.config.interval_s
            self._stopping.wait(wait)

    def _backoff(self, wait: float, began: float) -> float:
        """The wait after a 410 or an early end: from :data:`_FIRST_WAIT_S`, doubled while they repeat (the last
        round under a minute), up to ``interval_s``."""
        if time.monotonic() - began > 60 or wait == 0:
            return min(_FIRST_WAIT_S, self.config.interval_s)
        return min(self.config.interval_s, wait * 2)

    def _failed(self, why: str) -> None:
        if not self._stopping.is_set():
            self._errors("kubernetes", "discovery %s: the Kubernetes API failed for EndpointSlices of %s/%s (the "
                         "engines found are kept, listed again in %g s): %s", self.field, self.namespace,
                         self.config.service, self.config.interval_s, why)
            self._report(None)

    def _list_and_watch(self) -> None:
        from kubernetes import watch

        selector = f"kubernetes.io/service-name={self.config.service}"
        listed = self._api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector,
                                                          _request_timeout=(5, _READ_S))
        self._slices = {s.metadata.name: s for s in listed.items}
        self._report(self._slices)
        version = listed.metadata.resource_version
        while not self._stopping.is_set():
            self._watch = w = watch.Watch()
            began, events = time.monotonic(), 0
            for event in w.stream(self._api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                                  resource_version=version, allow_watch_bookmarks=True, timeout_seconds=_WATCH_S,
                                  _request_timeout=(5, _READ_S)):
                # (an ERROR event, such as 410 for a version no longer kept, is raised by the client)
                kind, obj = event["type"], event["object"]
                events += 1
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[obj.metadata.name] = obj
                elif kind == "DELETED":
                    self._slices.pop(obj.metadata.name, None)
                if kind != "BOOKMARK":
                    self._report(self._slices)
            version = w.resource_version or version
            if not events and time.monotonic() - began < 1 and not self._stopping.is_set():
                raise _EndedEarly

    def _report(self, slices: Mapping[str, Any] | None) -> None:
        """Hand the engines of ``slices`` (None: no answer) to the event loop."""
        engines = None if slices is None else self.engines_of(slices.values())
        loop = self._loop
        if loop is None or self._stopping.is_set():
            return
        try:
            loop.call_soon_threadsafe(self._arrived, engines)
        except RuntimeError:  # the loop closed: the router stopped
            pass

    # --- on the event loop ---------------------------------------------------------------------------------
    def _arrived(self, engines: list[EngineConfig] | None) -> None:
        if engines is None:
            self.answered.set()
            return
        if not self.answered.is_set():  # the first list: applied at once (the router waits for it to listen)
            self._set(engines)
            return
        self._pending = engines
        if not self._settling:
            self._settling = True
            asyncio.get_running_loop().call_later(_SETTLE_S, self._settled)

    def _settled(self) -> None:
        self._settling = False
        if self._pending is not None and not self._stopping.is_set():
            engines, self._pending = self._pending, None
            self._set(engines)

    # --- reading slices ------------------------------------------------------------------------------------
    def engines_of(self, slices: Iterable[Any]) -> list[EngineConfig]:
        """The ready, not terminating endpoints of ``slices`` of the address family wanted, each an engine (one in
        two slices, as during a move, once: by name, the first in the slices' name order)."""
        slices = sorted(slices, key=lambda s: s.metadata.name or "")
        v4 = any(s.address_type == "IPv4" and s.endpoints for s in slices)
        want = {"ipv4": "IPv4", "ipv6": "IPv6", "prefer_ipv4": "IPv4" if v4 else "IPv6"}[self.config.address_family]
        found: dict[str, tuple[str, str, Mapping[str, int | None]]] = {}
        for s in slices:
            if s.address_type != want:
                continue
            ports = self._ports(s)
            if ports is None:
                continue
            for endpoint in s.endpoints or ():
                conditions = endpoint.conditions
                if conditions is not None and (conditions.ready is False or conditions.terminating is True):
                    continue
                for address in endpoint.addresses[:1]:  # (the API gives one; more are the same endpoint)
                    if family(address) != int(want[-1]):
                        continue  # an FQDN slice's, or not of the slice's family: not an engine's address
                    ref = endpoint.target_ref
                    name = ref.name if ref is not None and ref.kind == "Pod" and ref.name else endpoint.hostname
                    if not name or not NAME.fullmatch(name):  # (a pod name may be 253 characters)
                        name = engine_name(self.config.service or "engine", address)
                    found.setdefault(name, (name, address, ports))
        return self._engines(found.values())

    def _ports(self, endpoint_slice: Any) -> dict[str, int | None] | None:
        """The slice's API, events and replay ports; None (counted) when it lacks one configured."""
        ports = {kind: self._port(endpoint_slice, value) for kind, value in (
            ("api", self.config.port), ("events", self.config.kv_events_port),
            ("replay", self.config.kv_events_replay_port))}
        for kind, value in (("api", self.config.port), ("events", self.config.kv_events_port),
                            ("replay", self.config.kv_events_replay_port)):
            if value is not None and ports[kind] is None:
                self._errors("port", "discovery %s: EndpointSlice %s has no port %r: its endpoints are not "
                             "engines", self.field, endpoint_slice.metadata.name, value)
                return None
        return ports

    @staticmethod
    def _port(endpoint_slice: Any, value: int | str | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        for port in endpoint_slice.ports or ():
            if port.name == value and port.port:
                return int(port.port)
        return None


def _pod_namespace() -> str | None:
    try:
        with open(_SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
