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
    tracer: Any = None  # the first service's: spans of no role's name
    providers: dict[str, Any]  # service -> its provider
    tracers: dict[str, Any]  # service -> its tracer
    propagator: Any = None

    def __init__(self) -> None:
        self.providers, self.tracers = {}, {}


_state = _State()
# A span's role by its name, where one process serves several (`compilecast up`:
# a coordinator and a worker): each role's spans go out as its own service.
ROLE_OF_PREFIX = (
    (("worker.", "WorkerService.", "DirectoriesService.", "RelayService."), "compilecast-worker"),
    (("coordinator.", "CoordinatorService.", "etcd.", "store.", "bucket."),
     "compilecast-coordinator"),
)


def _tracer_for(name: str) -> Any:
    for prefixes, service in ROLE_OF_PREFIX:
        if name.startswith(prefixes):
            return _state.tracers.get(service, _state.tracer)
    return _state.tracer


def on() -> bool:
    return _state.tracer is not None


def configure(endpoint: str, service: str, *, exporter: Any = None) -> bool:
    """Trace this process as `service`, to `endpoint` (OTLP/HTTP, e.g.
    http://collector:4318) or to `exporter` (a SpanExporter: the tests' in
    memory). False, and one warning, where it cannot. A process that serves
    several roles configures each: a span goes out as its role's service
    (ROLE_OF_PREFIX), else as the first configured."""
    if not endpoint and exporter is None:
        return False
    if service in _state.tracers:
        return True
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
    _state.providers[service] = provider
    _state.tracers[service] = provider.get_tracer("compilecast")
    if _state.tracer is None:
        _state.tracer = _state.tracers[service]
        _state.propagator = TraceContextTextMapPropagator()
        atexit.register(shutdown)
    log.info("tracing to %s as %s", endpoint or type(exporter).__name__, service)
    return True


def shutdown(timeout_s: float = EXIT_EXPORT_S) -> None:
    """Export what is left, for at most `timeout_s`, and stop tracing: spans
    an unreachable endpoint has not taken by then are dropped (the export
    goes on in a daemon thread, which an exit does not wait for)."""
    providers = list(_state.providers.values())
    _state.providers, _state.tracers, _state.tracer = {}, {}, None
    if not providers:
        return

    def stop() -> None:
        for provider in providers:
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
    with _tracer_for(name).start_as_current_span(
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
    s = _tracer_for(name).start_span(name, context=context, attributes={
        k: v for k, v in attributes.items() if v is not None})
    try:
        yield s
    finally:
        s.end()


@contextlib.contextmanager
def resumed(carrier: Mapping[str, str] | None) -> Iterator[None]:
    """The span whose context `carrier` holds (inject's W3C headers) is the
    current one in the block: later work of a request (a lease's release)
    joins its trace."""
    if _state.tracer is None or not carrier:
        yield
        return
    from opentelemetry import context as otel

    token = otel.attach(_state.propagator.extract(carrier=dict(carrier)))
    try:
        yield
    finally:
        otel.detach(token)


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
