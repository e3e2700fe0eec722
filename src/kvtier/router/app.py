"""``kvtier router``: an OpenAI-compatible proxy in front of vLLM API servers (aiohttp, one event loop).

:class:`RouterApp` wires the parts and serves them: :class:`~kvtier.router.proxy.Proxy` (a request from its body
to the engine's last byte: reading, deciding, sending, retrying, streaming), :class:`~kvtier.router.engines.Engines`
(each engine's health, models, KV-event subscriber and prefill calibration, all sent with the engines' API key
when one is configured), and the router's own ``/health`` and ``/metrics``. With ``admin_listen``, ``/metrics``
and ``/health``'s per-engine detail are served on that listener only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier import tracing
from kvtier.errors import ConfigError
from kvtier.router.config import EngineConfig, RouterConfig, load_router_config
from kvtier.router.discovery import Discovery
from kvtier.router.engines import Engines
from kvtier.router.guards import BodyBudget, CappedSite, WorkerPool, descriptor_room, handler_args
from kvtier.router.index import PrefixIndex
from kvtier.router.metrics import LogOnce, RouterMetrics
from kvtier.router.policy import Router
from kvtier.router.prompts import CUTTERS, Tokenizer
from kvtier.router.proxy import Proxy
from kvtier.router.reading import Reader

log = logging.getLogger(__name__)

_ADMIN_CONNECTIONS = 32


class RouterApp:
    """The router: its state (index, policy, engines, worker pool, body budget), listeners and endpoints. Raises
    ConfigError for an engine key that cannot be read."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.metrics.declare([e.name for e in config.engines], [e.name for e in config.engines if e.kv_events],
                             [e.name for e in config.engines if e.role == "prefill"])
        self.index = PrefixIndex(config.block_size, config.events.max_engine_blocks)
        self.router = Router(config, self.index)
        self.metrics.watch([e.name for e in config.engines], self.router.signals)
        self.metrics.fleet.set_function(lambda: len(self.router.engines))
        self.engines = Engines(config, self.metrics, self.index, self.router)  # (reads the engines' key first)
        self.tokenizer = tokenizer if tokenizer is not None else \
            Tokenizer(config.tokenizer, cutters=min(config.limits.workers, CUTTERS))
        self.pool = WorkerPool(config.limits.workers, config.limits.queue)
        self.bodies = BodyBudget(config.limits.max_inflight_body_bytes)
        self.reader = Reader(self.tokenizer, self.router,
                             LogOnce(self.metrics.unpredicted, "kvtier_router_unpredicted_requests", log))
        self.proxy = Proxy(config, self.metrics, self.router, self.engines, self.reader, self.pool, self.bodies)
        self._sites: dict[str, CappedSite] = {}
        self._configured: tuple[EngineConfig, ...] = config.engines  # the config file's, as last read
        self.discovery = Discovery(config.discovery, self._discovered,
                                   LogOnce(self.metrics.discovery_errors, "kvtier_router_discovery_errors", log,
                                           logging.WARNING, every_s=60.0))
        for source in self.discovery.sources:
            self.metrics.discovered.labels(source.field).set_function(source.count)
        self._fleet_lock = asyncio.Lock()  # the fleet is computed and applied by one caller at a time
        self._stale = False  # a source's engines changed since the fleet was last computed
        self._refresher: asyncio.Task[None] | None = None
        self._stopping = False

    async def reload(self, config: RouterConfig) -> tuple[list[str], list[str]]:
        """Make ``config``'s engines the fleet, while serving (:meth:`Engines.update`); its other settings are
        applied at the next restart (logged). The engines (added, removed)."""
        later = [f.name for f in dataclasses.fields(RouterConfig)
                 if f.name != "engines" and getattr(config, f.name) != getattr(self.config, f.name)]
        if later:
            log.warning("router config: %s changed: applied at the next restart (the engines are applied now)",
                        ", ".join(later))
        self._configured = config.engines
        added, removed = await self._apply()
        self.metrics.reloads.labels("applied" if added or removed else "unchanged").inc()
        if added or removed:
            log.info("router config: engines added %s, removed %s", added or "none", removed or "none")
        return added, removed

    async def _apply(self) -> tuple[list[str], list[str]]:
        """Make the config file's engines and the discovered ones the fleet (:meth:`Engines.update`)."""
        async with self._fleet_lock:
            return await self.engines.update(self.discovery.fleet(self._configured))

    def _discovered(self) -> None:
        """A source's engines changed: the fleet is applied again (changes meanwhile coalesce into one more)."""
        if self._stopping:
            return
        self._stale = True
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        while self._stale:
            self._stale = False
            try:
                added, removed = await self._apply()
            except Exception:  # tried again in a second (the sources report only changes); the router serves on
                self.metrics.discovery_errors.labels("apply").inc()
                log.exception("discovery: applying the engines found failed; trying again in 1 s")
                self._stale = True
                await asyncio.sleep(1.0)
                continue
            if added or removed:
                log.info("discovery: engines added %s, removed %s", added or "none", removed or "none")

    # --- lifecycle ------------------------------------------------------------------------------------------
    def web_app(self, admin: bool = False) -> web.Application:
        """The client listener's application; ``admin``: /metrics and /health's detail are the admin one's."""
        app = web.Application(client_max_size=self.config.limits.max_body_bytes)
        app.router.add_post("/v1/completions", self.proxy.handle)
        app.router.add_post("/v1/chat/completions", self.proxy.handle)
        app.router.add_get("/v1/models", self.proxy.models)
        # /health stays on the client listener (a load balancer's check), without the index's detail when an
        # admin listener serves that: blocks per engine would tell a client whether its prompt was cached
        app.router.add_get("/health", self._status if admin else self._health)
        if not admin:
            app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def admin_app(self) -> web.Application:
        app = web.Application(client_max_size=2**16)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def listen(self, host: str, port: int, admin: tuple[str, int] | None = None) -> list[web.AppRunner]:
        """Start the client listener on ``host:port`` (and the admin one); the runners, to clean up in order."""
        limits = self.config.limits
        cap = descriptor_room(limits.max_connections)
        if cap < limits.max_connections:
            log.warning("limits.max_connections is %d, but the descriptor limit (ulimit -n) leaves room for %d "
                        "client connections (each may hold one to an engine too): capped at %d",
                        limits.max_connections, cap, cap)
        listeners = [("client", host, port, cap, self.web_app(admin=admin is not None))]
        if admin is not None:
            listeners.append(("admin", *admin, _ADMIN_CONNECTIONS, self.admin_app()))
        runners = []
        for name, h, p, n, app in listeners:
            runner = web.AppRunner(app, **handler_args(limits))
            await runner.setup()
            runners.append(runner)
            site = CappedSite(runner, h, p, n, self.metrics.refused_connections.labels(name).inc,
                              self.metrics.evicted_connections.labels(name).inc)
            await site.start()
            self._sites[name] = site
            log.info("router %s listener on %s", name, site.name)
        return runners

    def port(self, listener: str = "client") -> int:
        return self._sites[listener].port

    async def _start(self, app: web.Application) -> None:
        if isinstance(self.tokenizer, Tokenizer):
            self.tokenizer.on_loop()  # (made on this thread when serve() made the app; whoever made it, the loop)
        await self.engines.start()
        if self.discovery.sources:
            # the sources' first answers are in the fleet before the router listens (its readiness)
            await self.discovery.start()
            self._stale = False
            await self._apply()

    async def _stop(self, app: web.Application) -> None:
        self._stopping = True
        await self.discovery.stop()
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        await self.engines.stop()
        self.pool.close()

    # --- the router's own endpoints -------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        engines = {name: {"healthy": s.healthy, "in_flight": len(s.flights), "index_blocks": self.index.blocks(name),
                          "places": self.index.places(name)}
                   for name, s in self.router.engines.items()}
        status = 200 if any(e["healthy"] for e in engines.values()) else 503
        return web.json_response({"engines": engines}, status=status)

    async def _status(self, request: web.Request) -> web.Response:
        """The client listener's /health with an admin listener: up or not, nothing about the index."""
        up = bool(self.router.healthy())
        return web.json_response({"status": "ok" if up else "no healthy engine"}, status=200 if up else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        for name, state in self.router.engines.items():
            self.metrics.in_flight.labels(name).set(len(state.flights))
            self.metrics.decode_wait.labels(name).set(state.decode_s)
            self.metrics.prefill_rate.labels(name).set(self.router.prefill_rate(state))
        for name, site in self._sites.items():
            self.metrics.connections.labels(name).set(site.open)
        self.metrics.prompt_queue.set(self.pool.pending)
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def serve(config: RouterConfig, path: str | os.PathLike[str] | None = None) -> None:
    """Run the router until interrupted (SIGINT/SIGTERM stop it cleanly); ``path``, the file ``config`` came from,
    is read again on SIGHUP and when it changes (``reload_s``) for its engines. Raises ConfigError for an engine key
    that cannot be read."""
    stamp = file_stamp(path) if path is not None else None  # (as the file was read: a change while starting counts)
    if config.otlp_traces_endpoint is not None:
        tracing.configure(config.otlp_traces_endpoint, "kvtier-router")
    try:
        _run(_serve(RouterApp(config), path, stamp))
    finally:
        tracing.shutdown()  # the last spans are exported before the process ends


def _run(main: Coroutine[Any, Any, None]) -> None:
    """``main`` on uvloop where it is installed (the router extra installs it on Linux and macOS): its transports
    take less of the router's CPU for each request than asyncio's (1.00 against 1.15 ms here, a short completion
    proxied), which a request waits for where the router shares its cores with engines."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


Stamp = tuple[int, int, int, int, int]
_READS = 5  # reads of a config file that keeps changing while read, before it is refused


def file_stamp(path: str | os.PathLike[str]) -> Stamp | None:
    """What tells a file changed: its device, inode, size, modification and change times (a file renamed over it,
    a ConfigMap's symlink swapped, a copy that kept the old time); None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class ConfigFile:
    """The router's config file, read again for its engines: on SIGHUP, and when it changes. A file still being
    written (changed since the last look) is read once it has stayed the same for one look."""

    def __init__(self, app: RouterApp, path: str | os.PathLike[str], seen: Stamp | None = None) -> None:
        self.app = app
        self.path = path
        self._seen = file_stamp(path) if seen is None else seen  # as last applied (or refused)
        self._lock = asyncio.Lock()  # one reload at a time, in order
        self._task: asyncio.Task[None] | None = None
        self._again = False  # a SIGHUP came since the signalled reload under way read the file

    def signalled(self) -> None:
        """SIGHUP: reload, and once more after a reload under way (a storm of signals is at most two reloads)."""
        self._again = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._signalled())

    async def _signalled(self) -> None:
        while self._again:
            self._again = False
            await self.reload("SIGHUP")

    async def reload(self, why: str) -> None:
        """Read the file and apply its engines; a file that cannot be read or is not a valid config is refused
        (logged, counted), and the running fleet kept."""
        async with self._lock:
            for _ in range(_READS):
                self._seen = file_stamp(self.path)
                try:
                    config = load_router_config(self.path)
                except (ConfigError, OSError) as exc:
                    log.error("router config %s (%s): not applied, the running engines kept: %s", self.path, why,
                              exc)
                    self.app.metrics.reloads.labels("refused").inc()
                    return
                if file_stamp(self.path) == self._seen:
                    await self.app.reload(config)
                    return
                await asyncio.sleep(0.1)  # written again while it was read: read it again, whole
            log.error("router config %s (%s): it changed while read, %d times: not applied", self.path, why, _READS)
            self.app.metrics.reloads.labels("refused").inc()

    async def watch(self) -> None:
        """Reload whenever the file changed and then stayed the same for one look (every ``reload_s``)."""
        last = self._seen
        while True:
            await asyncio.sleep(self.app.config.reload_s)
            try:
                now = file_stamp(self.path)
                if now != self._seen and now == last:
                    await self.reload("the file changed")
                last = now
            except Exception:  # the watch must outlive any one reload's surprise
                log.exception("router config %s: reloading failed", self.path)

    async def stop(self) -> None:
        """End a reload under way (the router stops)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def _serve(app: RouterApp, path: str | os.PathLike[str] | None = None, stamp: Stamp | None = None) -> None:
    config = app.config
    admin = None
    if config.admin_listen is not None:
        host, _, port = config.admin_listen.rpartition(":")
        admin = (host.strip("[]"), int(port))
    elif config.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("/metrics and /health's per-engine detail are served to clients on %s: set admin_listen to "
                    "serve them elsewhere (they tell a client whether its prompts were cached)", config.host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    file = ConfigFile(app, path, stamp) if path is not None else None
    hup = asyncio.Event()  # a SIGHUP while starting: the file is read once started
    if file is not None:
        loop.add_signal_handler(signal.SIGHUP, hup.set)
    runners = await app.listen(config.host, config.port, admin)
    watcher = None
    if file is not None:
        loop.add_signal_handler(signal.SIGHUP, file.signalled)
        if hup.is_set() or file_stamp(file.path) != stamp:
            file.signalled()
        if config.reload_s:
            watcher = loop.create_task(file.watch())
    try:
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        if file is not None:
            await file.stop()
        for runner in reversed(runners):
            await runner.cleanup()
