"""LLMService end to end: a real server (the shared session server, default model, float32)
against the offline engine on the same weights; streaming, chat, token-id prompts, stop
strings, logprobs, 32 concurrent streams, cancel and deadline freeing KV blocks, validation,
health, stats, and the `kvserve` client subcommands."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time

import grpc
import pytest
import torch

from kvserve.clients import AsyncClient, Client
from kvserve.clients.messages import build_request
from kvserve.engine import LLM, SamplingParams
from kvserve.testing.plugin import wait_until_idle
from kvserve.v1 import llm_pb2, llm_pb2_grpc

pytest_plugins = ["kvserve.testing.plugin"]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NUM_CONCURRENT = 32


@pytest.fixture(scope="module")
def offline():
    """The in-process reference, on one thread like the server (see TEST_SERVER_ENV)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(dtype="float32", kv_cache_memory=0.25)
    yield llm
    llm.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(kvserve_server):
    with Client(kvserve_server.target) as c:
        yield c


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_generate_and_stream_give_the_offline_engines_greedy_tokens(client, offline):
    expected = offline.generate(PROMPTS[:2], greedy(16), use_tqdm=False)
    for prompt, want in zip(PROMPTS[:2], expected, strict=True):
        got = client.generate(prompt, temperature=0, max_tokens=16)
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason.name
        deltas = list(client.stream(prompt, temperature=0, max_tokens=16))
        assert [t for d in deltas for t in d.token_ids] == want.token_ids
        assert "".join(d.text for d in deltas) == got.text
        assert all(not d.finished for d in deltas[:-1]) and deltas[-1].finished
        usage = deltas[-1].usage
        assert usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
        assert usage.completion_tokens == len(want.token_ids)
        t = deltas[-1].timing
        assert 0 <= t.queue_ms <= t.ttft_ms <= t.total_ms


def test_stream_sends_one_message_per_token(client):
    deltas = list(client.stream(PROMPTS[0], temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(d.token_ids) for d in deltas] == [1] * 6
    assert deltas[-1].finish_reason == "LENGTH" and deltas[-1].usage.completion_tokens == 6


def test_token_id_prompt_and_chat_messages_match_the_offline_engine(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[1])
    by_ids = client.generate(token_ids=ids, temperature=0, max_tokens=16)
    assert by_ids.token_ids == client.generate(PROMPTS[1], temperature=0, max_tokens=16).token_ids
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    want = offline.chat(chat, greedy(16), use_tqdm=False)
    got = client.generate(messages=chat, temperature=0, max_tokens=16)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.usage.prompt_tokens == len(offline.engine.apply_chat_template(chat))


def test_multibyte_characters_stream_as_valid_utf8(client, offline):
    # 4-byte characters that take several tokens each
    prompt = "Emoji: \U0001f600 \U0001f603 \U0001f604 \U0001f601 \U0001f606"
    want = offline.generate(prompt, greedy(30), use_tqdm=False)[0]
    assert any(ord(c) > 127 for c in want.text), "the prompt no longer produces multi-byte characters"
    deltas = list(client.stream(prompt, temperature=0, max_tokens=30))
    for d in deltas:
        assert "\ufffd" not in d.text
        d.text.encode("utf-8")  # raises on lone surrogates
    assert "".join(d.text for d in deltas) == want.text
    # some character spanned several tokens: its first tokens streamed with no text
    assert any(d.token_ids and not d.text for d in deltas[:-1])


def test_stop_string_ends_generation_and_never_appears(client, offline):
    full = offline.generate(PROMPTS[2], greedy(20), use_tqdm=False)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    cut = full[: full.index(stop)]
    got = client.generate(PROMPTS[2], temperature=0, max_tokens=20, stop=[stop])
    assert got.finish_reason == "STOP_STRING" and got.text == cut
    streamed = "".join(d.text for d in client.stream(PROMPTS[2], temperature=0, max_tokens=20, stop=[stop]))
    assert streamed == cut and stop not in streamed


def test_logprobs_give_the_chosen_token_and_top_n(client):
    got = client.generate(PROMPTS[0], temperature=0, max_tokens=5, logprobs=3)
    assert len(got.logprobs) == len(got.token_ids)
    for lp, tok in zip(got.logprobs, got.token_ids, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the chosen token is the best
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert client.generate(PROMPTS[0], temperature=0, max_tokens=5).logprobs == []


def test_logprobs_carry_each_tokens_text(client):
    """The chosen token's and every alternative's text, decoded alone; put together, the chosen
    tokens' texts are the completion (this model's tokens decode with their spaces)."""
    from kvserve.engine.model_loader.source import resolve_model
    from kvserve.engine.tokenizer.load import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("default"))
    got = client.generate(PROMPTS[0], temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    deltas = client.stream(PROMPTS[0], temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert got.logprobs == streamed
    for lp in got.logprobs:
        assert lp.token == tokenizer.decode([lp.token_id], skip_special_tokens=False)
        assert lp.top_tokens == [tokenizer.decode([t], skip_special_tokens=False) for t, _ in lp.top]
    assert "".join(lp.token for lp in got.logprobs) == got.text


def test_repeated_prompt_reports_cached_tokens_and_same_output(client):
    prompt = "Here is a long shared system prompt that several requests reuse verbatim. " * 3
    first = client.generate(prompt, temperature=0, max_tokens=8)
    second = client.generate(prompt, temperature=0, max_tokens=8)
    assert second.token_ids == first.token_ids
    assert second.usage.cached_tokens >= 16 and second.usage.cached_tokens <= second.usage.prompt_tokens


def test_32_concurrent_streams_complete_with_independent_outputs(kvserve_server, offline):
    prompts = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(NUM_CONCURRENT)]
    expected = offline.generate(prompts, greedy(10, ignore_eos=True), use_tqdm=False)
    assert len({tuple(e.token_ids) for e in expected}) > NUM_CONCURRENT // 2  # the outputs differ

    async def one(c: AsyncClient, i: int):
        stream = c.stream(prompts[i], request_id=f"c{i}", temperature=0, max_tokens=10, ignore_eos=True)
        return [d async for d in stream]

    async def run():
        async with AsyncClient(kvserve_server.target) as c:
            return await asyncio.gather(*(one(c, i) for i in range(NUM_CONCURRENT)))

    results = asyncio.run(run())
    for i, deltas in enumerate(results):
        assert {d.request_id for d in deltas} == {f"c{i}"}
        assert [t for d in deltas for t in d.token_ids] == expected[i].token_ids, f"stream {i}"
        assert "".join(d.text for d in deltas) == expected[i].text
        assert deltas[-1].finished


def test_cancelling_streams_returns_all_their_blocks(kvserve_server, client):
    before = wait_until_idle(client)

    async def run():
        async with grpc.aio.insecure_channel(kvserve_server.target) as ch:
            stub = llm_pb2_grpc.LLMServiceStub(ch)
            calls = [
                stub.Stream(build_request(f"Story number {i}:", max_tokens=2000, ignore_eos=True))
                for i in range(10)
            ]
            for call in calls:  # every stream is generating
                await call.read()
                await call.read()
            mid = await stub.Stats(llm_pb2.StatsRequest())
            for call in calls:
                call.cancel()
            for call in calls:
                assert await call.code() == grpc.StatusCode.CANCELLED
            return mid

    mid = asyncio.run(run())
    assert mid.num_running + mid.num_waiting == 10
    assert mid.kv_blocks_free < before["kv_blocks_free"]
    after = wait_until_idle(client)
    assert after["kv_blocks_free"] == before["kv_blocks_free"]
    assert after["requests_aborted"] - before["requests_aborted"] == 10
    assert client.generate("Still there?", max_tokens=4).usage.completion_tokens >= 1
    assert "cancelled" in kvserve_server.log_text()


def test_deadline_aborts_the_request_and_frees_its_blocks(client, offline):
    before = wait_until_idle(client)
    prompt = "Write a very long essay:"
    longest = offline.engine.config.max_model_len - len(offline.tokenizer.encode(prompt))
    with pytest.raises(grpc.RpcError) as err:
        # 5 s: far below the decode of thousands of tokens, far above the server's refusal's round trip (at
        # 0.2 s a refusal could come after the client's own expiry, which counts no abort)
        client.generate(prompt, max_tokens=longest, ignore_eos=True, timeout=5.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = wait_until_idle(client)
    assert after["kv_blocks_free"] == before["kv_blocks_free"]
    # the default (fair) policy refuses at once what its step time model says cannot finish in time
    # (engine/tenancy/deadlines.py: nothing ran, nothing to abort); before the model has seen enough
    # steps the request is admitted and the deadline aborts it
    refused = "cannot finish before its deadline" in (err.value.details() or "")
    assert after["requests_aborted"] - before["requests_aborted"] == (0 if refused else 1)


def _invalid_cases(max_model_len: int) -> list[tuple[llm_pb2.GenerateRequest, str]]:
    def req(**sampling):
        return llm_pb2.GenerateRequest(prompt="Hello", sampling=llm_pb2.SamplingParams(**sampling))

    chat = llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(role="wizard", content="hi")])
    return [
        (llm_pb2.GenerateRequest(), "input"),
        (llm_pb2.GenerateRequest(prompt=""), "prompt"),
        (llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds()), "token_ids"),
        (llm_pb2.GenerateRequest(messages=llm_pb2.ChatMessages()), "messages"),
        (req(max_tokens=max_model_len), "max_model_len"),
        (req(temperature=math.nan), "temperature"),
        (req(temperature=math.inf), "temperature"),
        (req(temperature=-1.0), "temperature"),
        (req(top_p=0.0), "top_p"),
        (req(top_p=1.5), "top_p"),
        (req(top_k=-1), "top_k"),
        (req(min_p=-0.1), "min_p"),
        (req(min_p=1.1), "min_p"),
        (llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds(ids=[1, 10**6])), "token_ids"),
        (req(max_tokens=3, min_tokens=4), "min_tokens"),
        (llm_pb2.GenerateRequest(messages=chat), "role"),
        (req(stop=[f"s{i}" for i in range(17)]), "stop"),
        (req(stop=["x" * 1000]), "stop"),
        (req(logprobs=1000), "logprobs"),
    ]


def test_every_invalid_request_gets_invalid_argument_naming_the_field(kvserve_server, client, offline):
    with grpc.insecure_channel(kvserve_server.target) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        for request, field in _invalid_cases(offline.engine.config.max_model_len):
            for rpc in (stub.Generate, lambda r: list(stub.Stream(r))):
                with pytest.raises(grpc.RpcError) as err:
                    rpc(request)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, err.value.details())
                assert field in err.value.details(), (field, err.value.details())
    assert client.health() == "SERVING"
    assert client.generate("Still fine?", max_tokens=3).usage.completion_tokens >= 1


def test_health_reports_serving_for_the_server_and_the_service(client):
    assert client.health("") == "SERVING"
    assert client.health() == "SERVING"
    with pytest.raises(grpc.RpcError) as err:
        client.health("no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_stats_has_every_field_with_sane_values(client):
    client.generate(PROMPTS[0], max_tokens=2)
    s = wait_until_idle(client)
    assert "SmolLM2" in s["model"]
    assert (s["device"], s["dtype"], s["tp_size"], s["kv_block_size"], s["kv_cache_dtype"]) == (
        "cpu", "float32", 1, 16, "float32")
    assert s["max_queue"] == 64
    assert 0 < s["kv_blocks_free"] <= s["kv_blocks_total"]
    assert 0.0 <= s["prefix_cache_hit_rate"] <= 1.0
    assert s["requests_finished"] >= 1 and s["generation_tokens_total"] >= 2 and s["prompt_tokens_total"] >= 1
    assert s["uptime_s"] > 0


def test_watch_stats_streams_snapshots_until_cancelled(client):
    snapshots = []
    for snap in client.watch_stats(interval_ms=100):
        snapshots.append(snap)
        if len(snapshots) == 3:
            break
    assert snapshots[0]["uptime_s"] < snapshots[1]["uptime_s"] < snapshots[2]["uptime_s"]
    with pytest.raises(grpc.RpcError) as err:
        next(iter(client.watch_stats(interval_ms=1)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "interval_ms" in err.value.details()


def test_each_finished_request_logs_one_line(kvserve_server, client):
    done = client.generate(PROMPTS[0], request_id="log-me-1", max_tokens=3)
    assert done.request_id == "log-me-1"
    lines = [ln for ln in kvserve_server.log_text().splitlines() if "request log-me-1 finished" in ln]
    assert len(lines) == 1
    for key in ("prompt_tokens=", "completion_tokens=3", "ttft_ms=", "total_ms=", "finish_reason=LENGTH"):
        assert key in lines[0]


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvserve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_cli_generate_stream_and_stats(kvserve_server, client):
    want = client.generate(PROMPTS[0], temperature=0, max_tokens=8).text
    out = _cli("generate", "--target", kvserve_server.target, "--temperature", "0", "--max-tokens", "8",
               PROMPTS[0])
    assert out.returncode == 0 and out.stdout == want + "\n"
    out = _cli("generate", "--stream", "--target", kvserve_server.target, "--temperature", "0",
               "--max-tokens", "8", PROMPTS[0])
    assert out.returncode == 0 and out.stdout == want + "\n" and "LENGTH" in out.stderr
    out = _cli("stats", "--target", kvserve_server.target)
    assert out.returncode == 0 and json.loads(out.stdout)["kv_block_size"] == 16
    out = _cli("generate", "--target", kvserve_server.target, "--top-p", "2", PROMPTS[0])
    assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr and "top_p" in out.stderr


def test_huge_prompts_do_not_stall_an_unrelated_request(kvserve_server, client):
    """Defect: a 10 MB prompt was tokenized on the engine thread before its length check and
    stopped every stream for ~10 s. Now prompts are tokenized off the event loop and the engine,
    and one too long for any tokenization is refused by its character count."""

    def unrelated_ms() -> float:
        t0 = time.perf_counter()
        client.generate(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
        return (time.perf_counter() - t0) * 1000

    async def huge_ones(target: str, started: asyncio.Event) -> list:
        big, long_ok = "x " * 5_000_000, "hello world " * 40_000  # 10 MB; 480 k chars (tokenized)
        options = [("grpc.max_send_message_length", 1 << 25)]
        async with grpc.aio.insecure_channel(target, options=options) as ch:
            stub = llm_pb2_grpc.LLMServiceStub(ch)
            calls = [stub.Generate(build_request(p, max_tokens=4)) for p in [big] * 4 + [long_ok] * 2]
            started.set()
            return await asyncio.gather(*calls, return_exceptions=True)

    async def run():
        started = asyncio.Event()
        job = asyncio.ensure_future(huge_ones(kvserve_server.target, started))
        await started.wait()
        await asyncio.sleep(0.3)  # the huge requests are on their way / being tokenized
        during = await asyncio.to_thread(unrelated_ms)
        return during, await job

    alone = min(unrelated_ms() for _ in range(3))
    during, results = asyncio.run(run())
    for r in results:
        assert isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.INVALID_ARGUMENT, r
    assert all("characters cannot fit max_model_len" in r.details() for r in results[:4])
    # tokenized, then refused by the front-end: never shipped to the engine core
    assert all("tokens leave no room for a completion" in r.details() for r in results[4:])
    print(f"unrelated request: {alone:.0f} ms alone, {during:.0f} ms beside 4 x 10 MB + 2 x 480 kB prompts")
    assert during < alone + 3000  # before the fix: ~10 s per 10 MB prompt
