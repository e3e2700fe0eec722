"""What passes between a client and an engine, as the router changes it: hop-by-hop headers (RFC 9110 7.6.1)
dropped both ways, a streamed answer cut at SSE event boundaries, the router's own error answers."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from aiohttp import web

from kvtier.router.policy import RouteDecision

HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
       "proxy-authorization", "proxy-authenticate", "accept-encoding"}
# Of a client's request, also: ``Expect`` (aiohttp answered its 100-continue already) and ``Content-Encoding``
# (aiohttp inflated the body; the engine is sent it inflated)
REQUEST_HOP = HOP | {"expect", "content-encoding"}
# The blank line that ends an SSE event: two line ends, each CRLF, LF or CR (a CR followed by LF is one CRLF)
EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LONGEST_END = 4
MAX_EVENT = 4 * 2**20  # an SSE event held longer than this without its end is passed on as it is


def hop_by_hop(headers: Mapping[str, str], hop: set[str]) -> set[str]:
    """``hop`` and the headers the message's ``Connection`` names (RFC 9110 7.6.1: hop-by-hop too)."""
    values = headers.getall("Connection", ()) if "Connection" in headers else ()  # type: ignore[attr-defined]  # aiohttp
    named = {token.strip().lower() for value in values for token in value.split(",")}
    return hop | named


def forwarded(incoming: Mapping[str, str], request_id: str) -> dict[str, str]:
    """The client's end-to-end headers, for the engine. Raises UnicodeEncodeError for one that is not UTF-8
    (aiohttp reads such bytes as surrogates, and could not send them on)."""
    hop = hop_by_hop(incoming, REQUEST_HOP)
    headers = {k: v for k, v in incoming.items() if k.lower() not in hop}
    for k, v in headers.items():
        k.encode(), v.encode()
    if request_id:
        headers["X-Request-Id"] = request_id
    return headers


def reply_headers(upstream: Mapping[str, str], decision: RouteDecision, request_id: str,
                  explain: bool) -> dict[str, str]:
    hop = hop_by_hop(upstream, HOP | {"date", "server", "x-request-id"})
    headers = {k: v for k, v in upstream.items() if k.lower() not in hop}
    headers["X-Request-Id"] = request_id
    if not explain:
        return headers
    headers["X-KVTier-Engine"] = decision.engine
    headers["X-KVTier-Route-Reason"] = decision.reason
    headers["X-KVTier-Predicted-Cached-Tokens"] = str(decision.predicted_cached)
    headers["X-KVTier-Predicted-TTFT"] = f"{decision.predicted_s:.4f}"
    return headers


class EventCutter:
    """A stream's bytes, cut into whole SSE events: :meth:`feed` returns the events a chunk completes and keeps the
    start of the next (:attr:`held`). Each byte is searched for an end about once, however many chunks an event
    comes in. An event held past :data:`MAX_EVENT` bytes goes on as it is: the router does not hold an engine's
    answer without bound."""

    def __init__(self) -> None:
        self._held = bytearray()
        self._from = 0  # where in _held an end may still start

    @property
    def held(self) -> bytes:
        return bytes(self._held)

    def feed(self, chunk: bytes) -> bytes:
        held = self._held
        held += chunk
        # a CR last may be the start of a CRLF: whether it ends a line is known with the next byte
        stop = len(held) - 1 if held.endswith(b"\r") else len(held)
        end = 0
        for match in EVENT_END.finditer(held, self._from, stop):
            end = match.end()
        if len(held) - end > MAX_EVENT:
            end = len(held)
        self._from = max(0, stop - (_LONGEST_END - 1) - end)
        whole = bytes(held[:end])
        del held[:end]
        return whole


def sse_error(message: str) -> bytes:
    """The event that ends a stream an engine failed; it follows the last whole event the client got."""
    error = {"error": {"message": message, "type": "upstream_error", "code": 502}}
    return b"data: " + json.dumps(error).encode() + b"\n\n"


def error_reply(status: int, message: str, kind: str, retry_after: bool = False) -> web.Response:
    headers = {"Retry-After": "1"} if retry_after else None
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)
