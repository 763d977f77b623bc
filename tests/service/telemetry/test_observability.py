"""Operating kvserve in a mesh, end to end on a real server (a tiny random Qwen2, so that steps
are fast): a Prometheus scrape agrees with the Stats RPC after a known workload, gRPC status
counts by method and code, JSON log lines with the request id, trace id, token counts and
timings, ``x-request-id`` in and out, and traces sent to an OTLP collector (a real gRPC
collector in this test process)."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvserve.testing.process import ServerProcess
from kvserve.v1 import llm_pb2, llm_pb2_grpc

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
MAX_TOKENS = 4


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps what it receives."""

    def __init__(self):
        self.spans = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    sink = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sink.endpoint = f"http://127.0.0.1:{port}"
    yield sink
    server.stop(None)


@pytest.fixture(scope="module")
def server(tiny_qwen2_dir, collector):
    flags = ("--model", str(tiny_qwen2_dir), "--dtype", "float32", "--num-kv-blocks", "64",
             "--metrics-port", "0", "--log-format", "json", "--otlp-endpoint", collector.endpoint)
    env = {"OMP_NUM_THREADS": "1", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with ServerProcess(*flags, env=env) as srv:
        yield srv
        assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


def request(i: int, **sampling) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        token_ids=llm_pb2.TokenIds(ids=[10 + i, 20, 30, 40, 50]),
        sampling=llm_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0, **sampling),
    )


def json_lines(server: ServerProcess) -> list[dict]:
    return [json.loads(ln) for ln in server.log_text().splitlines() if ln.startswith("{")]


def wait_for(predicate, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)
    return value


@pytest.fixture(scope="module")
def workload(stub):
    """3 Generate calls (one named by x-request-id and traced by the caller), 1 Stream call and
    one refused request; returns their responses."""
    g1, call = stub.Generate.with_call(request(1), metadata=(("x-request-id", "obs-hdr-1"),
                                                             ("traceparent", TRACEPARENT)))
    g2, call2 = stub.Generate.with_call(request(2, seed=1))
    g3 = stub.Generate(llm_pb2.GenerateRequest(request_id="obs-field-3", token_ids=request(3).token_ids,
                                               sampling=request(3).sampling))
    streamed = list(stub.Stream(request(4)))
    with pytest.raises(grpc.RpcError) as bad:
        stub.Generate(llm_pb2.GenerateRequest(request_id="obs-bad", prompt="x",
                                              sampling=llm_pb2.SamplingParams(top_p=3)))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return {"generate": [g1, g2, g3], "stream": streamed, "initial_metadata": dict(call.initial_metadata()),
            "initial_metadata_without_header": dict(call2.initial_metadata())}


def test_x_request_id_names_the_request_and_comes_back(workload):
    g1, g2, g3 = workload["generate"]
    assert g1.request_id == "obs-hdr-1" and workload["initial_metadata"]["x-request-id"] == "obs-hdr-1"
    assert g3.request_id == "obs-field-3"  # the field when given
    assert len(g2.request_id) == 32  # made by the server
    # echoed as metadata only to a call that sent the header (the id is in every message anyway)
    assert "x-request-id" not in workload["initial_metadata_without_header"]


def test_metrics_agree_with_stats_after_a_known_workload(server, stub, workload):
    stats = stub.Stats(llm_pb2.StatsRequest())
    m = server.metrics()
    done = workload["generate"] + [workload["stream"][-1]]
    assert stats.requests_finished == len(done) == m[("kvserve:request_success_total",
                                                      (("finished_reason", "length"),))]
    assert m[("kvserve:prompt_tokens_total", ())] == stats.prompt_tokens_total == 5 * len(done)
    generated = sum(r.usage.completion_tokens for r in done)
    assert m[("kvserve:generation_tokens_total", ())] == stats.generation_tokens_total == generated
    assert m[("kvserve:num_requests_running", ())] == stats.num_running == 0
    assert m[("kvserve:num_requests_waiting", ())] == stats.num_waiting == 0
    assert m[("kvserve:num_preemptions_total", ())] == stats.num_preemptions
    assert m[("kvserve:prefix_cache_hit_rate", ())] == pytest.approx(stats.prefix_cache_hit_rate)
    usage = 1 - stats.kv_blocks_free / stats.kv_blocks_total
    assert m[("kvserve:kv_cache_usage_perc", ())] == pytest.approx(usage)
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert m[(f"kvserve:{name}_seconds_count", ())] == len(done)
    assert m[("kvserve:inter_token_latency_seconds_count", ())] == generated - len(done)
    e2e = sum(r.timing.total_ms for r in done) / 1000
    assert m[("kvserve:e2e_request_latency_seconds_sum", ())] == pytest.approx(e2e, rel=1e-6)
    # the engine-core process is a process of its own, with its own CPU time and memory
    assert m[("kvserve_engine_core_process_cpu_seconds_total", ())] > 0
    assert m[("kvserve_engine_core_process_resident_memory_bytes", ())] > 0
    assert m[("process_resident_memory_bytes", ())] > 0


def test_vllm_named_gauges_alias_kvserves_for_endpoint_pickers(server, stub, workload):
    stats = stub.Stats(llm_pb2.StatsRequest())
    m = server.metrics()
    assert m[("vllm:num_requests_waiting", ())] == stats.num_waiting + stats.num_queued
    assert m[("vllm:num_requests_running", ())] == m[("kvserve:num_requests_running", ())]
    assert m[("vllm:kv_cache_usage_perc", ())] == m[("kvserve:kv_cache_usage_perc", ())]
    assert 0.0 <= m[("vllm:kv_cache_usage_perc", ())] <= 1.0
    labels = (("block_size", str(stats.kv_block_size)), ("num_gpu_blocks", str(stats.kv_blocks_total)))
    assert m[("vllm:cache_config_info", labels)] == 1.0


def test_metrics_count_grpc_status_by_method_and_code(server, workload):
    m = server.metrics()

    def handled(method: str, code: str) -> float:
        key = (("grpc_code", code), ("grpc_method", method), ("grpc_service", "kvserve.v1.LLMService"))
        return m.get(("kvserve:grpc_server_handled_total", key), 0)

    assert handled("Generate", "OK") == 3
    assert handled("Generate", "INVALID_ARGUMENT") == 1
    assert handled("Stream", "OK") == 1


def test_metrics_carry_the_model_name_label(server, stub, workload):
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    model = stub.Stats(llm_pb2.StatsRequest()).model
    families = [f for f in text_string_to_metric_families(text) if f.name.startswith("kvserve:")]
    assert len(families) >= 15
    for family in families:
        for sample in family.samples:
            assert sample.labels["model_name"] == model, sample


def test_json_log_line_per_request(server, workload):
    lines = json_lines(server)
    (traced,) = [ln for ln in lines if ln.get("request_id") == "obs-hdr-1"]
    g1 = workload["generate"][0]
    assert traced["message"] == "request obs-hdr-1 finished"
    assert traced["trace_id"] == TRACE_ID  # the caller's trace
    assert traced["status"] == "OK" and traced["finish_reason"] == "LENGTH"
    assert traced["prompt_tokens"] == 5 and traced["completion_tokens"] == MAX_TOKENS
    assert traced["ttft_ms"] == pytest.approx(g1.timing.ttft_ms)
    assert traced["total_ms"] == pytest.approx(g1.timing.total_ms)
    (bad,) = [ln for ln in lines if ln.get("request_id") == "obs-bad"]
    assert bad["status"] == "INVALID_ARGUMENT" and "top_p" in bad["message"]
    assert all({"time", "level", "logger", "message"} <= ln.keys() for ln in lines)


def test_spans_reach_the_otlp_collector_joined_to_the_callers_trace(collector, workload):
    def traced():
        return [s for s in collector.spans if s.trace_id.hex() == TRACE_ID]

    (span,) = wait_for(traced)
    assert span.name == "kvserve.v1.LLMService/Generate"
    assert span.parent_span_id.hex() == PARENT_SPAN_ID
    assert span.kind == span.SPAN_KIND_SERVER
    events = [e.name for e in span.events]
    assert events == ["queued", "scheduled", "first_token"]
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["kvserve.request_id"].string_value == "obs-hdr-1"
    assert attrs["gen_ai.usage.output_tokens"].int_value == MAX_TOKENS
    assert attrs["gen_ai.usage.input_tokens"].int_value == 5
    assert [v.string_value for v in attrs["gen_ai.response.finish_reasons"].array_value.values] == ["LENGTH"]
    assert attrs["rpc.grpc.status_code"].int_value == 0
