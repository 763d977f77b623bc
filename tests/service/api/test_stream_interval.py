"""--stream-interval N on a real server: the first token goes out at once, then a message per N
tokens (more when the reader lags), the finished one whatever its count; the tokens and text
are those of Generate. Unit-level: the RequestStream wakes its reader only when ready."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from kvserve.clients.messages import build_request
from kvserve.engine.frontend.request_stream import RequestStream
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sequence import FinishReason, SequenceTimes
from kvserve.testing.plugin import TEST_SERVER_ENV
from kvserve.testing.process import ServerProcess
from kvserve.v1 import llm_pb2_grpc

INTERVAL = 4
MAX_TOKENS = 11


def delta(tok: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("k", [tok], f"<{tok}>", [], finished, FinishReason.LENGTH if finished else None,
                         3, tok, 0, SequenceTimes())


def test_the_reader_is_woken_for_the_first_token_then_per_interval_and_at_the_end():
    async def run():
        stream = RequestStream("k", lambda key, finished: None, interval=3)
        reads = []

        async def reader():
            async for out in stream:
                reads.append(out.new_token_ids)

        task = asyncio.create_task(reader())
        for tok in range(1, 8):  # 1 alone; 2, 3, 4 together; 5, 6 wait; 7 finishes
            stream.push(delta(tok, finished=tok == 7))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            if tok == 6:
                assert reads == [[1], [2, 3, 4]]  # two tokens waiting: the reader still sleeps
        await task
        return reads

    assert asyncio.run(run()) == [[1], [2, 3, 4], [5, 6, 7]]


def test_an_error_wakes_a_reader_held_by_the_interval():
    async def run():
        stream = RequestStream("k", lambda key, finished: None, interval=8)
        stream.push(delta(1))
        assert (await anext(stream)).new_token_ids == [1]
        stream.push(delta(2))
        stream.fail(RuntimeError("core gone"))
        got = await anext(stream)  # the token that arrived before the error still goes out
        with pytest.raises(RuntimeError, match="core gone"):
            await anext(stream)
        return got

    assert asyncio.run(run()).new_token_ids == [2]
    with pytest.raises(ValueError, match="interval must be >= 1"):
        RequestStream("k", lambda key, finished: None, interval=0)


def test_serve_refuses_a_stream_interval_below_one():
    out = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--stream-interval", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--stream-interval must be >= 1, got 0" in out.stderr


def test_a_server_with_a_stream_interval_batches_the_stream_and_keeps_its_tokens():
    with ServerProcess("--stream-interval", str(INTERVAL), "--kv-cache-memory", "0.25",
                       env=TEST_SERVER_ENV) as srv, grpc.insecure_channel(srv.target) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        req = build_request("The three primary colors are", max_tokens=MAX_TOKENS, temperature=0,
                            ignore_eos=True)
        msgs = list(stub.Stream(req))
        whole = stub.Generate(req)
    counts = [len(m.token_ids) for m in msgs]
    assert sum(counts) == MAX_TOKENS and counts[0] == 1
    assert all(c >= INTERVAL for c in counts[1:-1]) and len(msgs) <= 1 + -(-(MAX_TOKENS - 1) // INTERVAL)
    assert [t for m in msgs for t in m.token_ids] == list(whole.token_ids)
    assert "".join(m.text for m in msgs) == whole.text
    assert msgs[-1].finish_reason == whole.finish_reason and msgs[-1].usage.completion_tokens == MAX_TOKENS
