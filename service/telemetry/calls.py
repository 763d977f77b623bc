"""What each gRPC call reports: a server interceptor that wraps every call of every service in
one ``CallTelemetry``, and what the LLMService handlers tell it about their request.

Per call: a tracing span (service/telemetry/tracing.py) that continues the caller's trace, the count of
its gRPC status by method and code (service/telemetry/metrics.py), and, for generation calls, one log
line at the end (kvserve/logs.py: text or JSON) with the request id, token counts, queue time,
TTFT, total time, finish reason and status code, plus the request's timing histograms.

The request id is the ``request_id`` field, else the call's ``x-request-id`` metadata, else one
the server makes; the handlers use ``current_call()`` to reach the record of the call they serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from kvserve.engine.outputs import RequestOutput
from kvserve.service.api.responses import timing_of
from kvserve.service.guards.interceptors import GuardedHandlers, guarded
from kvserve.service.guards.redact import for_log
from kvserve.service.methods import LLM_SERVICE, VLLM_SERVICE, method_path, split_method
from kvserve.service.telemetry.metrics import Metrics
from kvserve.service.telemetry.tracing import Tracing, end_span, monotonic_to_ns

log = logging.getLogger("kvserve.service")

REQUEST_ID_HEADER = "x-request-id"
GENERATION_METHODS = frozenset((*(method_path(LLM_SERVICE, name) for name in ("Generate", "Stream")),
                                method_path(VLLM_SERVICE, "Generate")))
_CURRENT: contextvars.ContextVar[CallTelemetry | None] = contextvars.ContextVar("kvserve_call", default=None)


@dataclass
class Telemetry:
    """The server's sinks; ``metrics`` None = no Prometheus endpoint."""

    tracing: Tracing
    metrics: Metrics | None = None


class CallTelemetry:
    """One call: its span, its request (for generation calls) and how it ended."""

    def __init__(self, telemetry: Telemetry, method: str, span: trace.Span, header_request_id: str | None):
        self._telemetry = telemetry
        self.method = method
        self.span = span
        self.header_request_id = header_request_id
        self.request_id: str | None = None
        self.arrival = time.monotonic()
        self._last_token_at: float | None = None
        self._tokens_sent = 0
        self._final: RequestOutput | None = None

    def admitted(self, request_id: str, arrival: float) -> None:
        """The engine took the request (``arrival``: when the handler received it)."""
        self.request_id, self.arrival = request_id, arrival
        self.span.set_attribute("kvserve.request_id", request_id)
        self.span.add_event("queued")

    def refused(self, request_id: str) -> None:
        """The request was refused before the engine took it (its log line still names it)."""
        self.request_id = request_id or self.header_request_id or "-"  # cut by for_log when logged

    def observe(self, out: RequestOutput) -> None:
        """One of the request's outputs is going out to the client."""
        now = time.monotonic()
        metrics = self._telemetry.metrics
        n = len(out.new_token_ids)
        if n:
            if self._last_token_at is None:
                self._first_token_events(out, now)
                if metrics is not None and n > 1:  # tokens that went out with the first one
                    metrics.observe_token_gap(0.0, n - 1)
            elif metrics is not None:
                metrics.observe_token_gap(now - self._last_token_at, n)
            self._last_token_at = now
            self._tokens_sent += n
        if out.finished:
            self._final = out
            if metrics is not None:
                t = timing_of(out.times, self.arrival)
                ttft = t.ttft_ms / 1000 if out.times.first_token is not None else None
                metrics.observe_request(t.queue_ms / 1000, ttft, t.total_ms / 1000, _reason(out))

    def _first_token_events(self, out: RequestOutput, now: float) -> None:
        if out.times.first_scheduled is not None:
            self.span.add_event("scheduled", timestamp=monotonic_to_ns(out.times.first_scheduled))
        self.span.add_event("first_token", timestamp=monotonic_to_ns(out.times.first_token or now))

    def end(self, code: grpc.StatusCode, details: str | None) -> None:
        """The call is over with ``code``: count it, close the span's books, log the request."""
        if self._telemetry.metrics is not None:
            self._telemetry.metrics.count_call(self.method, code.name)
        end_span(self.span, code, details)
        if self.request_id is not None or (code != grpc.StatusCode.OK and self._is_generation()):
            self._log_request(code, details)

    def _is_generation(self) -> bool:
        return self.method in GENERATION_METHODS

    def _log_request(self, code: grpc.StatusCode, details: str | None) -> None:
        fields = self._request_fields(code)
        rid = fields["request_id"]
        if self._final is not None:
            message = f"request {rid} finished"
        elif code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            message = f"request {rid} cancelled (client cancel or deadline) after {self._tokens_sent} tokens"
        else:
            message = f"request {rid} ended: {code.name}: {for_log(details, 256)}"
        self.span.set_attributes(_span_attributes(fields))
        log.info(message, extra={"fields": fields})

    def _request_fields(self, code: grpc.StatusCode) -> dict:
        """The request's log fields."""
        # client-given: cut and escaped, so a huge id stays short and a newline forges no line
        fields: dict = {"request_id": for_log(self.request_id or self.header_request_id or "-"),
                        "method": split_method(self.method)[1], "status": code.name}
        out = self._final
        if out is None:
            fields["completion_tokens"] = self._tokens_sent
            fields["total_ms"] = (time.monotonic() - self.arrival) * 1000
            return fields
        t = timing_of(out.times, self.arrival)
        fields.update(
            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens, queue_ms=t.queue_ms, ttft_ms=t.ttft_ms, total_ms=t.total_ms,
            finish_reason=_reason(out),
        )
        return fields


def _reason(out: RequestOutput) -> str:
    return out.finish_reason.name if out.finish_reason is not None else "UNSPECIFIED"


def _span_attributes(fields: dict) -> dict:
    names = {"prompt_tokens": "gen_ai.usage.input_tokens", "completion_tokens": "gen_ai.usage.output_tokens",
             "cached_tokens": "kvserve.usage.cached_tokens"}
    attrs = {names[k]: v for k, v in fields.items() if k in names}
    if "finish_reason" in fields:
        attrs["gen_ai.response.finish_reasons"] = [fields["finish_reason"]]
    return attrs


def current_call() -> CallTelemetry:
    """The record of the call this handler serves (installed by ``TelemetryInterceptor``)."""
    call = _CURRENT.get()
    if call is None:
        raise RuntimeError("no CallTelemetry: the server was built without TelemetryInterceptor")
    return call


class TelemetryInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method handler so that each call runs inside its ``CallTelemetry``."""

    def __init__(self, telemetry: Telemetry):
        self._telemetry = telemetry
        self._handlers = GuardedHandlers()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        return self._handlers.get(handler, method,
                                  lambda h: guarded(h, functools.partial(self._watch, method)))

    @contextlib.asynccontextmanager
    async def _watch(self, method: str, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        metadata = tuple(context.invocation_metadata() or ())
        header_id = next((v for k, v in metadata if k == REQUEST_ID_HEADER and isinstance(v, str)), None)
        with self._telemetry.tracing.server_span(method, metadata) as span:
            call = CallTelemetry(self._telemetry, method, span, header_id)
            token = _CURRENT.set(call)
            code, details = grpc.StatusCode.OK, None
            try:
                yield request
                code, details = context.code() or code, context.details()
            except (asyncio.CancelledError, GeneratorExit):
                code = _cancel_code(context)
                raise
            except BaseException:
                code, details = context.code() or grpc.StatusCode.UNKNOWN, context.details()
                raise
            finally:
                call.end(_as_status(code), details)
                with contextlib.suppress(ValueError):  # reset from another context: nothing to undo
                    _CURRENT.reset(token)


def _cancel_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= 0
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED


def _as_status(code) -> grpc.StatusCode:
    if isinstance(code, grpc.StatusCode):
        return code
    return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
