"""Admission and shutdown on a server of its own: a tiny --max-queue and --max-num-seqs turn a
burst's excess into RESOURCE_EXHAUSTED while the admitted requests complete; SIGTERM drains
(new calls UNAVAILABLE, health NOT_SERVING, short streams finish, the rest are aborted with a
clear status after --drain-timeout) and the process exits 0. The SIGTERM test stops the
module's server, so it comes after the other test of it. On a tiny model's server of their
own: 200 calls at once against --max-queue 8 --max-num-seqs 8 and SIGTERM under that load; a
second SIGTERM exits at once and leaves no process."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.benchmarks.instruments.procfs import alive
from kvserve.clients.messages import SERVICE_NAME, build_request
from kvserve.testing.plugin import TEST_SERVER_ENV
from kvserve.testing.process import ServerProcess
from kvserve.v1 import llm_pb2, llm_pb2_grpc

MAX_QUEUE = 2
MAX_NUM_SEQS = 2
DRAIN_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def server():
    flags = ("--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue", str(MAX_QUEUE),
             "--drain-timeout", str(DRAIN_TIMEOUT_S), "--kv-cache-memory", "0.25")
    with ServerProcess(*flags, env=TEST_SERVER_ENV) as srv:
        yield srv


async def _read_all(call) -> list[llm_pb2.StreamResponse]:
    """The rest of a stream, read with ``read()`` (grpc.aio forbids mixing it with iteration)."""
    msgs = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        msgs.append(msg)
    return msgs


def test_burst_beyond_max_queue_is_refused_and_admitted_requests_complete(server):
    async def run():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = llm_pb2_grpc.LLMServiceStub(ch)
            runners = [stub.Stream(build_request(f"Runner {i}:", max_tokens=24, ignore_eos=True))
                       for i in range(MAX_NUM_SEQS)]
            firsts = [await r.read() for r in runners]  # both running: every seat is taken
            burst = [stub.Generate(build_request(f"Burst {i}:", max_tokens=4, ignore_eos=True))
                     for i in range(8)]
            results = await asyncio.gather(*burst, return_exceptions=True)
            rest = [await _read_all(r) for r in runners]
            stats = await stub.Stats(llm_pb2.StatsRequest())
            return firsts, rest, results, stats

    firsts, rest, results, stats = asyncio.run(run())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in results if isinstance(r, llm_pb2.GenerateResponse)]
    assert len(refused) + len(served) == len(results)
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "--max-queue" in err.details()
    assert refused, "the burst was larger than the queue, yet nothing was refused"
    assert len(served) >= MAX_QUEUE  # the queue's seats are always granted
    for resp in served:
        assert resp.finish_reason == llm_pb2.LENGTH and len(resp.token_ids) == 4
    for first, msgs in zip(firsts, rest, strict=True):
        assert len(first.token_ids) + sum(len(m.token_ids) for m in msgs) == 24
        assert msgs[-1].finish_reason == llm_pb2.LENGTH
    assert stats.requests_rejected == len(refused)
    assert stats.max_queue == MAX_QUEUE


def test_sigterm_drains_active_streams_and_exits_zero(server):
    async def run():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = llm_pb2_grpc.LLMServiceStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            short = stub.Stream(build_request("A short one:", max_tokens=4, ignore_eos=True))
            long = stub.Stream(build_request("A long one:", max_tokens=4000, ignore_eos=True))
            await short.read()
            await long.read()
            server.signal()
            while (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))).status \
                    != health_pb2.HealthCheckResponse.NOT_SERVING:
                await asyncio.sleep(0.05)
            try:
                await stub.Generate(build_request("Too late:", max_tokens=2))
                late = None
            except grpc.aio.AioRpcError as e:
                late = e
            short_msgs = await _read_all(short)
            long_error = None
            try:
                await _read_all(long)
            except grpc.aio.AioRpcError as e:
                long_error = e
            return late, short_msgs, long_error

    late, short_msgs, long_error = asyncio.run(run())
    assert late is not None and late.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in late.details()
    assert short_msgs[-1].finish_reason == llm_pb2.LENGTH  # finished within the drain
    assert long_error is not None and long_error.code() == grpc.StatusCode.UNAVAILABLE
    assert "drain timeout" in long_error.details()
    assert server.wait(timeout=120) == 0
    log = server.log_text()
    assert "draining" in log and "stopped" in log



# ---- 200 at once against --max-queue 8 --max-num-seqs 8, then SIGTERM (a tiny model's server) ----
def _loaded_server(model, *flags: str) -> ServerProcess:
    return ServerProcess("--model", str(model), "--dtype", "float32", "--num-kv-blocks", "256",
                         "--max-queue", "8", "--max-num-seqs", "8", *flags, env=TEST_SERVER_ENV).start()


def _core_pid(server: ServerProcess) -> int:
    return int(re.search(r"engine core: pid (\d+)", server.log_text()).group(1))


async def _load(target: str, n: int, max_tokens: int, then=None) -> list:
    """``n`` Stream calls at once, read to the end (``then()`` once every admitted one has
    sent a message); returns, per call, its messages or its error."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        requests = [build_request(token_ids=[1, 2, 3 + i % 100], max_tokens=max_tokens, ignore_eos=True)
                    for i in range(n)]
        calls = [stub.Stream(r, timeout=120) for r in requests]
        t0 = time.monotonic()

        async def first(call):
            try:
                return await call.read()
            except grpc.aio.AioRpcError as e:
                e.after_s = time.monotonic() - t0  # when the refusal came (printed, not asserted)
                raise

        firsts = await asyncio.gather(*(first(c) for c in calls), return_exceptions=True)
        if then is not None:
            then()
        ends = []
        for call, first in zip(calls, firsts, strict=True):
            if isinstance(first, BaseException):
                ends.append(first)
                continue
            try:
                ends.append([first, *await _read_all(call)])
            except grpc.aio.AioRpcError as e:
                ends.append(e)
        return ends


def test_200_at_once_are_refused_beyond_the_queue_and_sigterm_under_load_drains(tiny_qwen2_dir):
    server = _loaded_server(tiny_qwen2_dir, "--drain-timeout", "5")
    try:
        core = _core_pid(server)
        results = asyncio.run(_load(server.target, 200, 16))
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        # 8 running + 8 queued when the burst lands; more get in as the first finish while the
        # burst is still arriving (16 tokens on the tiny model): how many depends on the machine's
        # speed (136 and 96 of 200 refused on two quiet runs), so the test holds what does not: the
        # excess is refused (with the status below), and every call admitted finishes whole
        assert refused and len(refused) + sum(not isinstance(r, BaseException) for r in results) == 200
        print(f"{len(refused)} of 200 refused, the last {max(e.after_s for e in refused) * 1000:.0f} ms "
              f"after the burst was sent")
        for e in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queue 8" in e.details(), e
        for msgs in results:
            if not isinstance(msgs, BaseException):
                assert sum(len(m.token_ids) for m in msgs) == 16 and msgs[-1].finish_reason == llm_pb2.LENGTH
        # SIGTERM while 16 long streams are admitted (8 running, 8 waiting) and 34 more are refused
        ends = asyncio.run(_load(server.target, 50, 240, then=server.signal))
        assert server.wait(timeout=60) == 0
        for end in ends:
            if isinstance(end, grpc.aio.AioRpcError):
                ok = end.code() == grpc.StatusCode.RESOURCE_EXHAUSTED or (
                    end.code() == grpc.StatusCode.UNAVAILABLE and "drain timeout" in end.details())
                assert ok, end
            else:
                assert end[-1].finish_reason == llm_pb2.LENGTH
        assert "draining" in server.log_text() and "stopped" in server.log_text()
        assert not alive(core)
    finally:
        server.stop()


@pytest.mark.slow
def test_a_second_sigterm_under_load_exits_at_once_and_leaves_no_process(tiny_qwen2_dir):
    server = _loaded_server(tiny_qwen2_dir, "--drain-timeout", "300")
    try:
        core = _core_pid(server)

        def twice():
            server.signal()
            time.sleep(0.3)
            server.signal()

        asyncio.run(_load(server.target, 16, 240, then=twice))
        assert server.wait(timeout=10) == 128 + signal.SIGTERM
        assert "exiting at once" in server.log_text()
        end = time.monotonic() + 10
        while alive(core) and time.monotonic() < end:  # the core sees its lifeline close
            time.sleep(0.1)
        assert not alive(core)
    finally:
        server.stop()
