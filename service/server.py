"""The gRPC server: LLMService + grpc.health.v1 + reflection on one grpc.aio server, its
channel options, start-up while the model loads, the SIGTERM/SIGINT drain, and the exit
when the engine dies.

With ``--health-port`` a second server answers grpc.health.v1 alone, in plaintext, from the
same health state: probes that cannot present the server's TLS settings (Docker's
HEALTHCHECK, Kubernetes' gRPC probes, which never do TLS) still see SERVING / NOT_SERVING,
while everything else stays behind TLS and the API key. It shows nothing but that status.

This process is the front-end: it owns the network, tokenization and admission; the engine
core (scheduler, model, sampler, detokenizer) runs in a child process that ``AsyncEngine``
starts (engine/frontend/async_engine.py). If the engine dies, the requests in flight end with
UNAVAILABLE and the server exits with status 1, so a supervisor restarts it
(``--no-exit-on-engine-failure`` keeps it up, NOT_SERVING, as before).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvserve.engine.config import EngineConfig
from kvserve.engine.frontend.async_engine import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_STEP_TIMEOUT_S,
    AsyncEngine,
    EngineState,
)
from kvserve.engine.frontend.engine_state import served_model_name
from kvserve.engine.frontend.kv_events import KvEventHub
from kvserve.engine.process.malloc import return_large_blocks
from kvserve.service.api.servicer import LLMServicer
from kvserve.service.api.validation import CacheSalting
from kvserve.service.guards.limits import ConnectionLimits, StreamLimitInterceptor, StreamLimits
from kvserve.service.guards.malformed import MalformedRequestInterceptor
from kvserve.service.guards.security import ApiKeyInterceptor, SecuritySettings, warn_if_exposed
from kvserve.service.health import Health
from kvserve.service.methods import HEALTH_SERVICE, LLM_SERVICE, VLLM_SERVICE
from kvserve.service.reflection import enable_reflection
from kvserve.service.telemetry.observability import Observability
from kvserve.service.vllm_api.servicer import VllmEngineServicer
from kvserve.v1 import llm_pb2_grpc
from kvserve.vllm import vllm_engine_pb2_grpc

log = logging.getLogger("kvserve.service")

MAX_RECEIVE_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_METADATA_BYTES = 16 * 1024

# Every key here is one gRPC core reads (checked against the compiled core library by
# tests/test_service_options.py). vLLM and SGLang shipped
# "grpc.http2.min_recv_ping_interval_without_data_ms", which core ignores, so clients that
# pinged during long unary calls were cut off with "Too many pings".
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 60_000),  # ping idle connections to find dead peers
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # clients may ping every 10 s
    ("grpc.http2.max_ping_strikes", 0),  # never close a connection for pinging too often
    ("grpc.so_reuseport", 0),  # a port in use is an error, not a silently shared socket
    # metadata over 16 KiB is refused (RESOURCE_EXHAUSTED), always: equal soft and hard limits
    # (a soft limit below the hard one refuses at random in between)
    ("grpc.max_metadata_size", MAX_METADATA_BYTES),
    ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
]


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    max_queue: int = DEFAULT_MAX_QUEUE
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S  # a silent engine core longer than this is dead
    stream_interval: int = 1  # a Stream message per this many tokens after the first (RequestStream)
    exit_on_engine_failure: bool = True  # exit 1 once the engine died (else stay up, NOT_SERVING)
    log_level: str = "info"
    security: SecuritySettings = field(default_factory=SecuritySettings)  # TLS, API key, reflection
    limits: StreamLimits = field(default_factory=StreamLimits)  # concurrent calls
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)  # open connections, handshakes
    metrics_port: int | None = None  # Prometheus /metrics on host:metrics_port (0 = any free port)
    otlp_endpoint: str | None = None  # OTLP/gRPC collector for traces (else OTEL_EXPORTER_OTLP_ENDPOINT)
    health_port: int | None = None  # plaintext grpc.health.v1 alone on host:health_port (0 = any free)
    max_connection_age: float | None = None  # seconds before a connection gets GOAWAY (None = never)
    kv_events: KvEventSettings = field(default_factory=lambda: KvEventSettings())
    cache_salting: CacheSalting = field(default_factory=CacheSalting)  # prefix-cache isolation by caller


@dataclass(frozen=True)
class KvEventSettings:
    """KV-cache events (engine/frontend/kv_events.py): on with any endpoint or with ``enabled``."""

    enabled: bool = False  # SubscribeKvEvents only, no ZeroMQ socket
    endpoint: str | None = None  # ZeroMQ PUB, e.g. tcp://*:5557
    replay_endpoint: str | None = None  # ZeroMQ ROUTER for replays, e.g. tcp://*:5558
    topic: str | None = None  # None: kv@<pod>@<model>, the pod from $POD_NAME else the host name

    @property
    def on(self) -> bool:
        return self.enabled or self.endpoint is not None or self.replay_endpoint is not None


def server_options(settings: ServeSettings) -> list[tuple[str, int]]:
    """SERVER_OPTIONS, the connection limits and the connection age: after that age a client gets
    GOAWAY and reconnects, so DNS round-robin clients spread over replicas that appeared since."""
    options = [*SERVER_OPTIONS, *settings.connections.server_options()]
    if settings.max_connection_age is None:
        return options
    age_ms = int(settings.max_connection_age * 1000)
    # calls in flight at GOAWAY get as long again to finish before the connection is closed
    return [*options, ("grpc.max_connection_age_ms", age_ms), ("grpc.max_connection_age_grace_ms", age_ms)]


def build_server(engine: AsyncEngine, health: Health, observability: Observability,
                 settings: ServeSettings | None = None) -> grpc.aio.Server:
    settings = settings or ServeSettings()
    # telemetry outermost, so that calls refused by auth or limits are counted and traced too
    server = grpc.aio.server(options=server_options(settings),
                             interceptors=[observability.interceptor, *interceptors(settings)])
    llm_pb2_grpc.add_LLMServiceServicer_to_server(LLMServicer(engine, settings.cache_salting), server)
    vllm_engine = VllmEngineServicer(engine, kvserve_version(), settings.cache_salting,
                                     kv_events_refusal=settings.security.kv_events_refusal)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm_engine, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    if settings.security.reflection:
        enable_reflection((LLM_SERVICE.full_name, VLLM_SERVICE.full_name, HEALTH_SERVICE.full_name), server)
    return server


def kv_event_hub(config: EngineConfig, kv: KvEventSettings, host: str = "127.0.0.1") -> KvEventHub | None:
    """The KV-event hub the settings ask for (None: events off); OSError if a socket cannot bind.
    ``tcp://*:PORT`` binds ``host`` (``--host``), as gRPC does: the events carry prompt token ids."""
    if not kv.on:
        return None
    topic = kv.topic
    if topic is None:
        pod = os.environ.get("POD_NAME") or socket.gethostname()
        topic = f"kv@{pod}@{served_model_name(config.model)}"
    return KvEventHub(config.block_size, on_host(kv.endpoint, host), on_host(kv.replay_endpoint, host), topic)


def on_host(endpoint: str | None, host: str) -> str | None:
    """A ZeroMQ ``tcp://*:PORT`` address bound to ``host`` instead of every interface (an address
    naming its interface, e.g. ``tcp://0.0.0.0:5557``, is kept as given)."""
    if endpoint is None or not endpoint.startswith("tcp://*:"):
        return endpoint
    return f"tcp://{f'[{host}]' if ':' in host else host}:{endpoint.removeprefix('tcp://*:')}"


def kvserve_version() -> str:
    try:
        return importlib.metadata.version("kvserve")
    except importlib.metadata.PackageNotFoundError:
        return ""


def build_health_server(health: Health, connections: ConnectionLimits | None = None) -> grpc.aio.Server:
    """grpc.health.v1 and nothing else (no reflection: a prober needs none)."""
    connections = connections or ConnectionLimits()
    server = grpc.aio.server(options=[*SERVER_OPTIONS, *connections.server_options()])
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    return server


def interceptors(settings: ServeSettings) -> list[grpc.aio.ServerInterceptor]:
    """Outermost first: the API key, then the call limits, then the request-bytes check."""
    chain: list[grpc.aio.ServerInterceptor] = []
    if settings.security.api_key is not None:
        chain.append(ApiKeyInterceptor(settings.security.api_key))
    return [*chain, StreamLimitInterceptor(settings.limits), MalformedRequestInterceptor()]


def bind(server: grpc.aio.Server, host: str, port: int,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on host:port (0 = any free port), over TLS when given ``credentials``; returns
    the port. Fails loudly if it cannot."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is not None:
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {address}: {e}") from e
    if bound == 0:
        raise OSError(f"cannot listen on {address} (port in use?)")
    return bound


async def serve(config: EngineConfig, settings: ServeSettings,
                credentials: grpc.ServerCredentials | None) -> int:
    """Run until SIGTERM/SIGINT, then drain; returns the exit status. ``credentials``: the port's
    TLS, ``server_credentials(settings.security)`` (None = plaintext), built by the caller so that
    bad certificate files are refused before the model loads."""
    return_large_blocks()  # a refused 16 MB message gives its pages back (engine/process/malloc.py)
    health = Health()
    await health.set_serving(False)
    engine = AsyncEngine(config, settings.max_queue, on_health=health.on_engine_health,
                         step_timeout=settings.step_timeout, log_level=settings.log_level,
                         stream_interval=settings.stream_interval)
    engine.kv_events = kv_event_hub(config, settings.kv_events, settings.host)
    observability = Observability.start(served_model_name(config.model), engine, settings.host,
                                        settings.metrics_port, settings.otlp_endpoint)
    try:
        return await _serve(config, settings, credentials, engine, health, observability)
    finally:
        observability.stop()
        if engine.kv_events is not None:
            engine.kv_events.close()


async def _serve(config: EngineConfig, settings: ServeSettings, credentials: grpc.ServerCredentials | None,
                 engine: AsyncEngine, health: Health, observability: Observability) -> int:
    server = build_server(engine, health, observability, settings)
    port = bind(server, settings.host, settings.port, credentials)
    warn_if_exposed(settings.security, settings.host)
    health_server = None
    if settings.health_port is not None:
        health_server = build_health_server(health, settings.connections)
        health_port = bind(health_server, settings.host, settings.health_port)
        await health_server.start()
        print(f"kvserve: health checks (grpc.health.v1 only, plaintext) on {settings.host}:{health_port}",
              file=sys.stderr, flush=True)
    await server.start()
    # printed whatever the log level: scripts and tests read the port from this line
    print(f"kvserve: listening on {settings.host}:{port} (loading model {config.model!r})", file=sys.stderr,
          flush=True)
    try:
        return await _run_until_stopped(server, engine, health, settings)
    finally:
        if health_server is not None:
            await health_server.stop(grace=None)


async def _run_until_stopped(server: grpc.aio.Server, engine: AsyncEngine, health: Health,
                             settings: ServeSettings) -> int:
    stop = _stop_on_signals()
    engine.start()
    if await _first(engine.wait_ready(), stop.wait()) and engine.state == EngineState.DEAD:
        log.error("the model failed to load: %s", engine.error)
        await server.stop(grace=None)
        await engine.shutdown()
        return 1
    if engine.state == EngineState.READY:
        info = engine.info
        log.info("ready: model %s, max_model_len %d, max_queue %d", info.model_name, info.max_model_len,
                 settings.max_queue)
    died = settings.exit_on_engine_failure and not await _first(stop.wait(), engine.wait_dead())
    if died:
        return await _exit_after_failure(server, engine, health)
    await stop.wait()
    await _drain(server, engine, health, settings.drain_timeout)
    return 0


async def _exit_after_failure(server: grpc.aio.Server, engine: AsyncEngine, health: Health) -> int:
    """The engine died: its requests already ended with UNAVAILABLE; let those answers go out,
    then stop with status 1 so that a supervisor restarts the server."""
    log.error("exiting with status 1: the engine failed (--no-exit-on-engine-failure keeps the server up)")
    await health.shutdown()
    await server.stop(grace=2.0)
    await engine.shutdown()
    return 1


async def _drain(server: grpc.aio.Server, engine: AsyncEngine, health: Health, timeout: float) -> None:
    log.info("draining: %d requests in flight, up to %g s", engine.num_in_flight, timeout)
    await health.shutdown()
    aborted = await engine.drain(timeout)
    if aborted:
        log.warning("drain timeout: aborted %d requests", aborted)
    await server.stop(grace=5.0)  # the aborted calls end with UNAVAILABLE well within this
    await engine.shutdown()
    log.info("stopped")


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    return stop


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    if stop.is_set():  # the second Ctrl-C: the operator wants it gone now, not after the drain
        log.warning("received %s again: exiting at once, without draining", sig.name)
        logging.shutdown()
        os._exit(128 + sig)
    log.info("received %s: draining (send it again to exit at once)", sig.name)
    stop.set()


async def _first(*aws) -> bool:
    """Wait until the first of ``aws`` completes and cancel the rest; True if it was the first."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return tasks[0] in done
