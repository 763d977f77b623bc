"""Which gRPC status an error becomes (DESIGN.md §3): the one place that decides it."""

from __future__ import annotations

import grpc

from kvserve.engine.engine_state import EngineOverloaded, EngineUnavailable


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception raised while serving a request to (status code, message)."""
    if isinstance(error, ValueError):  # the user's mistake; the message names the field
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
