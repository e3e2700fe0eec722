"""The engines as the router sees them, on its event loop: whether each is up, which models it serves, what its KV
events say it holds, and how fast it prefills.

Every ``health_interval_s`` each engine's ``/health`` is checked: one answer makes it routable, and only
:data:`_LOST_AFTER` failed checks in a row lose it (its entries in the index cleared). The first engine up tells
the base models and ``max_model_len`` (its ``/v1/models``). A KV-event :class:`~kvtier.router.subscriber.Subscriber`
per engine applies its batches to the :class:`~kvtier.router.index.PrefixIndex`; every ``metrics_interval_s`` the
engines' prefill counters calibrate the policy. Each of these calls carries the engines' API key when one is
configured. The proxy sends clients' requests with :attr:`Engines.upstream` (:mod:`kvtier.router.upstream`), and
passes ``/v1/models`` on with :attr:`Engines.session`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterator, Mapping

import aiohttp
import zmq.asyncio

from kvtier.metrics import sample_sum
from kvtier.router.config import EngineConfig, RouterConfig
from kvtier.router.events import Batch, Cleared, Feed, Removed, Stored
from kvtier.router.guards import read_secret
from kvtier.router.index import LOCAL_PLACES, Place, PrefixIndex
from kvtier.router.metrics import LogOnce, RouterMetrics
from kvtier.router.policy import Router
from kvtier.router.subscriber import Subscriber
from kvtier.router.upstream import Upstreams

log = logging.getLogger(__name__)

_LOST_AFTER = 3  # health checks failed in a row before an engine's entries are cleared
# An engine's restart and lost events are logged at most this often each (a forged publisher can repeat them)
WARN_EVERY_S = 60.0


def _endpoints(engine: EngineConfig) -> tuple[str, str | None, str | None, bool]:
    """What an engine is reached at: a change to any of it is another engine under the same name."""
    return engine.url, engine.kv_events, engine.kv_events_replay, engine.kv_events_bind


class Engines:
    """The engines' health, models, KV-event subscribers and prefill calibration, from :meth:`start` to
    :meth:`stop`. Raises ConfigError for an engine key that cannot be read."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, index: PrefixIndex, router: Router) -> None:
        self.config = config
        self.metrics = metrics
        self.index = index
        self.router = router
        # the router's own calls to the engines (health, models, metrics) carry the engines' --api-key
        self.own_headers = ({"Authorization": "Bearer " + read_secret(config.engine_api_key, "engine_api_key")}
                            if config.engine_api_key is not None else {})
        self.urls = {e.name: e.url.rstrip("/") for e in config.engines}
        self._configs = {e.name: e for e in config.engines}
        self.base_models: set[str] = set()
        self.max_model_len: int | None = None  # the engines' smallest, from their /v1/models
        self.subscribers: dict[str, Subscriber] = {}
        self.session: aiohttp.ClientSession | None = None
        self.upstream = Upstreams()
        self._zmq: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._prefill_counters: dict[str, tuple[float, float, float]] = {}
        self._failures: dict[str, int] = {}  # health checks failed in a row, per engine
        self._updating = asyncio.Lock()
        self._closed = False

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        # No Accept-Encoding of the client's own: engines answer uncompressed, which passes through as it is.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",))
        self._zmq = zmq.asyncio.Context()
        for engine in self.config.engines:
            self._follow(engine)
        # Nothing is routed to an engine before its events are replayed (the index holds what it holds) and it
        # answered a health check once.
        await self._replayed(list(self.urls))
        await asyncio.gather(*(self._check(name) for name in self.urls))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._health_loop()), loop.create_task(self._scrape_loop())]

    def _follow(self, engine: EngineConfig) -> None:
        """Start following ``engine``'s KV events (if it publishes them)."""
        if engine.kv_events is None:
            return
        assert self._zmq is not None
        sub = self._subscriber(self._zmq, engine, engine.kv_events)
        self.subscribers[engine.name] = sub
        sub.start()

    async def _replayed(self, names: list[str]) -> None:
        """Wait (at most a replay's bound, and a second) until the engines ``names`` follow have read their replay
        buffers."""
        waits = [asyncio.ensure_future(self.subscribers[n].replayed.wait()) for n in names if n in self.subscribers]
        if waits:
            try:
                await asyncio.wait(waits, timeout=self.config.events.replay_s + 1)
            finally:
                for wait in waits:
                    wait.cancel()

    async def update(self, engines: tuple[EngineConfig, ...]) -> tuple[list[str], list[str]]:
        """Make the fleet ``engines`` (one update at a time). New engines join first, once their events are replayed
        and they answered a health check; then those gone stop being routed to (their index entries cleared in
        slices, their series removed; their requests in flight run to their end). An engine whose weight or role
        changed is changed in place; one whose address or events changed leaves and joins again. The names
        (added, removed)."""
        async with self._updating:
            if self._closed:
                return [], []
            wanted = {e.name: e for e in engines}
            moved = [n for n in self.urls if n in wanted and _endpoints(self._configs[n]) != _endpoints(wanted[n])]
            for name in moved:
                await self._leave(name)
            added = [n for n in wanted if n not in self.urls]
            for name in added:
                self._join(wanted[name])
            for name, engine in wanted.items():
                if self._configs[name] != engine:
                    self._configs[name] = engine
                    self.router.reconfigure(engine)
                    self.metrics.declare([], [], [name] if engine.role == "prefill" else [])
            gone = [n for n in self.urls if n not in wanted]
            if added or moved or gone:
                self.base_models = set()  # learned again, from the next engine up: the fleet may serve others now
            if added:
                await self._replayed(added)
                await asyncio.gather(*(self._check(name) for name in added))
            for name in gone:
                await self._leave(name)
            if not self.base_models:
                await asyncio.gather(*(self._check(name) for name in self.router.healthy()))
            return added, [*moved, *gone]

    def _join(self, engine: EngineConfig) -> None:
        name = engine.name
        self._configs[name] = engine
        self.urls[name] = engine.url.rstrip("/")
        self.router.add(engine)
        self.metrics.declare([name], [name] if engine.kv_events else [], [name] if engine.role == "prefill" else [])
        self.metrics.watch([name], self.router.signals)
        self._follow(engine)

    async def _leave(self, name: str) -> None:
        self.metrics.forget(name)  # (first: its gauges read the router's state of it)
        self.router.remove(name)
        self.upstream.forget(self.urls[name])  # (its requests in flight keep theirs to their end)
        del self.urls[name], self._configs[name]
        self._failures.pop(name, None)
        self._prefill_counters.pop(name, None)
        sub = self.subscribers.pop(name, None)
        if sub is not None:
            await sub.stop()
        for _ in self.index.leaving(name):  # in slices: a million blocks must not stall the loop
            await asyncio.sleep(0)

    async def stop(self) -> None:
        self._closed = True
        async with self._updating:  # (an update under way ends first: nothing starts after this)
            pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sub in list(self.subscribers.values()):
            await sub.stop()
        if self.session is not None:
            await self.session.close()
        await self.upstream.close()
        if self._zmq is not None:
            self._zmq.term()

    # --- KV events ------------------------------------------------------------------------------------------
    def _subscriber(self, ctx: zmq.asyncio.Context, engine: EngineConfig, events: str) -> Subscriber:
        """The subscriber to ``engine``'s KV events at ``events``, its callbacks bound to the engine's name."""
        name = engine.name
        feed = Feed(apply=lambda batch: self._apply(name, batch),
                    clear=lambda: self.index.clearing(name, LOCAL_PLACES),
                    on_gap=lambda missed: self.metrics.event_gaps.labels(name).inc(missed),
                    on_reset=lambda: self.metrics.event_resets.labels(name, "sequence").inc(),
                    warn=functools.partial(self._warn_feed, name, LogOnce(
                        None, "kvtier_router_event_resets and _gaps", log, logging.WARNING, WARN_EVERY_S)))
        return Subscriber(ctx, name, events, engine.kv_events_replay, feed,
                          bind=engine.kv_events_bind, limits=self.config.events,
                          block_size=self.config.block_size,
                          on_batch=lambda batch, ignored: self._arrived(name, batch),
                          on_error=lambda kind: self.metrics.event_errors.labels(name, kind).inc(),
                          on_replay=lambda: self.metrics.event_replays.labels(name).inc())

    @staticmethod
    def _warn_feed(name: str, limit: LogOnce, kind: str, message: str, *args: object) -> None:
        limit(kind, "engine %s: " + message, name, *args)

    def _arrived(self, engine: str, batch: Batch) -> None:
        self.metrics.event_lag.labels(engine).observe(max(0.0, time.time() - batch.ts))

    def _apply(self, engine: str, batch: Batch) -> Iterator[None]:
        """Apply a batch (or a piece of one: the feed splits large ones), yielding between slices of a clear."""
        for event in batch.events:
            if isinstance(event, Stored):
                self.index.stored(engine, event)
            elif isinstance(event, Removed):
                self.index.removed(engine, event)
            elif isinstance(event, Cleared):
                # vLLM's own cache only: kvtier's places stay
                yield from self.index.clearing(engine, (Place.ENGINE,))
                self.metrics.event_resets.labels(engine, "all_blocks_cleared").inc()
        if not batch.part:
            self.metrics.event_batches.labels(engine).inc()
        self.metrics.index_blocks.labels(engine).set(self.index.blocks(engine))

    # --- health ---------------------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await asyncio.gather(*(self._check(name) for name in self.urls))
                self.upstream.prune()  # (connections kept to engines no request went to since)
                self.index.expire()
                counts = self.index.counts
                self.metrics.index_unusable.labels("orphan").set(counts.orphans)
                for reason, n in counts.skipped.items():
                    self.metrics.index_unusable.labels(reason).set(n)
            except Exception:  # the loop must outlive any one check's surprise
                log.exception("health check round failed")

    async def _check(self, name: str) -> None:
        """One /health check. An engine is routed to again at its first answer; it is lost (its entries in the
        index cleared) only after :data:`_LOST_AFTER` checks in a row fail, not at one slow answer."""
        assert self.session is not None
        url = self.urls.get(name)
        if url is None or name not in self.router.engines:
            return  # (it left the fleet meanwhile)
        state = self.router.engines[name]
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.config.health_interval_s * 2))
        try:
            async with self.session.get(url + "/health", timeout=timeout, headers=self.own_headers,
                                        allow_redirects=False) as reply:
                ok = reply.status == 200
        except Exception:  # noqa: BLE001 refused, reset, timed out, malformed: not healthy this time (counted)
            ok = False
        if self.router.engines.get(name) is not state or self.urls.get(name) != url:
            return  # (it left the fleet while it was checked, perhaps to join again elsewhere)
        sub = self.subscribers.get(name)
        if ok and sub is not None and not sub.replayed.is_set():
            return  # up, but not routed to before its events are replayed
        if ok:
            if not state.healthy:
                log.info("engine %s is up", name)
            state.healthy = True
            self._failures[name] = 0
            if not self.base_models:
                await self._learn_models(name, timeout)
        else:
            state.healthy = False
            self._failures[name] = self._failures.get(name, 0) + 1
            if self._failures[name] == _LOST_AFTER:
                self._lost(name, "health")
        self.metrics.healthy.labels(name).set(1 if ok else 0)

    async def _learn_models(self, name: str, timeout: aiohttp.ClientTimeout) -> None:
        """The engines' base model names (a request for another model is a LoRA adapter's) and their
        ``max_model_len`` (vLLM's /v1/models gives it): longer prompts are not keyed."""
        assert self.session is not None
        if name not in self.urls:
            return
        try:
            async with self.session.get(self.urls[name] + "/v1/models", timeout=timeout, headers=self.own_headers,
                                        allow_redirects=False) as reply:
                if reply.status != 200:
                    hint = " (engines started with --api-key need engine_api_key)" if reply.status == 401 else ""
                    log.warning("engine %s: /v1/models answered HTTP %d%s", name, reply.status, hint)
                    return
                data = (await reply.json()).get("data")
            base = [m for m in data if isinstance(m, Mapping) and isinstance(m.get("id"), str) and not m.get("parent")]
            self.base_models = {m["id"] for m in base}
            lengths = [m["max_model_len"] for m in base if type(m.get("max_model_len")) is int
                       and m["max_model_len"] > 0]
            self.max_model_len = min(lengths) if lengths else None
        except Exception as exc:  # noqa: BLE001 not fatal, logged: routed as base-model requests until it answers
            log.warning("engine %s: cannot read /v1/models (%s: %s)", name, type(exc).__name__, exc)

    def _lost(self, name: str, cause: str) -> None:
        """An engine stopped answering: nothing is routed there, and what it held in its own memory and on its
        host counts for nothing until its events say otherwise (a restarted engine starts empty). What it wrote
        to a shared tier stays credited: every other engine can still load it."""
        log.warning("engine %s lost (%s): its local index entries are cleared", name, cause)
        self.router.lost(name)
        sub = self.subscribers.get(name)
        if sub is not None:
            sub.feed.reset(counted=False)
        self.metrics.event_resets.labels(name, cause).inc()
        self.metrics.healthy.labels(name).set(0)
        self.metrics.index_blocks.labels(name).set(0)

    # --- calibration ----------------------------------------------------------------------------------------
    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            results = await asyncio.gather(*(self.scrape(name) for name in self.router.healthy()),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, Exception):
                    log.warning("scraping an engine's /metrics failed: %s: %s", type(result).__name__, result)

    async def scrape(self, name: str) -> None:
        """Prefill seconds per computed token from the engine's own counters, when exactly one request was
        prefilled since the last scrape (with several, their prefill times overlap and would add up)."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=5)
        if name not in self.urls:
            return
        try:
            async with self.session.get(self.urls[name] + "/metrics", timeout=timeout, headers=self.own_headers,
                                        allow_redirects=False) as reply:
                text = await reply.text()
        except (asyncio.TimeoutError, aiohttp.ClientError):
            return
        seconds = sample_sum(text, "vllm:request_prefill_time_seconds_sum")
        count = sample_sum(text, "vllm:request_prefill_time_seconds_count")
        tokens = sample_sum(text, "vllm:request_prefill_kv_computed_tokens_sum")
        before = self._prefill_counters.get(name)
        self._prefill_counters[name] = (seconds, count, tokens)
        state = self.router.engines.get(name)
        if state is None:
            self._prefill_counters.pop(name, None)  # (it left the fleet while it was scraped)
            return
        if before is not None and count - before[1] == 1 and \
                tokens - before[2] >= self.config.block_size:
            state.calibrate_prefill((seconds - before[0]) / (tokens - before[2]))
