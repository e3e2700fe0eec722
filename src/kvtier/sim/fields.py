"""Reading YAML mappings field by field, so that every bad value is an error naming its dotted field.

Deployments, workload cards and deployment facts are read with one :class:`Fields` each, bound to the error their
module raises.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvtier.config import parse_size
from kvtier.errors import ConfigError


class Fields:
    """Typed getters over YAML mappings that raise ``error`` with the field's dotted name."""

    def __init__(self, error: type[Exception]) -> None:
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

    def mapping(self, value: Any, field: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
        if value is None:
            raise self.error(f"{field}: missing (expected a mapping with {', '.join(allowed)})")
        if not isinstance(value, Mapping):
            raise self.error(f"{field}: expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                raise self.error(f"{field}.{key}: unknown key; allowed: {', '.join(allowed)}")
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
    def size(self, section: Mapping[str, Any], key: str, field: str, required: builtins.bool
             ) -> builtins.int | None:
        """Bytes, as a number or a string such as ``4GiB``; None when absent or null and not required."""
        value = section.get(key)
        if value is None:
            if required:
                raise self.error(f"{field}.{key}: missing")
            return None
        try:
            out = parse_size(value, f"{field}.{key}")
        except ConfigError as exc:
            raise self.error(str(exc)) from None
        if out < 1:
            raise self.error(f"{field}.{key}: must be positive, got {value!r}")
        return out
