"""The interceptors' shared wrapping (service/guards/interceptors.py): a guard runs around every call,
streams included, and GuardedHandlers builds each wrapped handler once per method and key."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from kvserve.service.guards.interceptors import GuardedHandlers, guarded


def test_guarded_handlers_are_made_once_per_handler_and_key_and_the_guard_runs_every_call():
    entered = []

    @contextlib.asynccontextmanager
    async def guard(request, context):
        entered.append(request)
        yield request * 10

    async def unary(request, context):
        return request + 1

    async def stream(request, context):
        for i in range(request):
            yield i

    handlers = GuardedHandlers()
    made = []

    def make(h):
        made.append(h)
        return guarded(h, guard)

    u = grpc.unary_unary_rpc_method_handler(unary)
    s = grpc.unary_stream_rpc_method_handler(stream)
    first = handlers.get(u, "m", make)
    assert handlers.get(u, "m", make) is first and handlers.get(u, "other", make) is not first
    assert handlers.get(None, "m", make) is None
    streaming = handlers.get(s, "m", make)
    assert handlers.get(s, "m", make) is streaming and len(made) == 3

    async def calls():
        a = await first.unary_unary(1, None)
        b = await first.unary_unary(2, None)
        items = [i async for i in streaming.unary_stream(3, None)]
        return a, b, items

    assert asyncio.run(calls()) == (11, 21, list(range(30)))
    assert entered == [1, 2, 3]  # the guard ran for each call, though the handler was made once
