"""Which gRPC status an error becomes: the one place that decides it (docs/deployment/limits.md
lists them by cause).

Messages are cut to ``STATUS_MESSAGE_CHARS``: they travel in a trailer, and one larger than
the peer's metadata limit would reach the client as a different error (a 100 KB chat role
came back as RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT).
"""

from __future__ import annotations

import grpc

from kvserve.engine.frontend.engine_state import DeadlineUnmet, EngineOverloaded, EngineUnavailable
from kvserve.service.guards.redact import STATUS_MESSAGE_CHARS, clip


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception raised while serving a request to (status code, message)."""
    code, message = _classify(error)
    return code, clip(message, STATUS_MESSAGE_CHARS)


def _classify(error: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, ValueError):  # the user's mistake; the message names the field
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, DeadlineUnmet):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    if isinstance(error, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
