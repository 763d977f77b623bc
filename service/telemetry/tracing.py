"""OpenTelemetry tracing of the gRPC calls: where spans go, and the one server span per call.

Tracing is off unless ``--otlp-endpoint`` or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) names an OTLP/gRPC collector; then spans are
batched to it (``OTEL_SERVICE_NAME`` names the service, default ``kvserve``). Off, the tracer
is not even created; a caller's ``traceparent`` still puts its trace id in the logs.

Each RPC gets a SERVER span named after its method (``kvserve.v1.LLMService/Generate``) that
continues the caller's trace when the call carries W3C ``traceparent`` (and ``tracestate``)
metadata. Generation calls add events for the request's milestones (``queued`` when admitted,
``scheduled`` when its prefill started, ``first_token``) and, at the end, attributes for the
token counts and the finish reason (service/telemetry/calls.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvserve.service.methods import split_method

ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACER_NAME = "kvserve.service"
_PROPAGATOR = TraceContextTextMapPropagator()
# gRPC codes that are the server's failure, not the caller's (OpenTelemetry's gRPC conventions)
SERVER_ERROR_CODES = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})


def otlp_endpoint(flag: str | None) -> str | None:
    """The collector to export to: the flag, else the standard environment variables."""
    if flag:
        return flag
    return next((os.environ[e] for e in ENDPOINT_ENVS if os.environ.get(e)), None)


def create_provider(exporter: SpanExporter) -> TracerProvider:
    """A tracer provider that batches finished spans to ``exporter``."""
    name = os.environ.get("OTEL_SERVICE_NAME") or "kvserve"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def otlp_provider(endpoint: str) -> TracerProvider:
    """Spans to the OTLP/gRPC collector at ``endpoint`` (``http://host:4317``: plaintext)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    insecure = endpoint.startswith("http://") or "://" not in endpoint
    return create_provider(OTLPSpanExporter(endpoint=endpoint, insecure=insecure))


class Tracing:
    """The tracer the server uses; ``provider`` None = tracing off."""

    def __init__(self, provider: TracerProvider | None = None):
        self.provider = provider
        self.tracer = provider.get_tracer(TRACER_NAME) if provider else None

    @contextlib.contextmanager
    def server_span(self, method: str, metadata: Sequence[tuple[str, str | bytes]]) -> Iterator[trace.Span]:
        """The current span for one call to ``method`` ("/pkg.Service/Method"), continuing the
        trace named in the call's ``traceparent`` metadata if there is one."""
        carrier = {k: v for k, v in metadata if isinstance(v, str)}
        parent = _PROPAGATOR.extract(carrier)
        if self.provider is None:
            # no spans of our own, but the caller's trace id still reaches the logs
            span = trace.get_current_span(parent)
            with _current(trace.set_span_in_context(span, parent)):
                yield span
            return
        service, name = split_method(method)
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        span = self.tracer.start_span(f"{service}/{name}", context=parent, kind=SpanKind.SERVER,
                                      attributes=attributes)
        try:
            with _current(trace.set_span_in_context(span, parent)):
                yield span
        finally:
            span.end()

    def shutdown(self) -> None:
        """Send what is still batched, then stop."""
        if self.provider is not None:
            self.provider.shutdown()


@contextlib.contextmanager
def _current(ctx: otel_context.Context) -> Iterator[None]:
    """``ctx`` as the current OpenTelemetry context for the block. A cancelled stream's handler is
    closed by another asyncio task, where the reset has nothing to undo (the call's own context
    ended with it): skipped quietly, where OpenTelemetry's ``detach`` logs a traceback per stream."""
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            token.var.reset(token)


def end_span(span: trace.Span, code: grpc.StatusCode, details: str | None) -> None:
    """Record the call's gRPC status on its span."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, details or code.name))


def monotonic_to_ns(stamp: float) -> int:
    """A ``time.monotonic()`` stamp (taken in this process or the engine core: the clock is the
    machine's) as epoch nanoseconds, the unit of span event timestamps."""
    return time.time_ns() - int((time.monotonic() - stamp) * 1e9)
