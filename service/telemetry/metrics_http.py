"""The /metrics HTTP endpoint (``--metrics-port``), bounded against idle, slow and many clients.

prometheus-client's own server gives every connection a thread and never times a read out:
1,500 idle half-sent connections held 1,500 front-end threads for good, and of 200
concurrent scrapes 31 were still unanswered after 30 s. Here:

- one thread runs an asyncio loop that holds every connection (an idle one costs a socket and a
  small task, not a thread);
- a request must arrive whole, headers included (at most ``MAX_REQUEST_BYTES``), within
  ``READ_TIMEOUT_S`` of the connection's opening, else the connection is closed; a connection
  serves one request (``Connection: close``);
- at most ``MAX_CONNECTIONS`` are open at once: one more closes the oldest connection still
  waiting for its request (a scraper sends its request at once, so it is the idle and the
  half-sent ones that go), or, when every open one is being answered, is closed itself;
- the exposition is rendered on one worker thread, and every scrape that arrives while a
  rendering runs shares it: a storm of scrapes costs the engine one snapshot at a time
  (each rendering asks the engine core for one Stats snapshot), never one per scrape.

So the endpoint holds two threads whatever its clients do.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

READ_TIMEOUT_S = 10.0  # the whole request must arrive within this (Prometheus sends it at once)
WRITE_TIMEOUT_S = 30.0  # a client that does not take the answer within this is dropped
MAX_CONNECTIONS = 64
MAX_REQUEST_BYTES = 16 * 1024


class MetricsHttpServer:
    """Serves ``registry`` on host:port (0 = any free port) until ``stop()``."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self._registry = registry
        self._render_pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-metrics-render")
        self._rendering: dict[str, asyncio.Future] = {}  # content type -> the rendering in flight
        self._open = 0
        self._reading: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()  # oldest first
        self._loop = asyncio.new_event_loop()
        started: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(host, port, started),
                                        name="kvserve-metrics-http", daemon=True)
        self._thread.start()
        self.port: int = started.result()  # raises the OSError of a port that cannot be bound

    def stop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._render_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def open_connections(self) -> int:
        return self._open

    # ---- on the endpoint's own thread ----------------------------------------------------------
    def _run(self, host: str, port: int, started: Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            server = self._loop.run_until_complete(asyncio.start_server(
                self._serve, host, port, backlog=128, limit=MAX_REQUEST_BYTES))
        except OSError as e:
            started.set_exception(e)
            self._loop.close()
            return
        started.set_result(server.sockets[0].getsockname()[1])
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            if not self._reading:
                writer.transport.abort()
                return
            oldest, _ = self._reading.popitem(last=False)
            oldest.transport.abort()  # its read ends with ConnectionError: it leaves by itself
        self._open += 1
        self._reading[writer] = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            finally:
                self._reading.pop(writer, None)
            response = await self._answer(head)
            writer.write(response)
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, asyncio.CancelledError):
            pass  # a slow, silent, oversized or vanished client, or the endpoint stopping: just close
        finally:
            self._open -= 1
            writer.transport.abort()  # no lingering: the answer went out with drain()

    async def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[0] not in ("GET", "HEAD"):
            return _response(405, "text/plain; charset=utf-8", b"only GET and HEAD\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        accept = headers.get("accept", "")
        content_type, body = await self._render(accept)
        extra = {}
        if "gzip" in headers.get("accept-encoding", ""):
            body, extra = gzip.compress(body), {"Content-Encoding": "gzip"}
        return _response(200, content_type, b"" if parts[0] == "HEAD" else body, len(body), extra)

    async def _render(self, accept: str) -> tuple[str, bytes]:
        encoder, content_type = choose_encoder(accept)  # the text format or OpenMetrics
        shared = self._rendering.get(content_type)
        if shared is None:
            shared = asyncio.wrap_future(self._render_pool.submit(encoder, self._registry))
            self._rendering[content_type] = shared
            shared.add_done_callback(lambda _: self._rendering.pop(content_type, None))
        return content_type, await asyncio.shield(shared)


def _response(status: int, content_type: str, body: bytes, length: int | None = None,
              extra: dict[str, str] | None = None) -> bytes:
    reason = {200: "OK", 405: "Method Not Allowed"}[status]
    headers = {"Content-Type": content_type, "Content-Length": str(len(body) if length is None else length),
               "Connection": "close", **(extra or {})}
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body

