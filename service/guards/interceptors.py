"""Running every call of a ``grpc.aio`` method handler inside a guard.

The server's interceptors (telemetry, API key, stream limits, malformed requests) each do or
decide something per call. ``guarded`` gives back the same handler (same serializers, same
streaming kind) whose behaviour first enters ``guard(request, context)``, an async context
manager that may end the call (``await context.abort(...)``), replace the request, and that
stays entered until the call is over, streams included.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

Guard = Callable[[Any, grpc.aio.ServicerContext], AbstractAsyncContextManager]

_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def guarded(handler: grpc.RpcMethodHandler | None, guard: Guard) -> grpc.RpcMethodHandler | None:
    """``handler`` with each call run inside ``guard``; None (an unknown method) stays None."""
    if handler is None:
        return None
    kind = next(k for k in _KINDS if getattr(handler, k) is not None)
    behavior = getattr(handler, kind)
    if inspect.isasyncgenfunction(behavior):

        async def wrapped_stream(request, context):
            async with guard(request, context) as checked:
                async for message in behavior(checked, context):
                    yield message

        return handler._replace(**{kind: wrapped_stream})

    async def wrapped(request, context):
        async with guard(request, context) as checked:
            return await behavior(checked, context)

    return handler._replace(**{kind: wrapped})


class GuardedHandlers:
    """``guarded`` handlers made once per (method handler, key) and reused by every later call:
    the wrapping is the same for every call of a method (only what the guard does is per call),
    so the per-call cost is one dictionary lookup instead of new handler tuples and closures."""

    def __init__(self) -> None:
        self._made: dict[tuple[grpc.RpcMethodHandler, Any], grpc.RpcMethodHandler | None] = {}

    def get(self, handler: grpc.RpcMethodHandler | None, key: Any,
            make: Callable[[grpc.RpcMethodHandler], Any]) -> grpc.RpcMethodHandler | None:
        """``make(handler)`` the first time (``handler``, ``key``) is seen; None stays None. Keys
        must come from a small fixed set (method names, flags, fixed messages): every pair is kept."""
        if handler is None:
            return None
        made = self._made.get((handler, key))
        if made is None:
            made = self._made[(handler, key)] = make(handler)
        return made
