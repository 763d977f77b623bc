"""The asyncio Python client: the same calls as ``Client``, awaitable.

    async with AsyncClient("127.0.0.1:50051") as c:
        done = await c.generate("Hello", max_tokens=16)
        async for delta in c.stream("Hello", max_tokens=16):
            print(delta.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable

import grpc
from grpc_health.v1 import health_pb2

from kvserve.clients.base import ClientBase
from kvserve.clients.messages import (
    SERVICE_NAME,
    Completion,
    Delta,
    Message,
    build_request,
    build_tokenize_request,
    completion_from_proto,
    delta_from_proto,
    stats_to_dict,
)
from kvserve.v1 import llm_pb2


class AsyncClient(ClientBase):
    grpc_module = grpc.aio

    async def generate(self, prompt: str | None = None, *, token_ids: Iterable[int] | None = None,
                       messages: Iterable[Message] | None = None, request_id: str = "",
                       priority: int = 0, timeout: float | None = None, **sampling) -> Completion:
        req = build_request(prompt, token_ids=token_ids, messages=messages, request_id=request_id,
                            priority=priority, **sampling)
        return completion_from_proto(await self._stub.Generate(req, **self._call_options(timeout)))

    async def stream(self, prompt: str | None = None, *, token_ids: Iterable[int] | None = None,
                     messages: Iterable[Message] | None = None, request_id: str = "",
                     priority: int = 0, timeout: float | None = None, **sampling) -> AsyncIterator[Delta]:
        """Async-iterates the completion; closing the iterator early cancels the request."""
        req = build_request(prompt, token_ids=token_ids, messages=messages, request_id=request_id,
                            priority=priority, **sampling)
        call = self._stub.Stream(req, **self._call_options(timeout))
        try:
            async for msg in call:
                yield delta_from_proto(msg)
        finally:
            call.cancel()

    async def stats(self, timeout: float | None = None) -> dict:
        return stats_to_dict(await self._stub.Stats(llm_pb2.StatsRequest(), **self._call_options(timeout)))

    async def watch_stats(self, interval_ms: int = 1000) -> AsyncIterator[dict]:
        call = self._stub.WatchStats(llm_pb2.WatchStatsRequest(interval_ms=interval_ms),
                                     metadata=self._metadata)
        try:
            async for msg in call:
                yield stats_to_dict(msg)
        finally:
            call.cancel()

    async def tokenize(self, prompt: str | None = None, *, messages: Iterable[Message] | None = None,
                 timeout: float | None = None) -> list[int]:
        """The token ids ``generate`` would run on for this prompt (text or chat messages)."""
        req = build_tokenize_request(prompt, messages)
        return list((await self._stub.Tokenize(req, **self._call_options(timeout))).token_ids)

    async def model_info(self, timeout: float | None = None) -> dict:
        """The served model: name, architecture, max_model_len, vocab_size, dtype, eos_token_ids, ..."""
        req = llm_pb2.ModelInfoRequest()
        return stats_to_dict(await self._stub.ModelInfo(req, **self._call_options(timeout)))

    async def health(self, service: str = SERVICE_NAME, timeout: float | None = None) -> str:
        req = health_pb2.HealthCheckRequest(service=service)
        resp = await self._health.Check(req, **self._call_options(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_ready(self, timeout: float = 120.0, poll_s: float = 0.2) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                if await self.health(timeout=max(poll_s, 1.0)) == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"the server was not SERVING within {timeout} s")
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
