"""OpenTelemetry traces of kvtier's work: off (every call a no-op) unless a process configures an exporter.

The router, the vLLM connector and the store each call :func:`span`. Spans join the trace of the request they
serve: the router starts it (or continues the client's W3C ``traceparent``) and passes ``traceparent`` on to the
engine; vLLM (started with ``--otlp-traces-endpoint``) hands the connector the request's trace headers; the
connector passes the context to the worker's load and save spans in its metadata; the store's tier reads nest
under the load, and a cascade write under the save that queued it.

kvtier keeps a tracer provider of its own (never the global one, which vLLM sets for its own spans), exporting
over OTLP/HTTP (protobuf) with a batching processor, so exporting never runs on the caller's thread.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvtier import _threadstart
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_lock = threading.Lock()
_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider, once configured
_tracer: Any = None
_propagator: Any = None
_endpoint: str | None = None


def enabled() -> bool:
    return _tracer is not None


def configure(endpoint: str, service_name: str) -> None:
    """Export this process's spans to the OTLP/HTTP ``endpoint`` (``http://collector:4318/v1/traces``).

    A second call with the same endpoint does nothing (several stores in one process share the exporter); another
    endpoint is refused, as one process exports to one collector."""
    global _endpoint
    with _lock:
        if _endpoint is not None:
            if endpoint != _endpoint:
                log.warning("kvtier tracing: already exporting to %s; %s ignored", _endpoint, endpoint)
            return
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ConfigError(f"otlp_traces_endpoint: traces need OpenTelemetry's SDK and OTLP exporter: pip "
                              f"install 'kvtier[tracing]' ({exc})") from exc

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        # its exporting thread where kvtier's threads run, named as kvtier's
        provider.add_span_processor(_threadstart.call(lambda: BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)),
                                                      "kvtier-traces"))
        _install(provider)
        _endpoint = endpoint
        atexit.register(provider.shutdown)  # the spans still queued are exported before the process ends
    log.info("kvtier tracing: spans of %s exported to %s", service_name, endpoint)


def use_provider(provider: Any) -> None:
    """Send spans to ``provider`` (an SDK ``TracerProvider``, e.g. with an in-memory exporter); None turns traces
    off again."""
    global _endpoint
    with _lock:
        _endpoint = None
        _install(provider)


def _install(provider: Any) -> None:
    global _provider, _tracer, _propagator
    if provider is None:
        _provider = _tracer = _propagator = None
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _provider, _tracer, _propagator = provider, provider.get_tracer("kvtier"), TraceContextTextMapPropagator()


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans ended so far (at shutdown, and in tests)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Flush and stop exporting (the process then traces nothing)."""
    global _endpoint
    with _lock:
        if _provider is not None:
            _provider.shutdown()
        _install(None)
        _endpoint = None


def context_of(headers: Mapping[str, str] | None) -> Any:
    """The trace context that W3C ``traceparent``/``tracestate`` in ``headers`` carry (None if none or off)."""
    if _tracer is None or not headers:
        return None
    lowered = {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
    return _propagator.extract(lowered) if lowered else None


def current() -> Any:
    """The calling thread's trace context, to continue on another thread (None when tracing is off)."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def headers() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the calling thread's current span, to send on with a request."""
    if _tracer is None:
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


_OFF = contextlib.nullcontext()  # reusable: what span() gives while tracing is off, at no cost per call


def span(name: str, parent: Any = None, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span around a ``with`` block, a child of ``parent`` (a context from :func:`context_of` or
    :func:`current`) or else of the current one. The block gets the span (None when tracing is off): set
    attributes on it as the work learns them. An exception leaving the block is recorded on the span."""
    if _tracer is None:
        return _OFF
    return _tracer.start_as_current_span(name, context=parent,
                                         attributes={k: v for k, v in attributes.items() if v is not None})


def carried(job: Callable[[], _T]) -> Callable[[], _T]:
    """``job``, to run on another thread within the calling thread's trace context (itself when tracing is off)."""
    if _tracer is None:
        return job
    return functools.partial(contextvars.copy_context().run, job)
