"""The gRPC server started with ``--tp``: the same greedy tokens as the single-process server,
and a worker killed mid-stream ends the call with an error status and turns health
NOT_SERVING, with nothing left hanging."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from kvserve.benchmarks.instruments.procfs import alive, children
from kvserve.clients import Client
from kvserve.testing.process import ServerProcess

pytest_plugins = ["kvserve.testing.plugin"]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def tp_server():
    from kvserve.testing.plugin import TEST_SERVER_ENV  # after pytest has loaded it as a plugin

    # stays up after the engine died, so that the test can see health NOT_SERVING (the default,
    # exiting with status 1, is tested in test_service_faults.py)
    flags = ("--tp", "3", "--dtype", "float32", "--kv-cache-memory", "0.25", "--max-num-seqs", "8",
             "--no-exit-on-engine-failure")
    with ServerProcess(*flags, env=TEST_SERVER_ENV) as server:
        yield server


@pytest.mark.slow
def test_tp3_server_gives_the_single_process_servers_greedy_tokens(tp_server, kvserve_server):
    with Client(tp_server.target) as tp, Client(kvserve_server.target) as single:
        assert tp.stats()["tp_size"] == 3
        for prompt in PROMPTS:
            ours = tp.generate(prompt, temperature=0, max_tokens=24, ignore_eos=True)
            ref = single.generate(prompt, temperature=0, max_tokens=24, ignore_eos=True)
            assert list(ours.token_ids) == list(ref.token_ids)
            assert ours.text == ref.text


def test_killed_worker_fails_the_stream_and_turns_health_not_serving(tp_server):
    cmdline = lambda pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")  # noqa: E731
    (core,) = [p for p in children(tp_server.proc.pid) if "kvserve engine-core" in cmdline(p)]
    workers = [p for p in children(core) if "kvserve worker" in cmdline(p)]
    assert len(workers) == 2, workers
    with Client(tp_server.target) as client:
        stream = client.stream("Count slowly:", temperature=0, max_tokens=2000, ignore_eos=True)
        next(iter(stream))  # the request is running
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        end = time.monotonic() + 30
        while client.health() != "NOT_SERVING":
            assert time.monotonic() < end, "health did not turn NOT_SERVING"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as err:
            client.generate("hi", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    tp_server.stop(timeout=60)
    assert not [p for p in [core, *workers] if alive(p)], "engine processes outlived the server"
