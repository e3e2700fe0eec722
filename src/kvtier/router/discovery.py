"""Engines found while serving: the router config's ``discovery`` sources (docs/fleet.md), merged with the config
file's engines into one fleet (:class:`Discovery`).

Each source (:class:`~kvtier.router.sources.DnsSource`, :class:`~kvtier.router.discovery_k8s.KubernetesSource`)
keeps the engines it sees now and calls ``changed`` when they change; the fleet is applied by
:meth:`~kvtier.router.engines.Engines.update` (new engines join once replayed and healthy; gone ones leave, their
index entries cleared at once). An engine named, or at an address, that the config file or an earlier source has
already is left out (counted).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from kvtier.router.config import DiscoveryConfig, EngineConfig
from kvtier.router.discovery_k8s import KubernetesSource
from kvtier.router.metrics import LogOnce
from kvtier.router.sources import DnsSource, Source

_FIRST_LOOK_S = 10.0  # the longest the router waits at start for a source's first answer


class Discovery:
    """The config file's engines and every source's, as one fleet (:meth:`fleet`): an engine named in the file,
    or by an earlier source, keeps its name and settings; a later one under the same name, or at the same
    address, is left out (counted)."""

    def __init__(self, sources: tuple[DiscoveryConfig, ...], changed: Callable[[], None], errors: LogOnce) -> None:
        kinds: dict[str, type[Source]] = {"dns": DnsSource, "kubernetes": KubernetesSource}
        self.sources = [kinds[c.source](c, f"discovery[{i}]", changed, errors) for i, c in enumerate(sources)]
        self._errors = errors
        self._tasks: list[asyncio.Task[None]] = []
        self._clashes: set[tuple[str, str, str]] = set()  # (kind, source, engine name) left out, as last counted

    async def start(self) -> None:
        """Start every source and wait for each one's first answer (at most :data:`_FIRST_LOOK_S`)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(s.run()) for s in self.sources]
        for source, task in zip(self.sources, self._tasks):
            task.add_done_callback(functools.partial(self._ended, source))
        if self.sources:
            waits = [asyncio.ensure_future(s.answered.wait()) for s in self.sources]
            await asyncio.wait(waits, timeout=_FIRST_LOOK_S)
            for wait in waits:
                wait.cancel()

    def _ended(self, source: Source, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:  # a bug: the engines it found stay
            self._errors("source", "discovery %s: stopped by %r; its engines stay as they were",
                         source.field, task.exception())

    async def stop(self) -> None:
        for source in self.sources:
            source.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def fleet(self, configured: tuple[EngineConfig, ...]) -> tuple[EngineConfig, ...]:
        engines = {e.name: e for e in configured}
        urls = {e.url.rstrip("/") for e in configured}
        clashes = set()
        for source in self.sources:
            for name, engine in source.engines.items():
                if name in engines:
                    if engines[name] != engine:
                        clashes.add(("name", source.field, name))
                    continue
                if engine.url in urls:
                    clashes.add(("address", source.field, name))
                    continue
                engines[name] = engine
                urls.add(engine.url)
        for kind, field, name in sorted(clashes - self._clashes):  # (each counted once, not at each look)
            self._errors(kind, "discovery %s: engine %s is %s already (by the config file or an earlier "
                         "source): left out", field, name, "named" if kind == "name" else "at that address")
        self._clashes = clashes
        return tuple(engines.values())
