"""Starts and stops what the server reports to the outside: the Prometheus endpoint
(``--metrics-port``) and the OpenTelemetry exporter (``--otlp-endpoint``), and builds the
interceptor that feeds them from every call (service/telemetry/calls.py)."""

from __future__ import annotations

import asyncio
import logging
import sys

from kvserve.engine.frontend.async_engine import AsyncEngine
from kvserve.service.telemetry.calls import Telemetry, TelemetryInterceptor
from kvserve.service.telemetry.metrics import Metrics, MetricsServer, snapshot_from_thread
from kvserve.service.telemetry.tracing import Tracing, otlp_endpoint, otlp_provider

log = logging.getLogger("kvserve.service")


class Observability:
    """Owns the metrics HTTP server and the tracer provider of one server."""

    def __init__(self, telemetry: Telemetry, metrics_server: MetricsServer | None):
        self.telemetry = telemetry
        self.metrics_server = metrics_server

    @classmethod
    def start(
        cls,
        model_name: str,
        engine: AsyncEngine,
        host: str,
        metrics_port: int | None,
        otlp: str | None,
    ) -> Observability:
        """Call on the server's event loop."""
        endpoint = otlp_endpoint(otlp)
        tracing = Tracing(otlp_provider(endpoint) if endpoint else None)
        metrics = server = None
        if metrics_port is not None:
            snapshot = snapshot_from_thread(engine.stats, asyncio.get_running_loop())
            metrics = Metrics(model_name, snapshot, lambda: engine.core_pid)
            server = MetricsServer(metrics, host, metrics_port)
            # printed whatever the log level, like the gRPC port: scripts read it
            where = f"[{host}]" if ":" in host else host
            print(f"kvserve: metrics on http://{where}:{server.port}/metrics", file=sys.stderr, flush=True)
        if endpoint:
            log.info("tracing: spans go to the OTLP collector at %s", endpoint)
        return cls(Telemetry(tracing, metrics), server)

    @property
    def interceptor(self) -> TelemetryInterceptor:
        return TelemetryInterceptor(self.telemetry)

    def stop(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.telemetry.tracing.shutdown()
