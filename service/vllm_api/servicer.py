"""The ``vllm.grpc.engine.VllmEngine`` handlers: vLLM's engine protocol, which the mesh gateways
(SMG's gRPC workers, llm-d's vLLM-gRPC parser) speak, over the same engine as kvserve.v1.

Generate streams per the request's ``stream`` flag: a chunk per delta of a choice, then one
``complete`` per choice (with stream = false only the completes, carrying the whole output).
Abort ends the named requests (their calls end with ``complete`` messages whose finish reason is
"abort"); a cancelled call aborts its request as kvserve's own API does. FlushCache, GetLoads,
GetTokenizer and SubscribeKvEvents report and act on the same engine.

Calls end with an error status through ``refuse`` (service/guards/interceptors.py says why, never
``context.abort``), as kvserve.v1's handlers do; ``--cache-salt-from`` salts Generate's requests
as it salts kvserve.v1's (the upstream request has no salt of its own).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import math
import time
from collections.abc import Callable

import grpc

from kvserve.engine.frontend.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from kvserve.engine.frontend.engine_state import EngineInfo, EngineState, ServerStats
from kvserve.service.api.errors import status_for
from kvserve.service.api.validation import CacheSalting, call_deadline
from kvserve.service.guards.interceptors import refuse
from kvserve.service.guards.redact import for_log
from kvserve.service.telemetry.calls import current_call
from kvserve.service.vllm_api import responses, tokenizer_bundle
from kvserve.service.vllm_api.requests import VllmRequest, parse_request
from kvserve.vllm import smg_common_pb2 as common
from kvserve.vllm import vllm_engine_pb2 as pb
from kvserve.vllm import vllm_engine_pb2_grpc

log = logging.getLogger("kvserve.service")

SERVER_TYPE = "vllm-grpc"  # what vLLM's own servicer reports; gateways key behaviour on it


class RequestAborted(Exception):
    """The Abort RPC named this request."""


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, engine: AsyncEngine, version: str = "", cache_salting: CacheSalting | None = None,
                 kv_events_refusal: Callable[[object], str | None] = lambda _: None):
        self._engine = engine
        self._kv_events_refusal = kv_events_refusal  # metadata -> why the caller may not read them
        self._salting = cache_salting or CacheSalting()
        self._version = version
        self._started = time.monotonic()
        self._last_receive = 0.0
        # (caller's tenant, request_id) -> its streams (ids may repeat): Abort reaches its caller's only
        self._live: dict[tuple[str, str], set[RequestStream]] = {}
        self._bundle: asyncio.Future | None = None

    # ---- generation -----------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context):
        self._last_receive = time.time()
        arrival = time.monotonic()
        call = current_call()  # the request's metrics, span and log line, as for kvserve.v1
        try:
            started = await self._start(request, context)
        except BaseException:  # the call was cancelled while its request was admitted
            call.refused(request.request_id)
            raise
        if started is None:
            call.refused(request.request_id)
            return
        req, stream = started
        call.admitted(req.request_id, arrival)
        stops = req.params.stop_token_ids
        choices = [responses.Choice() for _ in range(req.params.n)]
        open_choices = set(range(req.params.n))
        live = (self._salting.tenant(context.invocation_metadata()), req.request_id)
        self._live.setdefault(live, set()).add(stream)
        status = None
        try:
            async for out in stream:
                call.observe(out)
                choice = choices[out.index]
                choice.add(out)
                if req.stream and out.new_token_ids:
                    yield responses.chunk(out, req.logprobs)
                if out.finished:
                    open_choices.discard(out.index)
                    yield responses.complete(choice, out.index, req.logprobs, stops, whole=not req.stream)
        except RequestAborted:
            for i in sorted(open_choices):
                yield responses.complete(choices[i], i, req.logprobs, stops, whole=not req.stream,
                                         reason="abort")
        except Exception as e:  # noqa: BLE001 - mapped to a status below
            status = _status(e, req.request_id)
        finally:
            stream.close()
            streams = self._live.get(live)
            if streams is not None:
                streams.discard(stream)
                if not streams:
                    del self._live[live]
        if status is not None:
            refuse(context, *status)

    async def _start(self, request: pb.GenerateRequest, context) -> tuple[VllmRequest, RequestStream] | None:
        """Validate, salt and admit; a refusal ends the call with its status (and returns None)."""
        try:
            info = self._engine.info
            if info is None:
                raise EngineUnavailable("the model is still loading")
            req = parse_request(request, info.vocab_size, info.config.max_model_len,
                                info.sampling_defaults)
            if self._salting.source != "none":
                req.params.cache_salt = self._salting.salt(context.invocation_metadata(), None)
            prompt = req.prompt
            if req.truncate is not None and isinstance(prompt, str):  # token ids come truncated
                prompt = (await self._engine.tokenize(prompt))[-req.truncate:]
            return req, await self._engine.generate(req.request_id, prompt, req.params,
                                                    tenant=self._salting.tenant(context.invocation_metadata()),
                                                    deadline=call_deadline(context))
        except Exception as e:  # noqa: BLE001 - mapped to a status
            status = _status(e, request.request_id)
        refuse(context, *status)
        return None

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        """Ends the named requests of the caller's own tenant (``--cache-salt-from``): another
        tenant's request of the same id is not the caller's to end."""
        tenant = self._salting.tenant(context.invocation_metadata())
        for request_id in request.request_ids:
            for stream in list(self._live.get((tenant, request_id), ())):
                stream.fail(RequestAborted(request_id))
        return pb.AbortResponse()

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        refuse(context, grpc.StatusCode.UNIMPLEMENTED,
               "Embed: kvserve serves generative models only; it computes no embeddings")
        return None

    # ---- state ------------------------------------------------------------------------------------
    async def HealthCheck(self, request: pb.HealthCheckRequest, context) -> pb.HealthCheckResponse:
        state = self._engine.state
        if self._engine.healthy:
            return pb.HealthCheckResponse(healthy=True, message="serving")
        reason = self._engine.error if state == EngineState.DEAD else state.value
        if state == EngineState.READY:  # ready, but the core owes an answer and is silent
            reason = "the engine core is not answering"
        return pb.HealthCheckResponse(healthy=False, message=f"not serving: {reason}")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        try:
            info = await self._engine.model_info()
        except Exception as e:  # noqa: BLE001 - mapped to a status
            status = _status(e, "")
        else:
            return self._model_info(info)
        refuse(context, *status)
        return None

    def _model_info(self, info: EngineInfo) -> pb.GetModelInfoResponse:
        tokenizer, facts, model = self._engine.tokenizer, info.facts, info.config.model
        return pb.GetModelInfoResponse(
            model_path=model, is_generation=True, max_context_length=facts.max_model_len,
            vocab_size=facts.vocab_size, supports_vision=False, served_model_name=facts.model,
            tokenizer_path=model, model_type=facts.architecture, architectures=[facts.architecture],
            eos_token_ids=facts.eos_token_ids,
            pad_token_id=_token_id(tokenizer, "pad_token_id"),
            bos_token_id=_token_id(tokenizer, "bos_token_id"),
            max_req_input_len=facts.max_model_len - 1,
            default_sampling_params_json=json.dumps(facts.sampling_defaults),
        )

    async def _stats_or_refuse(self, context) -> ServerStats | None:
        """The engine's Stats, or None once the call is refused with the status its error maps to."""
        try:
            return await self._engine.stats()
        except Exception as e:  # noqa: BLE001 - mapped to a status
            refuse(context, *_status(e, ""))
            return None

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.GetServerInfoResponse:
        stats = await self._stats_or_refuse(context)
        return None if stats is None else self._server_info(stats)

    def _server_info(self, stats: ServerStats) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            active_requests=self._engine.num_in_flight, is_paused=False,
            last_receive_timestamp=self._last_receive, uptime_seconds=time.monotonic() - self._started,
            server_type=SERVER_TYPE, data_parallel_size=1, kv_cache_dtype=stats.kv_cache_dtype,
            block_size=stats.kv_block_size, attention_backend=stats.attention_backend,
            model_dtype=stats.dtype,
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"dp_rank: kvserve runs one data-parallel rank (0), got {request.dp_rank}")
            return None
        stats = await self._stats_or_refuse(context)
        return None if stats is None else self._loads(stats)

    def _loads(self, s: ServerStats) -> pb.GetLoadsResponse:
        total, free, block = s.kv_blocks_total, s.kv_blocks_free, s.kv_block_size
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=s.num_running, num_waiting_reqs=s.num_waiting + s.num_queued,
            num_total_reqs=s.num_running + s.num_waiting + s.num_queued,
            num_used_tokens=(total - free) * block, max_total_num_tokens=total * block,
            token_usage=(total - free) / total if total else 0.0, cache_hit_rate=s.prefix_cache_hit_rate,
            max_running_requests=self._engine.config.max_num_seqs,
        )
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        return pb.GetLoadsResponse(timestamp=now, version=self._version, dp_rank_count=1, loads=[load])

    # ---- the gateway's needs ----------------------------------------------------------------------------
    async def GetTokenizer(self, request: common.GetTokenizerRequest, context):
        tokenizer = self._engine.tokenizer
        if tokenizer is None:
            refuse(context, grpc.StatusCode.UNAVAILABLE, "the model is still loading")
            return
        if self._bundle is None:
            self._bundle = asyncio.get_running_loop().run_in_executor(
                None, tokenizer_bundle.build_bundle, tokenizer, self._engine.info.facts.model_dir)
        data, sha = await self._bundle
        pieces = tokenizer_bundle.chunks(data)
        for i, piece in enumerate(pieces):
            yield common.GetTokenizerChunk(data=piece, sha256=sha if i == len(pieces) - 1 else "")

    async def FlushCache(self, request: common.FlushCacheRequest, context) -> common.FlushCacheResponse:
        if not math.isfinite(request.timeout_s) or request.timeout_s < 0:
            message = f"timeout_s: must be a finite number >= 0, got {request.timeout_s}"
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, message)
            return None
        try:
            result = await self._engine.reset_prefix_cache(request.timeout_s)
        except Exception as e:  # noqa: BLE001 - mapped to a status
            status = _status(e, "")
        else:
            return common.FlushCacheResponse(success=result.success, message=result.message)
        refuse(context, *status)
        return None

    async def SubscribeKvEvents(self, request: common.SubscribeKvEventsRequest, context):
        hub = self._engine.kv_events
        if hub is None:
            refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                   "KV-cache events are off: start the server with --kv-events (or --kv-events-endpoint)")
            return
        refusal = self._kv_events_refusal(context.invocation_metadata())
        if refusal is not None:
            refuse(context, grpc.StatusCode.PERMISSION_DENIED, refusal)
            return
        # the headers at once: a subscriber (SMG) counts a stream without them after 2 s as a dead worker
        await context.send_initial_metadata(())
        try:
            async for batch in hub.subscribe(request.start_sequence_number):
                yield _kv_batch(batch)
        except OverflowError as e:  # the subscriber fell behind the hub's history
            status = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        else:
            return
        refuse(context, *status)


def _status(error: BaseException, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The call's status for ``error`` (INTERNAL is logged with its traceback). Called inside the
    ``except`` block; the handler ends the call after it with ``refuse``, so no frame keeps the
    exception (and with it the request) in a reference cycle."""
    if isinstance(error, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(error)
    code, message = status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        log.error("request %s failed", for_log(request_id or "-"), exc_info=error)
    return code, message


def _kv_batch(batch) -> common.KvEventBatch:
    """A hub batch (engine/frontend/kv_events.py) as the gateway's message."""
    from kvserve.engine.frontend.kv_events import BlockRemoved, BlockStored

    events = []
    for i, e in enumerate(batch.events):
        event_id = batch.sequence * 1_000_000 + i  # unique while a batch holds under a million events
        if isinstance(e, BlockStored):
            bs = e.block_size
            blocks = [common.KvBlock(block_hash=h, token_ids=e.token_ids[j * bs:(j + 1) * bs], block_size=bs)
                      for j, h in enumerate(e.block_hashes)]
            stored = common.KvBlocksStored(blocks=blocks, parent_block_hash=e.parent_block_hash)
            events.append(common.KvCacheEvent(event_id=event_id, stored=stored))
        elif isinstance(e, BlockRemoved):
            events.append(common.KvCacheEvent(event_id=event_id,
                                              removed=common.KvBlocksRemoved(block_hashes=e.block_hashes)))
        else:
            events.append(common.KvCacheEvent(event_id=event_id, cleared=common.KvCacheCleared()))
    return common.KvEventBatch(sequence_number=batch.sequence, timestamp=batch.timestamp, events=events,
                               dp_rank=0)


def _token_id(tokenizer, name: str) -> int:
    value = getattr(tokenizer, name, None) if tokenizer is not None else None
    return -1 if value is None else int(value)
