"""The synchronous Python client.

    with Client("127.0.0.1:50051") as c:
        print(c.generate("Hello", max_tokens=16, temperature=0).text)
        for delta in c.stream("Hello", max_tokens=16):
            print(delta.text, end="", flush=True)

Errors are ``grpc.RpcError`` with the server's status code (``e.code()``) and message
(``e.details()``): INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

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


class Client(ClientBase):
    grpc_module = grpc

    def generate(self, prompt: str | None = None, *, token_ids: Iterable[int] | None = None,
                 messages: Iterable[Message] | None = None, request_id: str = "",
                 priority: int = 0, timeout: float | None = None, **sampling) -> Completion:
        """The whole completion of one prompt (text, token ids or chat messages)."""
        req = build_request(prompt, token_ids=token_ids, messages=messages, request_id=request_id,
                            priority=priority, **sampling)
        return completion_from_proto(self._stub.Generate(req, **self._call_options(timeout)))

    def stream(self, prompt: str | None = None, *, token_ids: Iterable[int] | None = None,
               messages: Iterable[Message] | None = None, request_id: str = "",
               priority: int = 0, timeout: float | None = None, **sampling) -> Iterator[Delta]:
        """Yields the completion piece by piece; leaving the loop early cancels the request."""
        req = build_request(prompt, token_ids=token_ids, messages=messages, request_id=request_id,
                            priority=priority, **sampling)
        call = self._stub.Stream(req, **self._call_options(timeout))
        try:
            for msg in call:
                yield delta_from_proto(msg)
        finally:
            call.cancel()  # no-op when the stream already ended

    def stats(self, timeout: float | None = None) -> dict:
        return stats_to_dict(self._stub.Stats(llm_pb2.StatsRequest(), **self._call_options(timeout)))

    def watch_stats(self, interval_ms: int = 1000) -> Iterator[dict]:
        call = self._stub.WatchStats(llm_pb2.WatchStatsRequest(interval_ms=interval_ms),
                                     metadata=self._metadata)
        try:
            for msg in call:
                yield stats_to_dict(msg)
        finally:
            call.cancel()

    def tokenize(self, prompt: str | None = None, *, messages: Iterable[Message] | None = None,
                 timeout: float | None = None) -> list[int]:
        """The token ids ``generate`` would run on for this prompt (text or chat messages)."""
        req = build_tokenize_request(prompt, messages)
        return list((self._stub.Tokenize(req, **self._call_options(timeout))).token_ids)

    def model_info(self, timeout: float | None = None) -> dict:
        """The served model: name, architecture, max_model_len, vocab_size, dtype, eos_token_ids, ..."""
        req = llm_pb2.ModelInfoRequest()
        return stats_to_dict(self._stub.ModelInfo(req, **self._call_options(timeout)))

    def health(self, service: str = SERVICE_NAME, timeout: float | None = None) -> str:
        """"SERVING" or "NOT_SERVING" ("" is the whole server, the default is LLMService)."""
        req = health_pb2.HealthCheckRequest(service=service)
        resp = self._health.Check(req, **self._call_options(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 120.0, poll_s: float = 0.2) -> None:
        """Block until the service answers SERVING; TimeoutError after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=max(poll_s, 1.0)) == "SERVING":
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > end:
                raise TimeoutError(f"the server was not SERVING within {timeout} s")
            time.sleep(poll_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
