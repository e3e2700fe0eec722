"""The one config field reader: every YAML mapping kvtier reads (store, router and fleet configs, tier options,
the simulator's deployments, workload cards and facts) goes through :class:`FieldReader`, so every bad value is an
error naming its dotted field (``tiers[0].capacity_bytes``) and what is allowed. Beside it, the values every reader
shares: byte sizes (``4GiB``), and how a value appears in an error (secrets never; URLs without their password).

The lowest layer of :mod:`kvtier.config` (which re-exports all of it), apart so that modules the config reader
uses (:mod:`kvtier.placement`, :mod:`kvtier.sealing`) read fields the same way without importing it back.
"""

from __future__ import annotations

import builtins
import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, overload

import yaml

from kvtier.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

_SECRET_FIELDS = ("secret", "password", "passwd", "credential")
_SECRET_PARTS = ("token", "key")  # whole parts of a name: auth_token, api_key; not chunk_tokens, key_prefix
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]*")
_SECRET_QUERY = re.compile(r"(?i)((?:password|passwd|secret|token|access_key|secret_key)=)[^&#\s'\"]*")


def redact_url(url: str) -> str:
    """``url`` with its password (and any ``password=``-like query value) replaced by ``***``.

    Everything up to the last ``@`` counts as user info, so a password with an unescaped ``@``, ``/`` or ``?``
    (which URL parsers take for the host or path) is hidden too; a lone name before ``@`` may be a password
    written without its colon, so it goes as well.
    """
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        userinfo, _, host = rest.rpartition("@")
        rest = (userinfo.partition(":")[0] + ":***@" if ":" in userinfo else "***@") + host
    return scheme + sep + _SECRET_QUERY.sub(r"\1***", rest)


def redact(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`."""
    return _URL.sub(lambda m: redact_url(m[0]), text)


def shown(field: str, value: object) -> str:
    """How a config value appears in an error: secrets never, URLs without their password."""
    name = field.rpartition(".")[2].lower()
    parts = re.split(r"[_\-]", name)
    if any(word in name for word in _SECRET_FIELDS) or (parts[-1] in _SECRET_PARTS and len(parts) > 1) \
            or name in ("token", "apikey"):
        return "<redacted>"
    return redact(repr(value))


def parse_size(value: object, field: str) -> int:
    """Parse a byte size given as an int or a string such as ``"4GiB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a byte size (int or string like '4GiB'), got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ConfigError(f"{field}: must not be negative, got {value}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    units = ", ".join(u for u in _SIZE_UNITS if u)
    raise ConfigError(f"{field}: expected a byte size (int, or a number with one of {units}), got "
                      f"{shown(field, value)}")


def unknown_key(field: str, key: object, allowed: Iterable[str]) -> str:
    """The message for ``key`` found in the mapping at ``field`` ("" for the top) where only ``allowed`` may be."""
    return f"{field + '.' if field else ''}{key}: unknown key; allowed: {', '.join(allowed)}"


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


class FieldReader:
    """Typed values from YAML mappings; each bad one raises ``error`` (a :class:`ConfigError` unless a module's own
    error is given) naming its dotted field.

    Two ways in, one set of messages each: by a dataclass's type hints (:meth:`dataclass`, :meth:`typed`: the
    store, router and fleet configs, tier options), or field by field with explicit bounds (:meth:`mapping`,
    :meth:`int`, :meth:`number`, :meth:`bool`, :meth:`size`: the simulator's inputs).
    """

    def __init__(self, error: type[Exception] = ConfigError) -> None:
        self.error = error

    def load(self, source: str | Path | Mapping[str, Any], what: str) -> Any:
        """A mapping as given, or a YAML/JSON file's content."""
        if isinstance(source, Mapping):
            return source
        try:
            return yaml.safe_load(Path(source).read_text(encoding="utf-8"))
        except OSError as exc:
            raise self.error(f"{source}: cannot read the {what}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise self.error(f"{source}: the {what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except yaml.YAMLError as exc:
            raise self.error(f"{source}: the {what} is not YAML: {exc}") from None

    # --- by type hints ----------------------------------------------------------------------------------------
    def dataclass(self, cls: type, data: object, field: str) -> Any:
        """Validate ``data`` against the dataclass ``cls`` and return an instance.

        Fields whose name ends in ``_bytes`` accept byte sizes with units. A dataclass may define
        ``check(self, field)`` for cross-field rules; it raises :class:`ConfigError`.
        """
        if not isinstance(data, Mapping):
            raise self.error(f"{field or 'config'}: expected a mapping, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise self.error(unknown_key(field, unknown[0], sorted(fields)))
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for name, f in fields.items():
            path = f"{field}.{name}" if field else name
            if name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise self.error(f"{path}: required")
                continue
            kwargs[name] = self.typed(hints[name], data[name], path, size=name.endswith("_bytes"))
        obj = cls(**kwargs)
        check = getattr(obj, "check", None)
        if check is not None:
            check(field)
        return obj

    def typed(self, tp: Any, value: object, field: str, size: bool) -> object:
        """``value`` as the type ``tp`` (a union or Literal of str, bool, int, float, None); ``size``: an int may be
        a byte size with a unit."""
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            if value is None and type(None) in args:
                return None
            for arg in args:
                if arg is type(None):
                    continue
                try:
                    return self.typed(arg, value, field, size)
                except self.error:
                    continue
            raise self.error(f"{field}: expected {_describe(tp)}, got {shown(field, value)}")
        if origin is Literal:
            if value in typing.get_args(tp):
                return value
            raise self.error(f"{field}: expected {_describe(tp)}, got {shown(field, value)}")
        if tp is int and size:
            return self._bytes(value, field)
        if tp is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if tp is float and isinstance(value, str):
            # YAML 1.1 reads 2e-5 (no dot) as a string: take it as the number it is meant to be
            try:
                value = float(value)
            except ValueError:
                raise self.error(f"{field}: expected {_describe(tp)}, got {shown(field, value)}") from None
        if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise self.error(f"{field}: must be a finite number, got {value!r}")
            return float(value)
        if tp in (str, bool) and isinstance(value, tp):
            return value
        raise self.error(f"{field}: expected {_describe(tp)}, got {shown(field, value)}")

    def _bytes(self, value: object, field: str) -> int:
        """:func:`parse_size`, its error as this reader's."""
        try:
            return parse_size(value, field)
        except ConfigError as exc:
            if self.error is ConfigError:
                raise
            raise self.error(str(exc)) from None

    # --- field by field ---------------------------------------------------------------------------------------
    def mapping(self, value: Any, field: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
        if value is None:
            raise self.error(f"{field}: missing (expected a mapping with {', '.join(allowed)})")
        if not isinstance(value, Mapping):
            raise self.error(f"{field}: expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                raise self.error(unknown_key(field, key, allowed))
        return value

    def section(self, top: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
        """An optional sub-mapping (absent or null: empty)."""
        value = top.get(key)
        return {} if value is None else self.mapping(value, key, allowed)

    def int(self, section: Mapping[str, Any], key: str, field: str, required: bool = False, default: int = 0,
            minimum: int = 1, maximum: int = 2**53) -> int:
        if key not in section:
            if required:
                raise self.error(f"{field}.{key}: missing")
            return default
        value = section[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value > maximum:
            bound = f">= {minimum}" if maximum == 2**53 else f"from {minimum} to {maximum}"
            raise self.error(f"{field}.{key}: expected an integer {bound}, got {value!r}")
        return value

    def number(self, section: Mapping[str, Any], key: str, field: str, default: float, minimum: float = 0.0,
               maximum: float = 1e9, positive: bool = False) -> float:
        value = section.get(key, default)
        bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        if bad or value < minimum or value > maximum or (positive and value <= 0):
            low = f"> {minimum:g}" if positive and minimum == 0 else f">= {minimum:g}"
            raise self.error(f"{field}.{key}: expected a number {low} and <= {maximum:g}, got {value!r}")
        return float(value)

    def bool(self, section: Mapping[str, Any], key: str, field: str, default: bool) -> bool:
        value = section.get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"{field}.{key}: expected true or false, got {value!r}")
        return value

    # builtins.: in the class body ``int`` and ``bool`` name the getters above
    @overload
    def size(self, section: Mapping[str, Any], key: str, field: str, required: Literal[True]) -> builtins.int: ...
    @overload
    def size(self, section: Mapping[str, Any], key: str, field: str, required: builtins.bool
             ) -> builtins.int | None: ...
    def size(self, section: Mapping[str, Any], key: str, field: str, required: builtins.bool
             ) -> builtins.int | None:
        """Bytes, as a number or a string such as ``4GiB``; None when absent or null and not required."""
        value = section.get(key)
        if value is None:
            if required:
                raise self.error(f"{field}.{key}: missing")
            return None
        out = self._bytes(value, f"{field}.{key}")
        if out < 1:
            raise self.error(f"{field}.{key}: must be positive, got {value!r}")
        return out


CONFIG_FIELDS = FieldReader(ConfigError)  # the configs' reader: its errors are ConfigErrors


def build_dataclass(cls: type, data: object, field: str) -> Any:
    """:meth:`FieldReader.dataclass` of the configs' reader: ``data`` validated into an instance of ``cls``."""
    return CONFIG_FIELDS.dataclass(cls, data, field)
