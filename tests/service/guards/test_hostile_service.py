"""Hostile and unlucky clients against a real server (a tiny random Qwen2 with the bundled model's
tokenizer and chat template, an API key, the metrics endpoint): unauthenticated health Watch
streams, refused requests of 15.9 M token ids, 500,000 chat messages, streams whose client never
reads, connections that never finish a handshake or a header block, oversized metadata, streaming
clients killed by SIGKILL, and a flood of idle connections to /metrics. Each time: a clear status
naming the limit, a keyed client unaffected, memory and KV blocks back. The long versions are
marked slow."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.clients.messages import build_request
from kvserve.contract import API_KEY_ENV, auth_metadata
from kvserve.testing.plugin import TEST_SERVER_ENV, wait_until_idle
from kvserve.testing.process import ServerProcess
from kvserve.v1 import llm_pb2, llm_pb2_grpc

API_KEY = "round-three-test-key"
KEY = auth_metadata(API_KEY)
MAX_OPEN, MAX_OPEN_PER_CONNECTION = 8, 4
MAX_CONNECTIONS = 200
HANDSHAKE_TIMEOUT_S = 2
GENERATE = "/kvserve.v1.LLMService/Generate"
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def server(tiny_qwen2_dir):
    flags = ("--model", str(tiny_qwen2_dir), "--dtype", "float32", "--num-kv-blocks", "1024",
             "--metrics-port", "0", "--max-open-streams", str(MAX_OPEN),
             "--max-open-streams-per-connection", str(MAX_OPEN_PER_CONNECTION),
             "--max-connections", str(MAX_CONNECTIONS), "--handshake-timeout", str(HANDSHAKE_TIMEOUT_S))
    env = {**TEST_SERVER_ENV, API_KEY_ENV: API_KEY}
    with ServerProcess(*flags, env=env, client_options={"api_key": API_KEY}) as srv:
        yield srv
        assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server):
    from kvserve.clients import Client

    with Client(server.target, api_key=API_KEY) as c:
        yield c


def _status(pid: int, field: str) -> int:
    """A number from /proc/<pid>/status (VmRSS in KiB, Threads)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _channel(target: str, *options) -> grpc.aio.Channel:
    """A channel on a connection of its own (gRPC shares one per target unless told not to)."""
    return grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1), *options])


async def _small_generate(target: str) -> llm_pb2.GenerateResponse:
    async with _channel(target) as ch:
        request = build_request(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
        return await llm_pb2_grpc.LLMServiceStub(ch).Generate(request, metadata=KEY, timeout=30)


def _small_generate_works(server) -> None:
    reply = asyncio.run(_small_generate(server.target))
    assert len(reply.token_ids) == 4


# ---- (1) unauthenticated health Watch streams ------------------------------------------------------
async def _watches(target: str, connections: int, per_connection: int):
    """Open health Watch streams without a key; returns (admitted calls, refusals, channels)."""
    channels = [_channel(target) for _ in range(connections)]
    admitted, refused = [], []
    for ch in channels:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(per_connection):
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                await call.read()  # the current status comes at once: the call holds a slot
                admitted.append(call)
            except grpc.aio.AioRpcError as e:
                refused.append(e)
    return admitted, refused, channels


def test_unauthenticated_health_watches_cannot_lock_keyed_callers_out(server):
    async def run():
        admitted, refused, channels = await _watches(server.target, 3, MAX_OPEN_PER_CONNECTION + 1)
        try:
            keyed = await _small_generate(server.target)
            async with _channel(server.target) as ch:  # keyed Stats and an unkeyed probe still answer
                stats = await llm_pb2_grpc.LLMServiceStub(ch).Stats(llm_pb2.StatsRequest(), metadata=KEY,
                                                                     timeout=10)
                check = health_pb2_grpc.HealthStub(ch).Check
                probe = await check(health_pb2.HealthCheckRequest(), timeout=10)
            for call in admitted:
                call.cancel()
            for _ in range(100):  # the slots come back once the server sees the cancels
                again, _, more = await _watches(server.target, 1, 1)
                for c in again:
                    c.cancel()
                for c in more:
                    await c.close()
                if again:
                    break
                await asyncio.sleep(0.1)
            return len(admitted), refused, keyed, stats, probe, bool(again)
        finally:
            for ch in channels:
                await ch.close()

    admitted, refused, keyed, stats, probe, again = asyncio.run(run())
    assert admitted == MAX_OPEN
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused), refused
    details = [e.details() for e in refused]
    # the first connection's fifth; then the second's fifth and all of the third's: the total
    assert sum("--max-open-streams-per-connection 4" in d for d in details) == 1, details
    assert sum("--max-open-streams 8" in d for d in details) == 6, details
    assert len(keyed.token_ids) == 4 and stats.model
    assert probe.status == health_pb2.HealthCheckResponse.SERVING
    assert again


# ---- (2) memory kept by refused requests -----------------------------------------------------------
def test_refused_huge_token_id_prompts_leave_no_memory_behind(server):
    request = llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds(ids=[1] * 15_900_000))
    raw = request.SerializeToString()  # ~15.9 MB: one byte per id, under the 16 MiB receive limit
    del request
    assert 15 * MiB < len(raw) < 16 * MiB
    pid = server.proc.pid  # the front-end

    with grpc.insecure_channel(server.target) as ch:
        generate = ch.unary_unary(GENERATE, request_serializer=None,
                                  response_deserializer=llm_pb2.GenerateResponse.FromString)

        def refused() -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as err:
                generate(raw, metadata=KEY, timeout=60)
            return err.value

        first = refused()  # warms up whatever a large message allocates once
        baseline = _status(pid, "VmRSS")
        errors = [refused() for _ in range(10)]
    for e in [first, *errors]:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "token_ids.ids: 15900000 ids" in e.details() and "max_model_len (256" in e.details()
    after = _status(pid, "VmRSS")
    # 10 requests kept: >= 159 MiB (15.9 MB bytes each); allocators kept up to 113 of transient blocks
    assert after - baseline < 128 * 1024, f"front-end RSS grew {(after - baseline) / 1024:.0f} MiB"
    _small_generate_works(server)


# ---- (3) very many chat messages --------------------------------------------------------------------
def _chat(n: int) -> llm_pb2.GenerateRequest:
    turn = llm_pb2.ChatMessage(role="user")
    request = build_request(token_ids=[1], max_tokens=2)
    request.messages.messages.extend([turn] * n)
    return request


def test_very_many_chat_messages_are_refused_before_rendering(server):
    async def run():
        async with _channel(server.target) as ch:
            stub = llm_pb2_grpc.LLMServiceStub(ch)
            big = [stub.Generate(_chat(500_000), metadata=KEY, timeout=60) for _ in range(2)]
            mid = stub.Generate(_chat(100), metadata=KEY, timeout=60)
            small = _small_generate(server.target)
            return await asyncio.gather(*big, mid, small, return_exceptions=True)

    *big, mid, small = asyncio.run(run())
    for e in big:
        assert isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "messages.messages: 500000 messages cannot fit max_model_len (256" in e.details()
    # within the field's bound, beyond what the template's 5 tokens per message leave room for
    assert isinstance(mid, grpc.aio.AioRpcError) and mid.code() == grpc.StatusCode.INVALID_ARGUMENT, mid
    assert "messages: 100 messages cannot fit max_model_len (256" in mid.details(), mid.details()
    assert "at least 5 per message = at most 51 messages" in mid.details(), mid.details()
    assert len(small.token_ids) == 4


# ---- (4) slow consumers ------------------------------------------------------------------------------
async def _unread_streams(server, client, n: int, hold_s: float) -> tuple[int, int, list[float]]:
    """``n`` Stream calls (logprobs 20, ``ignore_eos``) never read, on a connection whose window
    stays 64 KiB, held ``hold_s`` seconds while another client sends a short Generate every few
    seconds; returns (front-end RSS growth in KiB, KV blocks free at the end, the Generates' times)."""
    pid = server.proc.pid
    baseline = _status(pid, "VmRSS")
    times = []
    async with _channel(server.target, ("grpc.http2.bdp_probe", 0)) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        calls = [stub.Stream(build_request(token_ids=[1, 2, 3 + i], max_tokens=240, ignore_eos=True,
                                           logprobs=20), metadata=KEY) for i in range(n)]
        end = time.monotonic() + hold_s
        while True:
            t0 = time.monotonic()
            await _small_generate(server.target)
            times.append(time.monotonic() - t0)
            if time.monotonic() > end:
                break
            await asyncio.sleep(min(5.0, max(0.0, end - time.monotonic())))
        grown = _status(pid, "VmRSS") - baseline
        for c in calls:
            c.cancel()
    return grown, wait_until_idle(client)["kv_blocks_free"], times


def _check_slow_consumers(server, client, n: int, hold_s: float) -> None:
    total = client.stats()["kv_blocks_total"]
    grown, free, times = asyncio.run(_unread_streams(server, client, n, hold_s))
    print(f"{n} unread streams for {hold_s:g} s: front-end RSS +{grown / 1024:.1f} MiB; another client's "
          f"4-token Generate took {min(times) * 1000:.0f}-{max(times) * 1000:.0f} ms ({len(times)} calls)")
    # every choice's backlog is its own tokens: 240 x (1 + 20 alternatives) per stream at most
    assert grown < 64 * 1024, f"front-end RSS grew {grown / 1024:.0f} MiB"
    assert free == total
    assert times


def test_streams_nobody_reads_keep_memory_bounded_and_blocks_come_back(server, client):
    _check_slow_consumers(server, client, 8, 2.0)


@pytest.mark.slow
def test_streams_nobody_reads_for_a_minute(server, client):
    _check_slow_consumers(server, client, 32, 60.0)


# ---- (5) abrupt and half-open clients ----------------------------------------------------------------
def _raw_connections(port: int, n: int, first_bytes: bytes = b"") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if first_bytes:
            s.sendall(first_bytes)
        socks.append(s)
    return socks


def _closed_by_peer(s: socket.socket) -> bool:
    """True once the server closed ``s`` (EOF or reset); what it sent before is skipped."""
    s.setblocking(False)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _wait_all_closed(socks: list[socket.socket], timeout: float) -> int:
    end = time.monotonic() + timeout
    open_ = list(socks)
    while open_ and time.monotonic() < end:
        open_ = [s for s in open_ if not _closed_by_peer(s)]
        time.sleep(0.1)
    return len(open_)


def test_connections_without_a_handshake_are_bounded_and_timed_out(server):
    socks = _raw_connections(server.port, MAX_CONNECTIONS + 50)  # silent: no HTTP/2 preface
    try:
        time.sleep(0.5)  # well before the handshake timeout
        closed_at_once = sum(_closed_by_peer(s) for s in socks)
        assert closed_at_once >= 40, closed_at_once  # beyond --max-connections
        assert _wait_all_closed(socks, HANDSHAKE_TIMEOUT_S + 20) == 0
    finally:
        for s in socks:
            s.close()
    silent = _raw_connections(server.port, 100)  # under the limit: others are served meanwhile
    try:
        _small_generate_works(server)
    finally:
        for s in silent:
            s.close()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame
# HEADERS on stream 1 without END_HEADERS (flags 0): ":method POST", then a CONTINUATION never comes
HALF_HEADERS = b"\x00\x00\x01\x01\x00\x00\x00\x00\x01\x83"


def test_header_blocks_never_finished_do_not_disturb_others(server):
    socks = _raw_connections(server.port, 50, PREFACE + SETTINGS + HALF_HEADERS)
    try:
        _small_generate_works(server)
    finally:
        for s in socks:
            s.close()


@pytest.mark.slow
def test_header_blocks_never_finished_are_closed_by_keepalive(server):
    """A connection stuck in a header block is closed by the server within keepalive's 60 s + 20 s."""
    socks = _raw_connections(server.port, 50, PREFACE + SETTINGS + HALF_HEADERS)
    try:
        assert _wait_all_closed(socks, 120) == 0
    finally:
        for s in socks:
            s.close()


BIG_METADATA = [(("x-big", "a" * MiB),), tuple((f"x-m{i}", "v") for i in range(20_000))]


@pytest.mark.parametrize("metadata", BIG_METADATA, ids=["1MiB-value", "20000-entries"])
def test_oversized_metadata_is_refused_and_others_are_served(server, metadata):
    async def run():
        async with _channel(server.target) as ch:
            stats = llm_pb2_grpc.LLMServiceStub(ch).Stats
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stats(llm_pb2.StatsRequest(), metadata=(*KEY, *metadata), timeout=30)
            return err.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    _small_generate_works(server)


STREAMING_CLIENT = """
import sys, grpc
from kvserve.clients.messages import build_request
from kvserve.v1 import llm_pb2_grpc
target, key = sys.argv[1], sys.argv[2]
stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target))
calls = [stub.Stream(build_request(token_ids=[5, 6, 7 + i], max_tokens=240, ignore_eos=True, n=2, logprobs=5,
                                   temperature=1.0), metadata=(("authorization", "Bearer " + key),))
         for i in range(2)]
for c in calls:
    next(c)
print("streaming", flush=True)
sys.stdin.read()
"""


def test_streaming_clients_killed_by_sigkill_free_their_blocks(server, client):
    total = client.stats()["kv_blocks_total"]
    env = {**os.environ, **TEST_SERVER_ENV}
    procs = [subprocess.Popen([sys.executable, "-c", STREAMING_CLIENT, server.target, API_KEY],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) for _ in range(4)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == b"streaming"
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
        assert wait_until_idle(client, timeout=60)["kv_blocks_free"] == total
    finally:
        for p in procs:
            p.kill()
            p.wait()
    _small_generate_works(server)


# ---- (7) the metrics endpoint ------------------------------------------------------------------------
def _metrics_port(server) -> int:
    (line,) = [ln for ln in server.log_text().splitlines() if ln.startswith("kvserve: metrics on ")]
    return int(line.rsplit(":", 1)[1].split("/")[0])


def _scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        assert b"kvserve:num_requests_running" in r.read()
        return r.status


def test_idle_metrics_connections_hold_no_threads_and_scrapes_are_answered(server):
    pid, port = server.proc.pid, _metrics_port(server)
    threads = _status(pid, "Threads")
    idle = _raw_connections(port, 300, b"GET /metrics HTTP/1.1\r\n")  # half-sent, then silent
    try:
        time.sleep(0.5)
        assert _status(pid, "Threads") <= threads + 1
        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(lambda _: _scrape(port), range(100)))
        assert codes == [200] * 100
        assert _status(pid, "Threads") <= threads + 1
        _small_generate_works(server)
    finally:
        for s in idle:
            s.close()
