"""Fault injection for the connector's tests: a plugin tier that misbehaves in every way, and a store that raises.

Imported by the engine runner (a subprocess) as well, so it depends on nothing but kvtier.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.errors import TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.store import KVStore
from kvtier.tiers.base import Buffer, StoredObject, Tier

# What a plugin may throw besides TierError: its own bugs and whatever its client library raises.
_ARBITRARY: tuple[type[Exception], ...] = (RuntimeError, KeyError, ZeroDivisionError, OSError, TypeError,
                                           AttributeError, TierError)


@dataclasses.dataclass
class _Options:
    pass


class RaisingTier(Tier):
    """A tier whose every answer is an exception or garbage. Loaded by its ``package.module:Class`` path
    (``faulty:RaisingTier`` from the runner's directory).

    ``heads`` answers the first question about a list of chunks malformed (None where a list belongs), and
    every later one with a claim of every head (of a 2-KV-head model), so lookups see hits that no read can
    serve; ``get`` raises or returns bytes no frame check accepts; writes raise.
    """

    Options = _Options

    def __init__(self, name: str, options: Any) -> None:
        super().__init__(name, options)
        self._calls = itertools.count()
        self._asked: set[tuple[str, ...]] = set()

    def _raise(self, what: str) -> None:
        exc = _ARBITRARY[next(self._calls) % len(_ARBITRARY)]
        raise exc(f"{self.name}: injected failure in {what}")

    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        self._raise("put")

    def get(self, key: ShardKey) -> Buffer | None:
        if next(self._calls) % 3 == 0:
            return b"\x00garbage" * 7
        self._raise("get")
        return None

    def delete(self, key: ShardKey) -> bool:
        self._raise("delete")
        return False

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        if tuple(chunks) not in self._asked:
            self._asked.add(tuple(chunks))
            return [None] * len(chunks)  # type: ignore[list-item] # malformed on purpose
        return [[HeadRange(0, 2, 2)] for _ in chunks]

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        self._raise("list")
        return iter(())

    def exists(self, key: ShardKey) -> bool:
        self._raise("exists")
        return False


class Injected(RuntimeError):
    """Raised by a patched store method."""


def patch_store(store: KVStore, failures: dict[str, int]) -> None:
    """Make the first ``failures[name]`` calls of each named store method raise :class:`Injected`."""
    for name, count in failures.items():
        original = getattr(store, name)
        left = [count]

        def failing(*args: Any, _name: str = name, _original: Any = original, _left: list[int] = left,
                    **kwargs: Any) -> Any:
            if _left[0] > 0:
                _left[0] -= 1
                raise Injected(f"injected failure in store.{_name}")
            return _original(*args, **kwargs)

        setattr(store, name, failing)
