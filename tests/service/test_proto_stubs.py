"""The committed Python stubs are those of the current llm.proto, and the proto agrees with
the engine's Python types (the same field names)."""

from __future__ import annotations

import dataclasses

import pytest
from google.protobuf import descriptor_pb2

from kvserve.engine.core.ipc import ModelFacts
from kvserve.engine.frontend.engine_state import ServerStats
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import FinishReason
from kvserve.service import protogen
from kvserve.service.api.validation import sampling_from_proto
from kvserve.v1 import llm_pb2, llm_pb2_grpc
from kvserve.vllm import smg_common_pb2, vllm_engine_pb2


@pytest.mark.parametrize("module", [llm_pb2, vllm_engine_pb2, smg_common_pb2], ids=lambda m: m.__name__)
def test_stubs_in_use_match_the_proto_file(tmp_path, module):
    fresh = descriptor_pb2.FileDescriptorSet.FromString(protogen.descriptor_set(tmp_path / "api.pb"))
    (fresh_file,) = [f for f in fresh.file if f.name == module.DESCRIPTOR.name]
    in_use = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    assert _without_json_names(in_use) == _without_json_names(fresh_file), (
        "stale stubs: run `make proto` and commit proto/kvserve/*/*_pb2*.py*"
    )


def _without_json_names(fd: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """protoc fills json_name in descriptor sets; the Python stubs embed the descriptor without it."""
    fd = descriptor_pb2.FileDescriptorProto.FromString(fd.SerializeToString())
    stack = list(fd.message_type)
    while stack:
        msg = stack.pop()
        for f in msg.field:
            f.ClearField("json_name")
        stack.extend(msg.nested_type)
    return fd


def test_grpc_stub_has_every_rpc_of_the_service():
    service = llm_pb2.DESCRIPTOR.services_by_name["LLMService"]
    rpcs = {m.name for m in service.methods}
    assert rpcs == {"Generate", "Stream", "Stats", "WatchStats", "Tokenize", "ModelInfo"}
    for name in rpcs:
        assert hasattr(llm_pb2_grpc.LLMServiceServicer, name)
    assert service.methods_by_name["Stream"].server_streaming
    assert service.methods_by_name["WatchStats"].server_streaming
    assert not service.methods_by_name["Generate"].server_streaming


def test_sampling_params_fields_match_the_engine_and_unset_means_default():
    proto_fields = {f.name for f in llm_pb2.SamplingParams.DESCRIPTOR.fields}
    assert proto_fields == {f.name for f in dataclasses.fields(SamplingParams)}
    assert sampling_from_proto(llm_pb2.SamplingParams()) == SamplingParams()


def test_zero_is_a_real_value_for_optional_sampling_fields():
    msg = llm_pb2.SamplingParams(temperature=0.0, top_k=0, presence_penalty=0.0, skip_special_tokens=False)
    params = sampling_from_proto(msg)
    assert params.temperature == 0.0 and params.greedy
    assert params.skip_special_tokens is False


def test_finish_reasons_match_the_engine():
    names = set(llm_pb2.FinishReason.keys())
    assert names == {"FINISH_REASON_UNSPECIFIED"} | {r.name for r in FinishReason}
    assert llm_pb2.FINISH_REASON_UNSPECIFIED == 0


def test_messages_have_the_contract_field_names():
    def fields(msg) -> set[str]:
        return {f.name for f in msg.DESCRIPTOR.fields}

    assert fields(llm_pb2.GenerateRequest) == {"request_id", "prompt", "token_ids", "messages", "sampling",
                                               "priority"}
    oneof = llm_pb2.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert {f.name for f in oneof.fields} == {"prompt", "token_ids", "messages"}
    assert fields(llm_pb2.TokenIds) == {"ids"}
    assert fields(llm_pb2.GenerateResponse) >= {
        "request_id", "text", "token_ids", "finish_reason", "usage", "timing", "logprobs"
    }
    assert fields(llm_pb2.StreamResponse) >= {
        "request_id", "text", "token_ids", "logprobs", "finish_reason", "usage", "timing"
    }
    assert fields(llm_pb2.Usage) == {"prompt_tokens", "completion_tokens", "cached_tokens", "draft_tokens",
                                     "accepted_draft_tokens"}
    assert fields(llm_pb2.Timing) == {"queue_ms", "ttft_ms", "total_ms"}
    assert fields(llm_pb2.WatchStatsRequest) == {"interval_ms"}
    assert fields(llm_pb2.StatsResponse) >= {
        "model", "device", "dtype", "tp_size", "num_waiting", "num_running", "num_queued", "max_queue",
        "kv_blocks_total", "kv_blocks_free", "kv_block_size", "prefix_cache_hit_rate", "num_preemptions",
        "requests_finished", "requests_aborted", "requests_rejected", "prompt_tokens_total",
        "generation_tokens_total", "uptime_s", "state_slots_total", "state_slots_free",
        "state_snapshots_total", "state_snapshots_cached", "state_snapshot_hits", "state_cache_bytes",
    }


def test_every_message_and_field_is_documented(tmp_path):
    """Comments are what `grpcurl describe` shows; none may be missing."""
    path = tmp_path / "llm.pb"
    protogen.protoc(["--include_source_info", f"--descriptor_set_out={path}", "kvserve/v1/llm.proto"])
    (fd,) = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes()).file
    documented = {tuple(loc.path) for loc in fd.source_code_info.location if loc.leading_comments.strip()}
    # paths: 4 = message_type, 2 = field, 5 = enum_type, 6 = service
    for i, msg in enumerate(fd.message_type):
        assert (4, i) in documented, f"message {msg.name} has no comment"
        for j, f in enumerate(msg.field):
            if (msg.name, f.name) in _SELF_EXPLAINING:
                continue
            assert (4, i, 2, j) in documented, f"field {msg.name}.{f.name} has no comment"
    for i, enum in enumerate(fd.enum_type):
        assert (5, i) in documented, f"enum {enum.name} has no comment"
    for i, svc in enumerate(fd.service):
        assert (6, i) in documented
        for j, m in enumerate(svc.method):
            assert (6, i, 2, j) in documented, f"rpc {m.name} has no comment"


# Fields whose message comment already says all there is to say.
_SELF_EXPLAINING = {
    ("TopLogprob", "token_id"),
    ("GenerateResponse", "request_id"),
    ("GenerateResponse", "finish_reason"),
    ("GenerateResponse", "usage"),
    ("GenerateResponse", "timing"),
    ("StreamResponse", "request_id"),
}


def test_stats_and_model_info_fields_are_fields_of_the_typed_structs():
    """Stats and ModelInfo are copied field by field from ServerStats and ModelFacts (msgspec
    structs that cross the process boundary): a field renamed on either side fails here, instead of
    being sent as its zero."""
    assert {f.name for f in llm_pb2.StatsResponse.DESCRIPTOR.fields} <= set(ServerStats.__struct_fields__)
    front_end = {"has_chat_template"}  # the front-end's tokenizer knows it, not the core
    info = {f.name for f in llm_pb2.ModelInfoResponse.DESCRIPTOR.fields} - front_end
    assert info <= set(ModelFacts.__struct_fields__)
