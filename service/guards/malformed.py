"""Malformed request bytes end the call with INVALID_ARGUMENT.

A request deserializer that raises makes grpc.aio answer UNKNOWN, with the Python class name
of the parse error in the message. This interceptor gives every method a deserializer that
never raises (it hands the error on as a ``Malformed`` value) and a guard that ends a call
holding one with INVALID_ARGUMENT, for single requests and for request streams alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from kvserve.service.guards.interceptors import GuardedHandlers, guarded, refuse


@dataclass(frozen=True)
class Malformed:
    """What the safe deserializer returns for bytes that do not parse."""

    error: str


def _safe(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, and whatever a parser raises
            return Malformed(f"{type(e).__name__}: {e}")

    return deserialize


def _message(bad: Malformed) -> str:
    return f"request: not a valid message of this method's type ({bad.error[:200]})"


@asynccontextmanager
async def _check(request, context: grpc.aio.ServicerContext):
    if isinstance(request, Malformed):
        yield refuse(context, grpc.StatusCode.INVALID_ARGUMENT, _message(request))
        return
    if hasattr(request, "__aiter__"):
        request = _checked_stream(request, context)
    yield request


async def _checked_stream(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
    async for request in requests:
        if isinstance(request, Malformed):  # mid-stream the call can only end by raising
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
        yield request


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._handlers = GuardedHandlers()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return self._handlers.get(handler, None, _checked)


def _checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler | None:
    """``handler`` with a deserializer that cannot raise and the check of its result."""
    return guarded(handler._replace(request_deserializer=_safe(handler.request_deserializer)), _check)
