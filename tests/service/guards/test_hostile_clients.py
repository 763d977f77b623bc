"""What a hostile or careless client can send, against the shared server: malformed bytes,
huge and multi-line request ids, a huge chat role, and property-based fuzzing (hypothesis)
of GenerateRequest fields and of raw request bytes. The server must answer each call with a
clear status (never INTERNAL or UNKNOWN), never hang, never crash, and end with every KV
block free."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.clients import Client
from kvserve.testing.plugin import wait_until_idle
from kvserve.v1 import llm_pb2

pytest_plugins = ["kvserve.testing.plugin"]

METHODS = {  # method -> whether it streams its response
    "/kvserve.v1.LLMService/Generate": False,
    "/kvserve.v1.LLMService/Stream": True,
    "/kvserve.v1.LLMService/Stats": False,
    "/kvserve.v1.LLMService/WatchStats": True,
}
CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
CALL_TIMEOUT_S = 60.0  # far above any request the strategies allow: running into it is a hang
FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def channel(kvserve_server):
    with grpc.insecure_channel(kvserve_server.target) as ch:
        yield ch


def call_raw(channel: grpc.Channel, method: str, data: bytes) -> grpc.StatusCode:
    """Send ``data`` as the request of ``method``; the status it ends with (a stream is read
    for at most one message: WatchStats never ends by itself)."""
    try:
        if METHODS[method]:
            call = channel.unary_stream(method)(data, timeout=CALL_TIMEOUT_S)
            for _ in call:
                if method.endswith("WatchStats"):
                    call.cancel()
                    return grpc.StatusCode.OK
        else:
            channel.unary_unary(method)(data, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and method.endswith("WatchStats"):
            return grpc.StatusCode.OK
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", list(METHODS))
def test_malformed_bytes_are_invalid_argument(channel, method):
    with pytest.raises(grpc.RpcError) as e:
        call = channel.unary_stream(method) if METHODS[method] else channel.unary_unary(method)
        result = call(b"\xff\xff\xff\xff\x0f garbage", timeout=30)
        if METHODS[method]:
            list(result)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("request: not a valid message")


def test_a_huge_chat_role_is_invalid_argument_with_a_short_message(kvserve_server):
    with Client(kvserve_server.target) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(messages=[{"role": "x" * 100_000, "content": "hi"}], max_tokens=1, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "role" in e.value.details() and len(e.value.details()) < 1200


def test_client_strings_are_cut_and_escaped_in_the_log(kvserve_server):
    forged = "evil\n2026-01-01 00:00:00 INFO kvserve.service: request admin finished"
    with Client(kvserve_server.target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("hi", request_id="r" * 1_000_000, max_tokens=1, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 200
        c.generate("hi", request_id=forged, max_tokens=1, timeout=60)
    log = kvserve_server.log_text()
    assert "r" * 65 not in log and "(1000000 chars)" in log
    assert "evil\\n2026-01-01" in log
    assert not any(line.startswith("2026-01-01 00:00:00") for line in log.splitlines())


# Appended to fuzzed bytes: protobuf merges concatenated messages, so bytes that parse as a
# request still parse, now with a small max_tokens (unset means up to max_model_len: minutes).
SHORT = llm_pb2.GenerateRequest(sampling=llm_pb2.SamplingParams(max_tokens=2)).SerializeToString()


@FUZZ
@given(data=st.binary(max_size=256), method=st.sampled_from(list(METHODS)))
def test_random_bytes_get_a_clear_status(channel, data, method):
    code = call_raw(channel, method, data + SHORT if "Generate" in method or "Stream" in method else data)
    assert code in CLEAR, (code, data)


# no subnormals: the engine flushes denormals in this process (model_runner), which hypothesis refuses
_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
                    st.floats(-3, 3, allow_subnormal=False))
_small_or_huge = st.one_of(st.integers(0, 4), st.integers(2**20, 2**32 - 1))
# max_tokens always set (small, or so huge it is refused): unset means up to max_model_len
_max_tokens = st.integers(0, 3) | st.integers(2**20, 2**32 - 1)
_sampling = st.fixed_dictionaries({"max_tokens": _max_tokens}, optional={
    "temperature": _floats, "top_p": _floats, "min_p": _floats, "repetition_penalty": _floats,
    "presence_penalty": _floats, "frequency_penalty": _floats,
    "top_k": st.integers(-(2**31), 2**31 - 1), "seed": st.integers(0, 2**64 - 1),
    "min_tokens": _small_or_huge,
    "logprobs": _small_or_huge, "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
    "stop": st.lists(st.text(max_size=300), max_size=20),
    "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=70),
})
_messages = st.lists(
    st.builds(llm_pb2.ChatMessage, content=st.text(max_size=100),
              role=st.sampled_from(["user", "system", "assistant", ""]) | st.text(max_size=20)),
    max_size=4,
)
_requests = st.builds(
    lambda rid, which, prompt, ids, msgs, sampling: _request(rid, which, prompt, ids, msgs, sampling),
    st.text(max_size=300), st.sampled_from(["prompt", "token_ids", "messages", None]), st.text(max_size=100),
    st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 49151), max_size=16), _messages, _sampling,
)


def _request(rid, which, prompt, ids, msgs, sampling) -> llm_pb2.GenerateRequest:
    req = llm_pb2.GenerateRequest(request_id=rid, sampling=llm_pb2.SamplingParams(**sampling))
    if which == "prompt":
        req.prompt = prompt
    elif which == "token_ids":
        req.token_ids.ids.extend(ids)
    elif which == "messages":
        req.messages.messages.extend(msgs)
    return req


@settings(FUZZ, max_examples=25)  # a valid request runs the model: keep them few and short
@given(request=_requests, stream=st.booleans())
def test_any_generate_request_gets_a_clear_status(channel, request, stream):
    method = "/kvserve.v1.LLMService/Stream" if stream else "/kvserve.v1.LLMService/Generate"
    code = call_raw(channel, method, request.SerializeToString())
    assert code in CLEAR, (code, request)


def test_after_the_fuzzing_every_block_is_free(kvserve_server):
    with Client(kvserve_server.target) as c:
        stats = wait_until_idle(c)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    with Client(kvserve_server.target) as c:
        assert c.health() == "SERVING"
