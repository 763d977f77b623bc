"""Running every call of a ``grpc.aio`` method handler inside a guard.

The server's interceptors (telemetry, API key, stream limits, malformed requests) each do or
decide something per call. ``guarded`` gives back the same handler (same serializers, same
streaming kind) whose behaviour first enters ``guard(request, context)``, an async context
manager that may end the call (``yield refuse(context, code, message)``: the method then does
not run), replace the request, and that stays entered until the call is over, streams included.

Calls end with an error status through ``refuse``, never ``context.abort``: abort raises
``AbortError``, which gRPC's own handler keeps in a reference cycle with every frame of the call
(its traceback), the request among them, until the garbage collector's next pass; the tuned
collector (engine/process/gc_tuning.py) seldom makes one in a quiet front-end, and 40 refused
requests of 15.9 M token ids kept 10 GiB that way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

Guard = Callable[[Any, grpc.aio.ServicerContext], AbstractAsyncContextManager]

_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
REFUSED = object()  # what a guard yields for a call it ended (``refuse``): the method is not run


def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> object:
    """End the call with ``code`` and ``message`` without raising (see the module's docstring);
    the handler then returns (None for a single response). Returns ``REFUSED``."""
    context.set_code(code)
    context.set_details(message)
    return REFUSED


def guarded(handler: grpc.RpcMethodHandler | None, guard: Guard) -> grpc.RpcMethodHandler | None:
    """``handler`` with each call run inside ``guard``; None (an unknown method) stays None."""
    if handler is None:
        return None
    kind = next(k for k in _KINDS if getattr(handler, k) is not None)
    behavior = getattr(handler, kind)
    if inspect.isasyncgenfunction(behavior):

        async def wrapped_stream(request, context):
            async with guard(request, context) as checked:
                if checked is REFUSED:
                    return
                async for message in behavior(checked, context):
                    yield message

        return handler._replace(**{kind: wrapped_stream})

    async def wrapped(request, context):
        async with guard(request, context) as checked:
            if checked is REFUSED:
                return None
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
