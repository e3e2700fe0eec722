"""The values every config reader shares: byte sizes (``4GiB``), and how a value appears in an error (secrets
never; URLs without their password).

The lowest layer of :mod:`kvtier.config` (which re-exports all of it), apart so that modules the config reader
uses (:mod:`kvtier.placement`) read sizes the same way without importing it back.
"""

from __future__ import annotations

import re

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
