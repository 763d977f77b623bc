"""Tracing with OpenTelemetry's in-memory exporter: a real server (the gRPC front-end in this
process, the engine core in its own, on a tiny random Qwen2) built with a tracer provider that
keeps its spans. One SERVER span per call, joined to the caller's W3C trace, with the request's
milestones as events and its token counts and finish reason as attributes; the gRPC status on
every span. Also the ModelInfo and Tokenize RPCs on the same server."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvserve.engine.config import EngineConfig
from kvserve.engine.frontend.async_engine import AsyncEngine
from kvserve.service.health import Health
from kvserve.service.server import bind, build_server
from kvserve.service.telemetry.calls import Telemetry
from kvserve.service.telemetry.observability import Observability
from kvserve.service.telemetry.tracing import Tracing
from kvserve.v1 import llm_pb2, llm_pb2_grpc

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
PARENT_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"
PROMPT = llm_pb2.TokenIds(ids=[11, 12, 13, 14])


def greedy(max_tokens: int) -> llm_pb2.SamplingParams:
    return llm_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def run_calls(model_dir) -> tuple[dict, list]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = AsyncEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64))
    server = build_server(engine, Health(), Observability(Telemetry(Tracing(provider)), None))
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    engine.start()
    results = {}
    try:
        await engine.wait_ready()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = llm_pb2_grpc.LLMServiceStub(channel)
            traced = stub.Stream(llm_pb2.GenerateRequest(request_id="traced-1", token_ids=PROMPT,
                                                         sampling=greedy(5)),
                                 metadata=(("traceparent", TRACEPARENT),))
            results["stream"] = [m async for m in traced]
            results["untraced"] = await stub.Generate(llm_pb2.GenerateRequest(token_ids=PROMPT,
                                                                               sampling=greedy(2)))
            for name, req, timeout in (
                ("invalid", llm_pb2.GenerateRequest(prompt="hi", sampling=llm_pb2.SamplingParams(top_k=-5)),
                 None),
                ("deadline", llm_pb2.GenerateRequest(token_ids=PROMPT, sampling=greedy(240)), 0.05),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(req, timeout=timeout)
                results[name] = err.value.code()
            results["info"] = await stub.ModelInfo(llm_pb2.ModelInfoRequest())
            chat = llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(role="user", content="Hello there")])
            results["tokenize_chat"] = await stub.Tokenize(llm_pb2.TokenizeRequest(messages=chat))
            results["tokenize_text"] = await stub.Tokenize(llm_pb2.TokenizeRequest(prompt="Hello there"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Tokenize(llm_pb2.TokenizeRequest())
            results["tokenize_empty"] = err.value
            await asyncio.sleep(0.2)  # the deadline's span ends once its handler has unwound
    finally:
        await server.stop(None)
        await engine.shutdown()
    return results, list(exporter.get_finished_spans())


@pytest.fixture(scope="module")
def traced(tiny_qwen2_dir):
    return asyncio.run(run_calls(tiny_qwen2_dir))


def spans_named(spans, method: str):
    return [s for s in spans if s.name == f"kvserve.v1.LLMService/{method}"]


def test_stream_span_joins_the_callers_trace_with_milestones_and_usage(traced):
    results, spans = traced
    (span,) = [s for s in spans_named(spans, "Stream")]
    assert span.kind == SpanKind.SERVER
    assert span.context.trace_id == TRACE_ID and span.parent.span_id == PARENT_ID
    assert [e.name for e in span.events] == ["queued", "scheduled", "first_token"]
    stamps = [e.timestamp for e in span.events]
    assert span.start_time <= stamps[0] and stamps[1] <= stamps[2] <= span.end_time
    a = span.attributes
    last = results["stream"][-1]
    assert a["kvserve.request_id"] == "traced-1"
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT.ids) == last.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == 5 == last.usage.completion_tokens
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("LENGTH",)
    assert a["rpc.system"] == "grpc" and a["rpc.method"] == "Stream" and a["rpc.grpc.status_code"] == 0
    assert span.status.status_code == StatusCode.UNSET


def test_a_call_without_traceparent_starts_its_own_trace(traced):
    results, spans = traced
    ok = [s for s in spans_named(spans, "Generate") if s.attributes["rpc.grpc.status_code"] == 0]
    (span,) = ok
    assert span.parent is None and span.context.trace_id != TRACE_ID
    assert span.attributes["kvserve.request_id"] == results["untraced"].request_id


def test_errors_are_on_the_span_server_faults_only_as_error_status(traced):
    results, spans = traced
    assert results["invalid"] == grpc.StatusCode.INVALID_ARGUMENT
    assert results["deadline"] == grpc.StatusCode.DEADLINE_EXCEEDED
    codes = {s.attributes["rpc.grpc.status_code"]: s for s in spans_named(spans, "Generate")}
    invalid = codes[grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    assert invalid.status.status_code == StatusCode.UNSET  # the caller's mistake
    assert "queued" not in [e.name for e in invalid.events]
    deadline = codes[grpc.StatusCode.DEADLINE_EXCEEDED.value[0]]
    assert deadline.status.status_code == StatusCode.ERROR
    assert "queued" in [e.name for e in deadline.events]


def test_every_rpc_gets_a_span(traced):
    _, spans = traced
    assert len(spans_named(spans, "ModelInfo")) == 1 and len(spans_named(spans, "Tokenize")) == 3


def test_model_info_describes_the_served_model(traced, tiny_qwen2_dir):
    from kvserve.engine.model_loader.loader import load_generation_eos, load_hf_config
    from kvserve.engine.model_loader.source import resolve_model
    from kvserve.engine.tokenizer.load import load_tokenizer

    info = traced[0]["info"]
    assert info.model == tiny_qwen2_dir.name and info.architecture == "Qwen2ForCausalLM"
    assert info.vocab_size == 512 and info.max_model_len == 256
    src = resolve_model(str(tiny_qwen2_dir))
    eos = load_generation_eos(src, load_hf_config(src), load_tokenizer(src))  # what the engine stops on
    assert list(info.eos_token_ids) == eos and {3, 7} <= set(eos)  # generation_config.json's among them
    assert info.dtype == "float32" and info.tp_size == 1 and info.kv_block_size == 16
    assert info.has_chat_template


def test_tokenize_returns_the_ids_generate_would_use(traced, default_source):
    from kvserve.engine.tokenizer.load import load_tokenizer

    tok = load_tokenizer(default_source)  # the tiny model carries the default model's tokenizer
    results = traced[0]
    text = results["tokenize_text"]
    assert list(text.token_ids) == tok.encode("Hello there") and text.count == len(text.token_ids)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                       add_generation_prompt=True)
    chat = results["tokenize_chat"]
    assert list(chat.token_ids) == tok.encode(rendered, add_special_tokens=False)
    assert chat.count == len(chat.token_ids) > text.count
    empty = results["tokenize_empty"]
    assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT and "input" in empty.details()
