"""The ``kvserve.v1.LLMService`` handlers: Generate, Stream, Stats, WatchStats.

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
from typing import NoReturn

import grpc

from kvserve.engine.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from kvserve.engine.generation_defaults import sampling_defaults
from kvserve.engine.outputs import RequestOutput
from kvserve.service.errors import status_for
from kvserve.service.limits import MIN_WATCH_INTERVAL_MS
from kvserve.service.redact import for_log
from kvserve.service.responses import CompletionBuilder, stats_response, stream_response
from kvserve.service.validation import EngineRequest, parse_generate_request
from kvserve.v1 import llm_pb2, llm_pb2_grpc

log = logging.getLogger("kvserve.service")

DEFAULT_WATCH_INTERVAL_MS = 1000


class LLMServicer(llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, engine: AsyncEngine):
        self._engine = engine
        self._started = time.monotonic()

    async def Generate(self, request: llm_pb2.GenerateRequest, context) -> llm_pb2.GenerateResponse:
        arrival = time.monotonic()
        req, stream = await self._start(request, context)
        done = CompletionBuilder(req.request_id, arrival, req.params.n)
        error = None
        try:
            async for out in stream:
                done.add(out)
                if out.finished:
                    self._log_finished(req, out, arrival)
        except asyncio.CancelledError:
            self._log_cancelled(req, done.num_tokens, arrival)
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status below
            error = e
        finally:
            stream.close()
        if error is not None:
            await self._fail(context, error, req.request_id)
        return done.response

    async def Stream(self, request: llm_pb2.GenerateRequest, context):
        arrival = time.monotonic()
        req, stream = await self._start(request, context)
        sent = 0
        error = None
        try:
            async for out in stream:
                if out.new_token_ids or out.new_text or out.finished:
                    sent += len(out.new_token_ids)
                    yield stream_response(req.request_id, out, arrival)
                if out.finished:
                    self._log_finished(req, out, arrival)
        except asyncio.CancelledError:
            self._log_cancelled(req, sent, arrival)
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status below
            error = e
        finally:
            stream.close()  # also runs when the call ends while we wait at `yield`
        if error is not None:
            await self._fail(context, error, req.request_id)

    async def Stats(self, request: llm_pb2.StatsRequest, context) -> llm_pb2.StatsResponse:
        return await self._snapshot(context)

    async def WatchStats(self, request: llm_pb2.WatchStatsRequest, context):
        interval_ms = request.interval_ms or DEFAULT_WATCH_INTERVAL_MS
        if interval_ms < MIN_WATCH_INTERVAL_MS:
            await self._fail(
                context,
                ValueError(f"interval_ms: must be >= {MIN_WATCH_INTERVAL_MS} (0 = 1000), got {interval_ms}"),
                "",
            )
        while True:
            yield await self._snapshot(context)
            await asyncio.sleep(interval_ms / 1000.0)

    # ---- helpers -----------------------------------------------------------------------------
    async def _start(self, request: llm_pb2.GenerateRequest, context) -> tuple[EngineRequest, RequestStream]:
        """Validate and admit; any refusal ends the call with its status."""
        try:
            info = self._engine.info
            if info is None:
                raise EngineUnavailable("the model is still loading")
            req = parse_generate_request(request, info.vocab_size, sampling_defaults(info.config.model))
            stream = await self._engine.generate(req.request_id, req.prompt, req.params, req.messages)
            return req, stream
        except Exception as e:  # noqa: BLE001 - mapped to a status
            error = e
        await self._fail(context, error, request.request_id)

    async def _snapshot(self, context) -> llm_pb2.StatsResponse:
        try:
            stats = await self._engine.stats()
        except Exception as e:  # noqa: BLE001 - mapped to a status
            await self._fail(context, e, "")
        stats["uptime_s"] = time.monotonic() - self._started
        return stats_response(stats)

    async def _fail(self, context, error: BaseException, request_id: str) -> NoReturn:
        code, message = status_for(error)
        if code == grpc.StatusCode.INTERNAL:
            log.error("request %s failed", for_log(request_id or "-"), exc_info=error)
        else:
            log.info("request %s ended: %s: %s", for_log(request_id or "-"), code.name, for_log(message, 256))
        await context.abort(code, message)

    def _log_finished(self, req: EngineRequest, out: RequestOutput, arrival: float) -> None:
        t = out.times
        ttft = (t.first_token - arrival) * 1000 if t.first_token is not None else float("nan")
        total = ((t.finished or time.monotonic()) - arrival) * 1000
        reason = out.finish_reason.name if out.finish_reason is not None else "-"
        log.info(
            "request %s finished: prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
            "ttft_ms=%.1f total_ms=%.1f finish_reason=%s",
            for_log(req.request_id), out.prompt_tokens, out.completion_tokens, out.cached_tokens, ttft, total,
            reason,
        )

    def _log_cancelled(self, req: EngineRequest, tokens: int, arrival: float) -> None:
        log.info(
            "request %s cancelled (client cancel or deadline) after %d tokens, %.1f ms; aborting it",
            for_log(req.request_id), tokens, (time.monotonic() - arrival) * 1000,
        )
