"""An OTLP/HTTP traces receiver on loopback (protobuf, as the SDK's HTTP exporter sends): collects the spans that
kvtier's processes and vLLM export, so a test can follow one request's trace across them."""

from __future__ import annotations

import dataclasses
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclasses.dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, object]


def _value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]  # a protobuf AnyValue, untyped
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]  # type: ignore[attr-defined]  # (the same)
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """``endpoint`` takes OTLP/HTTP exports; :attr:`spans` holds what arrived."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        got: list[Span] = []
        for resource in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope in resource.scope_spans:
                got.extend(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                {a.key: _value(a.value) for a in s.attributes}) for s in scope.spans)
        with self._lock:
            self.spans.extend(got)

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]
