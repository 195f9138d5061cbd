"""OpenTelemetry tracing: off unless an OTLP endpoint is set.

A process turns it on with configure() (`--otlp-endpoint` of the servers,
COMPILECAST_OTLP_ENDPOINT of a JAX process); spans then go to the endpoint
over OTLP/HTTP in batches. The trace context crosses processes in gRPC
metadata (W3C `traceparent`) for unary calls, and in the `trace_context` map
of an AcquireRequest or WaitRequest for the decisions and waits a worker
sends over its Decide stream. Off, every function here costs a check of one
attribute. Where the OpenTelemetry SDK is not installed
(`compilecast[otel]`), an endpoint is refused with one warning and tracing
stays off: compilecast never stops for it.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

log = logging.getLogger(__name__)

ENV = "COMPILECAST_OTLP_ENDPOINT"
EXPORT_DELAY_MS = 500  # how long a span waits for its batch
EXIT_EXPORT_S = 1.0  # the longest a stop (or a process's exit) waits for the last spans


class _State:
    tracer: Any = None
    provider: Any = None
    propagator: Any = None


_state = _State()


def on() -> bool:
    return _state.tracer is not None


def configure(endpoint: str, service: str, *, exporter: Any = None) -> bool:
    """Trace this process as `service`, to `endpoint` (OTLP/HTTP, e.g.
    http://collector:4318) or to `exporter` (a SpanExporter: the tests' in
    memory). False, and one warning, where it cannot."""
    if not endpoint and exporter is None:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        log.warning("tracing is off: the OpenTelemetry SDK is not installed "
                    "(pip install 'compilecast[otel]')")
        return False
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces", timeout=5)
    # Our own exit hook, not the SDK's: an endpoint that does not answer
    # delays an exit by EXIT_EXPORT_S at most, never by the exporter's retries.
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter,
                                                   schedule_delay_millis=EXPORT_DELAY_MS))
    _state.provider = provider
    _state.tracer = provider.get_tracer("compilecast")
    _state.propagator = TraceContextTextMapPropagator()
    atexit.register(shutdown)
    log.info("tracing to %s as %s", endpoint or type(exporter).__name__, service)
    return True


def shutdown(timeout_s: float = EXIT_EXPORT_S) -> None:
    """Export what is left, for at most `timeout_s`, and stop tracing: spans
    an unreachable endpoint has not taken by then are dropped (the export
    goes on in a daemon thread, which an exit does not wait for)."""
    provider, _state.provider, _state.tracer = _state.provider, None, None
    if provider is None:
        return

    def stop() -> None:
        with contextlib.suppress(Exception):
            provider.shutdown()

    stopping = threading.Thread(target=stop, name="compilecast-tracing-stop", daemon=True)
    stopping.start()
    stopping.join(timeout_s)
    if stopping.is_alive():
        log.info("tracing stopped: the spans not exported within %.1fs were dropped", timeout_s)


_OFF = contextlib.nullcontext()


def span(name: str, parent: Mapping[str, str] | None = None,
         **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span around the block (nothing when tracing is off: one check on a
    decision's path): a child of the current span, or of the context carried
    in `parent` (W3C headers)."""
    return _OFF if _state.tracer is None else _span(name, parent, attributes)


@contextlib.contextmanager
def _span(name: str, parent: Mapping[str, str] | None, attributes: dict) -> Iterator[Any]:
    context = _state.propagator.extract(carrier=dict(parent)) if parent else None
    with _state.tracer.start_as_current_span(
            name, context=context,
            attributes={k: v for k, v in attributes.items() if v is not None}) as s:
        yield s


def detached_span(name: str, parent: Mapping[str, str] | None = None,
                  **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """As span(), but never made the current span: for a block inside an
    async generator, which may be resumed or closed from another task."""
    return _OFF if _state.tracer is None else _detached_span(name, parent, attributes)


@contextlib.contextmanager
def _detached_span(name: str, parent: Mapping[str, str] | None,
                   attributes: dict) -> Iterator[Any]:
    context = _state.propagator.extract(carrier=dict(parent)) if parent else None
    s = _state.tracer.start_span(name, context=context, attributes={
        k: v for k, v in attributes.items() if v is not None})
    try:
        yield s
    finally:
        s.end()


def untraced() -> contextvars.Context:
    """A copy of the current context without its span: for a long-lived
    task started on a request's behalf (a batcher, a stream's runner), whose
    later work is nobody's child."""
    ctx = contextvars.copy_context()
    if _state.tracer is not None:
        from opentelemetry import context as otel

        ctx.run(otel.attach, otel.Context())
    return ctx


def inject(carrier: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """The current span's context into `carrier` (W3C headers); as it was
    when tracing is off or no span is current."""
    if _state.tracer is not None:
        _state.propagator.inject(carrier)
    return carrier


def metadata() -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying the current span's context."""
    return tuple(inject({}).items()) if _state.tracer is not None else ()


CARRIED = ("traceparent", "tracestate")
MAX_CARRIED_CHARS = 512


def carried(mapping: Mapping[str, str]) -> dict[str, str]:
    """The W3C headers of a request's `trace_context` map, bounded: anything
    else, or longer, is left out."""
    return {k: v for k, v in mapping.items() if k in CARRIED and len(v) <= MAX_CARRIED_CHARS}


def traced_unary(fn: Any, name: str) -> Any:
    """A unary gRPC handler `fn` in a server span named `name`, a child of
    the caller's span (its metadata); `fn` itself when tracing is off."""
    if _state.tracer is None:
        return fn

    async def handler(request: Any, context: Any) -> Any:
        headers = carried(dict(context.invocation_metadata() or ()))
        with span(name, headers, key=getattr(request, "key", None) or None):
            return await fn(request, context)

    return handler
