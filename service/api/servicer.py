"""The ``kvserve.v1.LLMService`` handlers: Generate, Stream, Stats, WatchStats, Tokenize, ModelInfo.

Handlers only produce work for the engine core (through ``AsyncEngine``, which tokenizes
off the event loop and batches what the handlers produce) and turn its outputs into
messages; a stream that fell behind gets its waiting deltas as one message. A cancelled call
(client cancel or deadline) cancels the handler's task; closing the request's stream then
aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import msgspec

from kvserve.engine.frontend.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from kvserve.service.api.errors import status_for
from kvserve.service.api.responses import (
    CompletionBuilder,
    model_info_response,
    stats_response,
    stream_response,
)
from kvserve.service.api.validation import (
    CacheSalting,
    EngineRequest,
    call_deadline,
    parse_generate_request,
    parse_tokenize_request,
)
from kvserve.service.guards.interceptors import refuse
from kvserve.service.guards.limits import MIN_WATCH_INTERVAL_MS
from kvserve.service.guards.redact import for_log
from kvserve.service.telemetry.calls import REQUEST_ID_HEADER, CallTelemetry, current_call
from kvserve.v1 import llm_pb2, llm_pb2_grpc

log = logging.getLogger("kvserve.service")

DEFAULT_WATCH_INTERVAL_MS = 1000


class LLMServicer(llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, engine: AsyncEngine, cache_salting: CacheSalting | None = None):
        self._engine = engine
        self._salting = cache_salting or CacheSalting()
        self._started = time.monotonic()

    async def Generate(self, request: llm_pb2.GenerateRequest, context) -> llm_pb2.GenerateResponse:
        arrival = time.monotonic()
        call = current_call()
        started = await self._start(request, context, call, arrival)
        if started is None:
            return None
        req, stream = started
        done = CompletionBuilder(req.request_id, arrival, self._engine.token_text, req.params.n)
        status = None
        try:
            async for out in stream:
                done.add(out)
                call.observe(out)
        except Exception as e:  # noqa: BLE001 - mapped to a status below
            status = _status(e, req.request_id)
        finally:
            stream.close()
        if status is not None:
            refuse(context, *status)
            return None
        return done.response

    async def Stream(self, request: llm_pb2.GenerateRequest, context):
        arrival = time.monotonic()
        call = current_call()
        started = await self._start(request, context, call, arrival)
        if started is None:
            return
        req, stream = started
        status = None
        try:
            async for out in stream:
                if out.new_token_ids or out.new_text or out.finished:
                    call.observe(out)
                    yield stream_response(req.request_id, out, arrival, self._engine.token_text)
        except Exception as e:  # noqa: BLE001 - mapped to a status below
            status = _status(e, req.request_id)
        finally:
            stream.close()  # also runs when the call ends while we wait at `yield`
        if status is not None:
            refuse(context, *status)

    async def Stats(self, request: llm_pb2.StatsRequest, context) -> llm_pb2.StatsResponse:
        return await self._snapshot(context)

    async def WatchStats(self, request: llm_pb2.WatchStatsRequest, context):
        interval_ms = request.interval_ms or DEFAULT_WATCH_INTERVAL_MS
        if interval_ms < MIN_WATCH_INTERVAL_MS:
            message = f"interval_ms: must be >= {MIN_WATCH_INTERVAL_MS} (0 = 1000), got {interval_ms}"
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, message)
            return
        while (snapshot := await self._snapshot(context)) is not None:
            yield snapshot
            await asyncio.sleep(interval_ms / 1000.0)

    async def Tokenize(self, request: llm_pb2.TokenizeRequest, context) -> llm_pb2.TokenizeResponse:
        try:
            info = self._engine.info
            prompt, messages = parse_tokenize_request(request, info.max_model_len if info else None)
            ids = await self._engine.tokenize(prompt, messages)
            return llm_pb2.TokenizeResponse(token_ids=ids, count=len(ids))
        except Exception as e:  # noqa: BLE001 - mapped to a status
            status = _status(e, "")
        refuse(context, *status)
        return None

    async def ModelInfo(self, request: llm_pb2.ModelInfoRequest, context) -> llm_pb2.ModelInfoResponse:
        try:
            return model_info_response(await self._engine.model_info())
        except Exception as e:  # noqa: BLE001 - mapped to a status
            status = _status(e, "")
        refuse(context, *status)
        return None

    # ---- helpers -----------------------------------------------------------------------------
    async def _start(
        self, request: llm_pb2.GenerateRequest, context, call: CallTelemetry, arrival: float
    ) -> tuple[EngineRequest, RequestStream] | None:
        """Validate and admit; any refusal ends the call with its status (and returns None). The
        request id goes back as ``x-request-id`` metadata too when the call sent that header."""
        try:
            info = self._engine.info
            if info is None:
                raise EngineUnavailable("the model is still loading")
            req = parse_generate_request(request, info.vocab_size, info.sampling_defaults,
                                         call.header_request_id, info.max_model_len)
            metadata = context.invocation_metadata()
            if self._salting.source != "none":
                req.params.cache_salt = self._salting.salt(metadata, req.params.cache_salt)
            stream = await self._engine.generate(req.request_id, req.prompt, req.params, req.messages,
                                                 tenant=self._salting.tenant(metadata), priority=req.priority,
                                                 deadline=call_deadline(context))
            call.admitted(req.request_id, arrival)
            # echoed to callers that sent the header: sending headers ahead of the first message is
            # one more write and completion per call (a fifth of the front-end's work per short call)
            echo = call.header_request_id is not None
            if echo and req.request_id.isascii() and req.request_id.isprintable():  # else not legal metadata
                await context.send_initial_metadata(((REQUEST_ID_HEADER, req.request_id),))
            return req, stream
        except Exception as e:  # noqa: BLE001 - mapped to a status
            status = _status(e, request.request_id)
        call.refused(request.request_id)
        refuse(context, *status)
        return None

    async def _snapshot(self, context) -> llm_pb2.StatsResponse | None:
        """A Stats message, or None once the call was ended with the engine's error."""
        try:
            stats = await self._engine.stats()
        except Exception as e:  # noqa: BLE001 - mapped to a status
            status = _status(e, "")
        else:
            return stats_response(msgspec.structs.replace(stats, uptime_s=time.monotonic() - self._started))
        refuse(context, *status)
        return None


def _status(error: BaseException, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The call's status for ``error`` (INTERNAL is logged with its traceback). Handlers call it
    inside their ``except`` block and end the call after it with ``refuse`` (never
    ``context.abort``: service/guards/interceptors.py says why): a frame that kept the exception
    would form a cycle (frame -> exception -> traceback -> frame) holding the request until the
    garbage collector's next pass (a refused 15.9 M-id request held 255 MiB that way)."""
    code, message = status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        log.error("request %s failed", for_log(request_id or "-"), exc_info=error)
    return code, message  # the call's log line (service/telemetry/calls.py) tells the rest
