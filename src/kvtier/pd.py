"""The wire format of disaggregated prefill and decode (docs/pd.md): kvtier's sub-dict of vLLM's
``kv_transfer_params``, as the router writes it and the connector reads it (and the other way round). One module
for both sides, so that what the router accepts from a prefill engine is exactly what a decode engine takes.

- prefill request: ``{"pd": "prefill"}``;
- prefill answer: ``{"pd": "stored", "tokens": N, "namespace": ID, "key": HEX}`` or ``{"pd": "none"}``;
- decode request: ``{"pd": "decode", "tokens": N, "namespace": ID, "key": HEX, "wait_s": S}``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

FIELD = "kvtier"  # kvtier's key in kv_transfer_params
_HEX = frozenset("0123456789abcdef")


class BadParams(ValueError):
    """kvtier's sub-dict of ``kv_transfer_params`` is not one this release reads (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class Stored:
    """What a prefill engine stored: the prompt's leading ``tokens``, in namespace ``namespace`` (its id), the last
    chunk (or tail) under ``key`` (hex)."""

    tokens: int
    namespace: str
    key: str

    def answer(self) -> dict[str, Any]:
        """The prefill answer's sub-dict."""
        return {"pd": "stored", "tokens": self.tokens, "namespace": self.namespace, "key": self.key}

    def decode(self, wait_s: float) -> dict[str, Any]:
        """The decode request's sub-dict: this promise and how long to wait for it."""
        return {**self.answer(), "pd": "decode", "wait_s": wait_s}


NOTHING_STORED: dict[str, Any] = {"pd": "none"}


def _hex(own: dict[str, Any], field: str) -> str:
    value = own.get(field)
    if not isinstance(value, str) or not 0 < len(value) <= 128 or not set(value) <= _HEX:
        raise BadParams(f"kv_transfer_params.{FIELD}.{field}: lowercase hex of at most 128 digits, got {value!r}")
    return value


def _stored(own: dict[str, Any]) -> Stored:
    tokens = own.get("tokens")
    if type(tokens) is not int or not 0 <= tokens <= 2**31:
        raise BadParams(f"kv_transfer_params.{FIELD}.tokens: an integer in [0, 2**31], got {tokens!r}")
    return Stored(tokens, _hex(own, "namespace"), _hex(own, "key"))


def own_params(params: object) -> dict[str, Any] | None:
    """kvtier's sub-dict of ``kv_transfer_params``, None when there is none; BadParams when it is not a mapping."""
    if not isinstance(params, dict) or FIELD not in params:
        return None
    own = params[FIELD]
    if not isinstance(own, dict):
        raise BadParams(f"kv_transfer_params.{FIELD}: a mapping, got {type(own).__name__}")
    return own


def read_request(params: object) -> tuple[str, Stored | None, float] | None:
    """A request's P/D role (``prefill``, or ``decode`` with its promise and wait), None without kvtier's sub-dict.
    Raises :class:`BadParams`."""
    own = own_params(params)
    if own is None:
        return None
    role = own.get("pd")
    if role == "prefill":
        return "prefill", None, 0.0
    if role != "decode":
        raise BadParams(f"kv_transfer_params.{FIELD}.pd: 'prefill' or 'decode', got {role!r}")
    wait_s = own.get("wait_s", 0.0)
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not math.isfinite(wait_s) or wait_s < 0:
        raise BadParams(f"kv_transfer_params.{FIELD}.wait_s: seconds, a number >= 0, got {wait_s!r}")
    return "decode", _stored(own), float(wait_s)


def read_answer(params: object) -> Stored | None:
    """A prefill answer's promise; None when it stored nothing. Raises :class:`BadParams` for an answer without
    kvtier's sub-dict or with one this release does not read."""
    own = own_params(params)
    if own is None:
        raise BadParams(f"kv_transfer_params.{FIELD}: missing")
    if own.get("pd") == "none":
        return None
    if own.get("pd") != "stored":
        raise BadParams(f"kv_transfer_params.{FIELD}.pd: 'stored' or 'none', got {own.get('pd')!r}")
    return _stored(own)
