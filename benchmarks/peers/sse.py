"""A small asyncio HTTP/1.1 client for streamed JSON responses, and the Server-Sent Events reader
its callers parse them with: the peers' load generator (vLLM's ``/v1/completions`` and
llama-server's ``/completion``) with nothing but ``asyncio.open_connection``.

One connection per request (``Connection: close``): llama-server drops idle keep-alive
connections under load, and a fresh loopback connection costs far less than a request. The body
comes chunked (``Transfer-Encoding: chunked``), with a ``Content-Length`` or up to the close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

MAX_ERROR_BODY = 2000  # characters of an error response kept in the message


class HTTPError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status
        self.body = body


class SSEDecoder:
    """Bytes in, events out: ``feed`` returns the events its bytes completed, each a dict of field
    -> value (``data`` lines joined with newlines; comments dropped; ``\\n``, ``\\r\\n`` or ``\\r``
    line ends). A field without a colon has the empty value. Events may split anywhere across
    feeds; an event without a blank line after it is still pending (``flush`` ends it)."""

    def __init__(self):
        self._buf = b""
        self._event: dict[str, str] = {}

    def feed(self, data: bytes) -> list[dict[str, str]]:
        self._buf += data
        events = []
        while True:
            cut, width = _line_end(self._buf)
            if cut < 0:
                return events
            line, self._buf = self._buf[:cut].decode("utf-8", "replace"), self._buf[cut + width:]
            if not line:  # a blank line ends the event
                if self._event:
                    events.append(self._event)
                    self._event = {}
            elif not line.startswith(":"):
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                old = self._event.get(field)
                self._event[field] = value if old is None or field != "data" else f"{old}\n{value}"

    def flush(self) -> list[dict[str, str]]:
        """The last event when the stream ended without a blank line after it."""
        events = self.feed(b"\n\n") if self._buf or self._event else []
        self._buf = b""
        return events


def _line_end(buf: bytes) -> tuple[int, int]:
    """Where the first line of ``buf`` ends and how wide its end is; (-1, 0) if not yet known
    (a trailing ``\\r`` may be the first half of ``\\r\\n``)."""
    n, r = buf.find(b"\n"), buf.find(b"\r")
    if r < 0 or (0 <= n < r):
        return n, 1 if n >= 0 else 0
    if r + 1 == len(buf):
        return -1, 0
    return r, 2 if buf[r + 1:r + 2] == b"\n" else 1


async def post_stream(host: str, port: int, path: str, body: dict) -> AsyncIterator[bytes]:
    """POST ``body`` as JSON; the response body's bytes as they arrive. A status other than 200
    raises ``HTTPError`` with the body (what the server said)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        status, headers = await read_head(reader)
        if status != 200:
            text = b"".join([c async for c in body_chunks(reader, headers)]).decode("utf-8", "replace")
            raise HTTPError(status, text[:MAX_ERROR_BODY])
        async for chunk in body_chunks(reader, headers):
            yield chunk
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def sse_events(host: str, port: int, path: str, body: dict) -> AsyncIterator[dict[str, str]]:
    """POST ``body`` and yield the response's Server-Sent Events as they complete."""
    decoder = SSEDecoder()
    async with contextlib.aclosing(post_stream(host, port, path, body)) as chunks:  # closes the socket
        async for chunk in chunks:
            for event in decoder.feed(chunk):
                yield event
    for event in decoder.flush():
        yield event


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the headers (names lowercased) of a response."""
    status_line = (await reader.readline()).decode("latin-1")
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP response: {status_line[:100]!r}")
    headers = {}
    while (line := (await reader.readline()).decode("latin-1").strip()):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive: de-chunked, ``Content-Length`` bytes, or up to the close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionError("connection closed inside a chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()).strip():  # trailers, up to the blank line
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            chunk = await reader.read(min(left, 65536))
            if not chunk:
                raise ConnectionError(f"connection closed with {left} bytes of the body unread")
            left -= len(chunk)
            yield chunk
    else:
        while chunk := await reader.read(65536):
            yield chunk
