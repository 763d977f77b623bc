"""Limits on concurrent calls, so that no client can make the server do unbounded work.

Every call but the health check (which must answer under any load) holds a slot while it
runs: at most ``max_streams`` over the whole server, ``max_streams_per_connection`` per
client connection (gRPC's peer address: one per connection), and at most
``max_watch_streams`` of them WatchStats. A call beyond a limit ends at once with
RESOURCE_EXHAUSTED and a message naming the flag. WatchStats also has a minimum interval
(``MIN_WATCH_INTERVAL_MS``): 300 watchers at 10 ms cost a running stream 2.5x its latency,
because every snapshot is a call into the engine thread.

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

from kvserve.service.guards.interceptors import GuardedHandlers, guarded
from kvserve.service.methods import HEALTH_SERVICE, LLM_SERVICE, method_path

MIN_WATCH_INTERVAL_MS = 100
UNLIMITED_METHODS = frozenset({method_path(HEALTH_SERVICE, "Check")})
WATCH_METHOD = method_path(LLM_SERVICE, "WatchStats")


@dataclass(frozen=True)
class StreamLimits:
    max_streams: int = 1024
    max_streams_per_connection: int = 256
    max_watch_streams: int = 32

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_streams_per_connection", "max_watch_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("limits")
    d = StreamLimits()
    g.add_argument("--max-streams", type=int, default=d.max_streams,
                   help="calls in flight at once over all connections (health checks not counted)")
    g.add_argument("--max-streams-per-connection", type=int, default=d.max_streams_per_connection,
                   help="calls in flight at once on one client connection")
    g.add_argument("--max-watch-streams", type=int, default=d.max_watch_streams,
                   help=f"WatchStats calls at once (each polls the engine at >= {MIN_WATCH_INTERVAL_MS} ms)")


def stream_limits(args: argparse.Namespace) -> StreamLimits:
    return StreamLimits(args.max_streams, args.max_streams_per_connection, args.max_watch_streams)


class StreamLimitInterceptor(grpc.aio.ServerInterceptor):
    """Counts calls in flight (on the event loop thread only: no lock needed)."""

    def __init__(self, limits: StreamLimits):
        self.limits = limits
        self.in_flight = 0
        self.watchers = 0
        self.per_connection: Counter[str] = Counter()
        self._handlers = GuardedHandlers()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if method in UNLIMITED_METHODS:
            return handler
        watch = method == WATCH_METHOD
        return self._handlers.get(handler, watch, lambda h: guarded(h, self._slot(watch)))

    def _slot(self, watch: bool):
        @asynccontextmanager
        async def slot(request, context):
            peer = context.peer()
            refusal = self._refusal(peer, watch)
            if refusal is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            self._take(peer, watch, +1)
            try:
                yield request
            finally:
                self._take(peer, watch, -1)

        return slot

    def _refusal(self, peer: str, watch: bool) -> str | None:
        lim = self.limits
        if self.in_flight >= lim.max_streams:
            return f"too many calls in flight: {self.in_flight} (--max-streams {lim.max_streams}); retry"
        if self.per_connection[peer] >= lim.max_streams_per_connection:
            return (f"too many calls in flight on this connection: {self.per_connection[peer]} "
                    f"(--max-streams-per-connection {lim.max_streams_per_connection})")
        if watch and self.watchers >= lim.max_watch_streams:
            return f"too many WatchStats calls: {self.watchers} (--max-watch-streams {lim.max_watch_streams})"
        return None

    def _take(self, peer: str, watch: bool, n: int) -> None:
        self.in_flight += n
        self.watchers += n if watch else 0
        self.per_connection[peer] += n
        if self.per_connection[peer] == 0:
            del self.per_connection[peer]
