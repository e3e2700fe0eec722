"""Registries of pluggable parts (tiers, eviction policies), chosen by name.

A name is either registered in-tree or a ``package.module:Attribute`` path, which loads an out-of-tree plugin:
importing it runs that module's code, so a config that names plugins is code, trusted like any other. A plugin
must subclass the registry's base class.
An unknown name is a :class:`ConfigError` that lists the known names.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Generic, TypeVar

from kvtier.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to classes of one kind."""

    def __init__(self, kind: str, base: type) -> None:
        # ``type``, not ``type[T]``: a base is abstract (an ABC), which mypy refuses where ``type[T]`` is expected
        self._kind = kind
        self._base: type[T] = base
        self._entries: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: make ``cls`` available under ``name``."""

        def decorate(cls: type[T]) -> type[T]:
            if name in self._entries and self._entries[name] is not cls:
                raise ValueError(f"{self._kind} {name!r} is already registered")
            self._entries[name] = cls
            return cls

        return decorate

    def names(self) -> list[str]:
        return sorted(self._entries)

    def resolve(self, name: str, field: str) -> type[T]:
        """Return the class for ``name``; ``field`` names the config field for error messages."""
        if name in self._entries:
            return self._entries[name]
        if ":" in name:
            module_name, _, attr = name.partition(":")
            try:
                module = importlib.import_module(module_name)
                found = getattr(module, attr)
            except Exception as exc:  # a plugin's import may fail in any way: it is the config's fault
                raise ConfigError(f"{field}: cannot load {self._kind} plugin {name!r}: "
                                  f"{type(exc).__name__}: {exc}") from exc
            if not (isinstance(found, type) and issubclass(found, self._base)) or inspect.isabstract(found):
                raise ConfigError(f"{field}: plugin {name!r} is {found!r}, not a concrete subclass of "
                                  f"{self._base.__module__}.{self._base.__qualname__}")
            return found
        known = ", ".join(self.names())
        raise ConfigError(
            f"{field}: unknown {self._kind} {name!r}; known: {known} "
            "(or 'package.module:Class' for a plugin)"
        )
