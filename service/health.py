"""grpc.health.v1 for kvserve: ``""`` and ``kvserve.v1.LLMService`` are SERVING only while
the engine is ready and its core answers; NOT_SERVING while the model loads, while draining,
after the engine died, and while a core that owes an answer has been silent for a few seconds
(``CoreClient.stalled``: a stopped or stuck process) until it answers again."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kvserve.service.methods import LLM_SERVICE

HEALTH_SERVICES = ("", LLM_SERVICE.full_name)
# the default of `kvserve serve --health-port` (the Docker image sets it; its HEALTHCHECK probes it)
HEALTH_PORT_ENV = "KVSERVE_HEALTH_PORT"


class Health:
    """Owns the health servicer (create it inside the running event loop)."""

    def __init__(self) -> None:
        self.servicer = health_aio.HealthServicer()
        self._tasks: set[asyncio.Task] = set()

    async def set_serving(self, serving: bool) -> None:
        codes = health_pb2.HealthCheckResponse
        status = codes.SERVING if serving else codes.NOT_SERVING
        for name in HEALTH_SERVICES:
            await self.servicer.set(name, status)

    async def shutdown(self) -> None:
        """NOT_SERVING for good (later ``set_serving`` calls are ignored)."""
        await self.servicer.enter_graceful_shutdown()

    def on_engine_health(self, healthy: bool) -> None:
        """``AsyncEngine``'s ``on_health`` callback (runs on the event loop): ready, and the engine
        core answering (a stalled core, e.g. a stopped process, is NOT_SERVING until it answers)."""
        task = asyncio.ensure_future(self.set_serving(healthy))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
