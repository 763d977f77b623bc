"""Limits on concurrent calls, so that no client can make the server do unbounded work.

Every call but the health check (which must answer under any load) holds a slot while it
runs: at most ``max_streams`` over the whole server, ``max_streams_per_connection`` per
client connection (gRPC's peer address: one per connection), and at most
``max_watch_streams`` of them WatchStats. A call beyond a limit ends at once with
RESOURCE_EXHAUSTED and a message naming the flag. WatchStats also has a minimum interval
(``MIN_WATCH_INTERVAL_MS``): every snapshot is a call into the engine, so hundreds of fast
watchers slow every running stream (docs/deployment/limits.md has the measurement).

The services open without the API key (health, reflection: service/guards/security.py) have
slots of their own: at most ``max_open_streams`` calls in flight over the whole server and
``max_open_streams_per_connection`` on one connection, not counted against the limits above.
Before, 4 connections x 256 health Watch streams, sent by anyone without a key, took all
1,024 of ``--max-streams`` and locked every keyed caller out; now they can hold 64 slots of
their own at most, and the keyed calls' slots are for keyed calls alone.

Generation requests are bounded further by ``--max-queue`` (admission) and
``--max-num-seqs``; these limits catch what admission does not see: watchers, health
watches, reflection, and one connection taking every slot.
"""

from __future__ import annotations

import argparse
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from kvserve.service.guards.interceptors import GuardedHandlers, guarded, refuse
from kvserve.service.guards.security import OPEN_SERVICES
from kvserve.service.methods import HEALTH_SERVICE, LLM_SERVICE, method_path, split_method

MIN_WATCH_INTERVAL_MS = 100
UNLIMITED_METHODS = frozenset({method_path(HEALTH_SERVICE, "Check")})
WATCH_METHOD = method_path(LLM_SERVICE, "WatchStats")


@dataclass(frozen=True)
class StreamLimits:
    max_streams: int = 1024
    max_streams_per_connection: int = 256
    max_watch_streams: int = 32
    max_open_streams: int = 64
    max_open_streams_per_connection: int = 8

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_streams_per_connection", "max_watch_streams", "max_open_streams",
                     "max_open_streams_per_connection"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ConnectionLimits:
    """What a connection may hold before it carries a call: gRPC core enforces both."""

    max_connections: int = 1024  # open at once; one more is closed as soon as it is accepted
    handshake_timeout: float = 10.0  # s from accept until the HTTP/2 preface and SETTINGS (and TLS) are done

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections: must be >= 1, got {self.max_connections}")
        if not self.handshake_timeout > 0:
            raise ValueError(f"--handshake-timeout: must be > 0 s, got {self.handshake_timeout}")

    def server_options(self) -> list[tuple[str, int]]:
        """The grpc.aio server options that enforce them."""
        return [("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.server_handshake_timeout_ms", max(1, round(self.handshake_timeout * 1000)))]


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("limits")
    c = ConnectionLimits()
    g.add_argument("--max-connections", type=int, default=c.max_connections,
                   help="client connections open at once (one more is closed at once)")
    g.add_argument("--handshake-timeout", type=float, default=c.handshake_timeout, metavar="S",
                   help="seconds a new connection has to finish its TLS and HTTP/2 handshake (else closed)")
    d = StreamLimits()
    g.add_argument("--max-streams", type=int, default=d.max_streams,
                   help="calls in flight at once over all connections (health and reflection have their own: "
                        "--max-open-streams)")
    g.add_argument("--max-streams-per-connection", type=int, default=d.max_streams_per_connection,
                   help="calls in flight at once on one client connection")
    g.add_argument("--max-watch-streams", type=int, default=d.max_watch_streams,
                   help=f"WatchStats calls at once (each polls the engine at >= {MIN_WATCH_INTERVAL_MS} ms)")
    g.add_argument("--max-open-streams", type=int, default=d.max_open_streams,
                   help="calls in flight at once to the services open without the API key (health Watch, "
                        "reflection; health Check is never limited), apart from --max-streams")
    g.add_argument("--max-open-streams-per-connection", type=int, default=d.max_open_streams_per_connection,
                   help="the same on one client connection")


def stream_limits(args: argparse.Namespace) -> StreamLimits:
    return StreamLimits(args.max_streams, args.max_streams_per_connection, args.max_watch_streams,
                        args.max_open_streams, args.max_open_streams_per_connection)


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(args.max_connections, args.handshake_timeout)


class _Slots:
    """Calls in flight, in total and by connection (gRPC's peer address: one per connection)."""

    def __init__(self, total: int, per_connection: int, flag: str):
        self.total, self.per_connection_limit, self.flag = total, per_connection, flag
        self.in_flight = 0
        self.per_connection: Counter[str] = Counter()

    def refusal(self, peer: str) -> str | None:
        if self.in_flight >= self.total:
            return f"too many calls in flight: {self.in_flight} (--{self.flag} {self.total}); retry"
        if self.per_connection[peer] >= self.per_connection_limit:
            return (f"too many calls in flight on this connection: {self.per_connection[peer]} "
                    f"(--{self.flag}-per-connection {self.per_connection_limit})")
        return None

    def take(self, peer: str, n: int) -> None:
        self.in_flight += n
        self.per_connection[peer] += n
        if self.per_connection[peer] == 0:
            del self.per_connection[peer]


class StreamLimitInterceptor(grpc.aio.ServerInterceptor):
    """Counts calls in flight (on the event loop thread only: no lock needed)."""

    def __init__(self, limits: StreamLimits):
        self.limits = limits
        self.calls = _Slots(limits.max_streams, limits.max_streams_per_connection, "max-streams")
        self.open_calls = _Slots(limits.max_open_streams, limits.max_open_streams_per_connection,
                                 "max-open-streams")
        self.watchers = 0
        self._handlers = GuardedHandlers()

    @property
    def in_flight(self) -> int:
        return self.calls.in_flight + self.open_calls.in_flight

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if method in UNLIMITED_METHODS:
            return handler
        watch = method == WATCH_METHOD
        is_open = split_method(method)[0] in OPEN_SERVICES
        slots = self.open_calls if is_open else self.calls
        return self._handlers.get(handler, (watch, is_open), lambda h: guarded(h, self._slot(watch, slots)))

    def _slot(self, watch: bool, slots: _Slots):
        @asynccontextmanager
        async def slot(request, context):
            peer = context.peer()
            refusal = slots.refusal(peer)
            if refusal is None and watch and self.watchers >= self.limits.max_watch_streams:
                refusal = (f"too many WatchStats calls: {self.watchers} "
                           f"(--max-watch-streams {self.limits.max_watch_streams})")
            if refusal is not None:
                yield refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
                return
            slots.take(peer, +1)
            self.watchers += watch
            try:
                yield request
            finally:
                slots.take(peer, -1)
                self.watchers -= watch

        return slot
