"""vllm.grpc.engine.VllmEngine on the shared session server (the default model, float32), driven
through our own stubs of the protocol: Generate against kvserve's own Generate (greedy tokens
equal, streaming and not, n > 1, logprobs, stops, cached_tokens), the refusals by field, and
every management RPC."""

from __future__ import annotations

import io
import json
import zipfile

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvserve.clients import Client
from kvserve.testing.plugin import wait_until_idle
from kvserve.v1 import llm_pb2, llm_pb2_grpc
from kvserve.vllm import smg_common_pb2 as common
from kvserve.vllm import vllm_engine_pb2 as pb
from kvserve.vllm import vllm_engine_pb2_grpc

pytest_plugins = ["kvserve.testing.plugin"]

PROMPT = "The capital of France is"
LONG_PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


@pytest.fixture(scope="module")
def channel(kvserve_server):
    with grpc.insecure_channel(kvserve_server.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def vllm(channel):
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def ours(channel):
    return llm_pb2_grpc.LLMServiceStub(channel)


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def generate(vllm, prompt, stream: bool = False, **sampling) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(request_id="t", sampling_params=greedy(**sampling), stream=stream)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokenized.input_ids.extend(prompt)
    return list(vllm.Generate(req, timeout=60))


def idle(server) -> None:
    with Client(server.target) as c:
        wait_until_idle(c)


def test_reflection_lists_both_apis_on_one_port(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in answer.list_services_response.service}
    assert {"kvserve.v1.LLMService", "vllm.grpc.engine.VllmEngine"} <= names


def test_generate_gives_kvserve_generates_greedy_tokens_streaming_or_not(vllm, ours):
    want = ours.Generate(llm_pb2.GenerateRequest(prompt=LONG_PROMPT, sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=12)))
    ids = ours.Tokenize(llm_pb2.TokenizeRequest(prompt=LONG_PROMPT)).token_ids
    assert len(ids) > 16  # at least one full block to hit
    (whole,) = generate(vllm, LONG_PROMPT, max_tokens=12)
    assert list(whole.complete.output_ids) == list(want.token_ids)
    assert whole.complete.finish_reason == "length" and whole.complete.prompt_tokens == len(ids)
    streamed = generate(vllm, list(ids), stream=True, max_tokens=12)
    chunks, last = streamed[:-1], streamed[-1]
    assert all(r.HasField("chunk") for r in chunks) and last.HasField("complete")
    assert [t for r in chunks for t in r.chunk.token_ids] == list(want.token_ids)
    assert last.complete.completion_tokens == 12 and not last.complete.output_ids
    # the prompt ran twice now: its full blocks are cached, and every message says so
    assert chunks[0].chunk.cached_tokens == last.complete.cached_tokens > 0


def test_n_choices_come_with_their_index_and_logprobs(vllm):
    out = generate(vllm, PROMPT, max_tokens=4, n=2, logprobs=2)
    assert sorted(r.complete.index for r in out) == [0, 1]
    for r in out:
        lp = r.complete.output_logprobs
        assert list(lp.token_ids) == list(r.complete.output_ids) and len(lp.token_logprobs) == 4
        assert all(len(top.values) == 2 for top in lp.top_logprobs)


def test_stops_are_reported_as_matched(vllm, ours):
    want = ours.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=8)))
    stop_text = want.text.split()[1]  # a word the greedy answer holds
    (out,) = generate(vllm, PROMPT, max_tokens=8, stop=[stop_text])
    assert out.complete.finish_reason == "stop" and out.complete.matched_stop_str == stop_text
    (out,) = generate(vllm, PROMPT, max_tokens=8, stop_token_ids=[want.token_ids[2]])
    assert out.complete.matched_token_id == want.token_ids[2]
    assert list(out.complete.output_ids) == list(want.token_ids[:3])


def test_truncate_prompt_tokens_keeps_the_last_ones(vllm):
    (out,) = generate(vllm, "one two three four five six seven eight", max_tokens=2, truncate_prompt_tokens=3)
    assert out.complete.prompt_tokens == 3


@pytest.mark.parametrize(("request_", "code", "field"), [
    (pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(logit_bias={5: 1.0})),
     grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
    (pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(prompt_logprobs=1)),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs"),
    (pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(structural_tag="{}")),
     grpc.StatusCode.INVALID_ARGUMENT, "structural_tag"),
    (pb.GenerateRequest(text="x", kv_transfer_params_json="{}"), grpc.StatusCode.INVALID_ARGUMENT,
     "kv_transfer_params_json"),
    (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[10 ** 9])),
     grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids"),
    (pb.GenerateRequest(text="x", mm_inputs=pb.MultimodalInputs()), grpc.StatusCode.UNIMPLEMENTED,
     "mm_inputs"),
    # issue 49: accepted before, and ran to the deadline (EOS masked until max_model_len) or unconstrained
    (pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(min_tokens=2**32 - 1)),
     grpc.StatusCode.INVALID_ARGUMENT, "min_tokens (4294967295) exceeds the"),
    (pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(choice=pb.ChoiceConstraint())),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.choice.choices: must name at least one string"),
])
def test_what_kvserve_lacks_is_refused_by_name(vllm, request_, code, field):
    with pytest.raises(grpc.RpcError) as e:
        list(vllm.Generate(request_, timeout=30))
    assert e.value.code() == code and field in e.value.details()


def test_refusals_keep_their_status_and_message_and_the_server_serves_on(vllm):
    """Handlers end refused calls with ``refuse`` (no ``context.abort``: service/guards/interceptors.py),
    unary and streaming alike; the caller sees the same status and message as before."""
    limit = vllm.GetModelInfo(pb.GetModelInfoRequest()).max_context_length
    refused = [
        (lambda: list(vllm.Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1] * limit)))),
         grpc.StatusCode.INVALID_ARGUMENT,
         f"tokenized.input_ids: {limit} ids leave no room for a completion: a prompt must be shorter "
         f"than max_model_len ({limit} tokens)"),
        (lambda: list(vllm.Generate(pb.GenerateRequest(text="x", data_parallel_rank=2))),
         grpc.StatusCode.INVALID_ARGUMENT,
         "data_parallel_rank: kvserve runs one data-parallel rank (0), got 2"),
        (lambda: vllm.Embed(pb.EmbedRequest()), grpc.StatusCode.UNIMPLEMENTED,
         "Embed: kvserve serves generative models only; it computes no embeddings"),
        (lambda: vllm.FlushCache(common.FlushCacheRequest(timeout_s=-1)), grpc.StatusCode.INVALID_ARGUMENT,
         "timeout_s: must be a finite number >= 0, got -1.0"),
        (lambda: vllm.FlushCache(common.FlushCacheRequest(timeout_s=float("nan"))),
         grpc.StatusCode.INVALID_ARGUMENT, "timeout_s: must be a finite number >= 0, got nan"),
        (lambda: list(vllm.SubscribeKvEvents(common.SubscribeKvEventsRequest())),
         grpc.StatusCode.FAILED_PRECONDITION,
         "KV-cache events are off: start the server with --kv-events (or --kv-events-endpoint)"),
    ]
    for call, code, message in refused:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert (e.value.code(), e.value.details()) == (code, message)
    # a long prompt kept short by truncate_prompt_tokens runs
    (out,) = generate(vllm, [1] * limit, max_tokens=1, truncate_prompt_tokens=4)
    assert out.complete.prompt_tokens == 4


def test_embed_is_unimplemented(vllm):
    with pytest.raises(grpc.RpcError) as e:
        vllm.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1])))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_abort_ends_the_named_request_with_abort(vllm, kvserve_server):
    calls = vllm.Generate(pb.GenerateRequest(request_id="to-abort", text=PROMPT, stream=True,
                                             sampling_params=pb.SamplingParams(temperature=0, ignore_eos=True,
                                                                               max_tokens=2000)))
    first = next(calls)
    assert first.HasField("chunk")
    vllm.Abort(pb.AbortRequest(request_ids=["to-abort"]))
    rest = list(calls)
    assert rest[-1].complete.finish_reason == "abort"
    idle(kvserve_server)


def test_management_rpcs_describe_the_server(vllm, ours):
    stats = ours.Stats(llm_pb2.StatsRequest())
    assert vllm.HealthCheck(pb.HealthCheckRequest()).healthy
    info = vllm.GetModelInfo(pb.GetModelInfoRequest())
    assert info.served_model_name == stats.model and info.is_generation and info.vocab_size == 49152
    assert list(info.eos_token_ids) and info.max_context_length > 0
    server = vllm.GetServerInfo(pb.GetServerInfoRequest())
    assert server.server_type == "vllm-grpc" and server.block_size == stats.kv_block_size
    loads = vllm.GetLoads(pb.GetLoadsRequest())
    (load,) = loads.loads
    assert loads.dp_rank_count == 1
    assert load.max_total_num_tokens == stats.kv_blocks_total * stats.kv_block_size
    assert 0.0 <= load.token_usage <= 1.0
    with pytest.raises(grpc.RpcError) as e:
        vllm.GetLoads(pb.GetLoadsRequest(dp_rank=3))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in e.value.details()


def test_get_tokenizer_sends_the_ggufs_tokenizer_and_chat_template(vllm):
    import hashlib

    chunks = list(vllm.GetTokenizer(common.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    z = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(z.namelist())
    config = json.loads(z.read("tokenizer_config.json"))
    assert "<|im_start|>" in config["chat_template"]


def test_flush_cache_forgets_prefixes_when_idle(vllm, kvserve_server):
    idle(kvserve_server)
    assert vllm.FlushCache(common.FlushCacheRequest(timeout_s=5)).success
    (again,) = generate(vllm, PROMPT, max_tokens=2)
    assert again.complete.cached_tokens == 0


def test_kv_events_are_off_without_the_flag(vllm):
    with pytest.raises(grpc.RpcError) as e:
        next(vllm.SubscribeKvEvents(common.SubscribeKvEventsRequest()))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--kv-events" in e.value.details()


def test_cancelled_streams_leave_no_tracebacks(vllm, kvserve_server):
    """Issue 49: each cancelled stream logged OpenTelemetry's "Failed to detach context" with a
    traceback (no exporter configured): its context was left from another asyncio task."""
    for i in range(2):
        calls = vllm.Generate(pb.GenerateRequest(request_id=f"cancelled-{i}", text=PROMPT, stream=True,
                                                 sampling_params=pb.SamplingParams(ignore_eos=True,
                                                                                   max_tokens=500)))
        assert next(calls).HasField("chunk")
        calls.cancel()
    idle(kvserve_server)
    assert "Failed to detach context" not in kvserve_server.log_text()
