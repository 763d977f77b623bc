"""What a server does when its engine core dies or hangs, on a tiny random-weight model with
two tensor-parallel ranks: the core killed by SIGKILL mid-stream, a tensor-parallel worker
stopped by SIGSTOP (the step timeout). Every stream ends with UNAVAILABLE and a message,
nothing hangs, the server exits 1 (or, with --no-exit-on-engine-failure, stays up
NOT_SERVING), and no process of the engine is left behind."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import signal
import time

import grpc
import pytest

from kvserve.benchmarks.instruments.procfs import alive, children
from kvserve.clients import Client
from kvserve.clients.messages import build_request
from kvserve.testing.plugin import TEST_SERVER_ENV
from kvserve.testing.process import ServerProcess
from kvserve.v1 import llm_pb2_grpc
from kvserve.vllm import vllm_engine_pb2 as vllm_pb
from kvserve.vllm import vllm_engine_pb2_grpc


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from kvserve.testing.random_model import write_random_model

    return str(write_random_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"), dtype=torch.float32))


def _server(model: str, *flags: str) -> ServerProcess:
    return ServerProcess("--model", model, "--dtype", "float32", "--tp", "2", "--num-kv-blocks", "256",
                         "--step-timeout", "3", *flags, env=TEST_SERVER_ENV).start()


def _core_pid(server: ServerProcess) -> int:
    return int(re.search(r"engine core: pid (\d+)", server.log_text()).group(1))


async def _streams_after(target: str, n: int, hurt) -> list[grpc.aio.AioRpcError | None]:
    """Start ``n`` long streams, wait for a token of each, call ``hurt()``, return how each ended."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        calls = [stub.Stream(build_request(token_ids=[1, 2, 3 + i], max_tokens=1500, ignore_eos=True))
                 for i in range(n)]
        for c in calls:
            await c.read()
        hurt()
        ends = []
        for c in calls:
            try:
                while await c.read() is not grpc.aio.EOF:
                    pass
                ends.append(None)
            except grpc.aio.AioRpcError as e:
                ends.append(e)
        return ends


def _check_unavailable(ends, want: str) -> None:
    for e in ends:
        assert e is not None and e.code() == grpc.StatusCode.UNAVAILABLE, e
        assert "the engine failed" in e.details() and want in e.details(), e.details()


def test_core_killed_mid_stream_fails_streams_and_the_server_exits_1(tiny_model):
    server = _server(tiny_model)
    try:
        core = _core_pid(server)
        workers = children(core)
        assert workers, "the tensor-parallel worker should be a child of the core"
        ends = asyncio.run(asyncio.wait_for(_streams_after(server.target, 3, lambda: os.kill(core, 9)), 60))
        _check_unavailable(ends, "was killed by SIGKILL")
        assert server.wait(timeout=60) == 1
        assert "exiting with status 1" in server.log_text()
    finally:
        server.stop()
    time.sleep(0.5)
    assert not any(alive(p) for p in [core, *workers]), "an engine process outlived the server"


def test_stopped_worker_trips_the_step_timeout_and_shutdown_kills_it(tiny_model):
    server = _server(tiny_model)
    try:
        core = _core_pid(server)
        workers = children(core)
        stop_worker = lambda: [os.kill(w, signal.SIGSTOP) for w in workers]  # noqa: E731
        t0 = time.monotonic()
        ends = asyncio.run(asyncio.wait_for(_streams_after(server.target, 2, stop_worker), 60))
        took = time.monotonic() - t0
        _check_unavailable(ends, "sent nothing for")
        assert took < 30
        assert server.wait(timeout=60) == 1
    finally:
        server.stop()
    time.sleep(0.5)
    assert not any(alive(p) for p in [core, *workers]), "a stopped worker outlived the server"


def test_without_exit_on_failure_the_server_stays_up_not_serving(tiny_model):
    server = _server(tiny_model, "--no-exit-on-engine-failure")
    try:
        core = _core_pid(server)
        os.kill(core, signal.SIGKILL)
        with Client(server.target) as client:
            deadline = time.monotonic() + 30
            while client.health() == "SERVING" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as err:
                client.generate(token_ids=[1, 2], max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "SIGKILL" in err.value.details()
        assert server.proc.poll() is None
    finally:
        assert server.stop() == 0


def test_a_stopped_core_owing_an_answer_is_not_serving_until_it_answers(tiny_model):
    """Issue 49: with the engine core stopped (SIGSTOP) both healths said SERVING for up to
    --step-timeout while every call timed out. Now a core silent for a few seconds while it owes
    an answer is NOT_SERVING (gRPC health and the vLLM API's HealthCheck), and SERVING again, with
    the request answered, once it runs on."""
    server = ServerProcess("--model", tiny_model, "--dtype", "float32", "--num-kv-blocks", "64",
                           "--step-timeout", "300", env=TEST_SERVER_ENV).start()
    try:
        core = _core_pid(server)
        with Client(server.target) as client, grpc.insecure_channel(server.target) as ch, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            vllm = vllm_engine_pb2_grpc.VllmEngineStub(ch)
            assert client.health() == "SERVING" and vllm.HealthCheck(vllm_pb.HealthCheckRequest()).healthy
            os.kill(core, signal.SIGSTOP)
            try:
                pending = pool.submit(client.generate, token_ids=[1, 2, 3], max_tokens=4, timeout=120.0)
                deadline = time.monotonic() + 60  # liveness bound, far above the few seconds it takes
                while client.health() == "SERVING" and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert client.health() == "NOT_SERVING"
                answer = vllm.HealthCheck(vllm_pb.HealthCheckRequest())
                assert not answer.healthy and "not answering" in answer.message
            finally:
                os.kill(core, signal.SIGCONT)
            assert pending.result().usage.completion_tokens == 4
            deadline = time.monotonic() + 60
            while client.health() != "SERVING" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert client.health() == "SERVING" and vllm.HealthCheck(vllm_pb.HealthCheckRequest()).healthy
        assert "not serving until it does" in server.log_text()
    finally:
        assert server.stop() == 0
