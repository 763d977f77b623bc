"""Service and client pieces that need no model: channel options, CLI flags, request
conversion and validation messages, status mapping."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import pathlib

import grpc
import grpc._cython.cygrpc as cygrpc
import pytest
import zmq

from kvserve.cli import build_parser
from kvserve.clients.commands import sampling_kwargs
from kvserve.clients.messages import CHANNEL_OPTIONS, build_request, sampling_params
from kvserve.engine.config import EngineConfig
from kvserve.engine.frontend.async_engine import EngineOverloaded, EngineUnavailable
from kvserve.service.api.errors import status_for
from kvserve.service.api.validation import parse_generate_request
from kvserve.service.cli import engine_config, mesh_settings
from kvserve.service.guards.limits import ConnectionLimits
from kvserve.service.server import (
    SERVER_OPTIONS,
    KvEventSettings,
    ServeSettings,
    kv_event_hub,
    on_host,
    server_options,
)
from kvserve.v1 import llm_pb2

VOCAB = 49152


def _core_strings() -> bytes:
    return pathlib.Path(cygrpc.__file__).read_bytes()


AGED = server_options(ServeSettings(max_connection_age=2.5))


@pytest.mark.parametrize(
    "key", sorted({k for k, _ in AGED + CHANNEL_OPTIONS + ConnectionLimits().server_options()}))
def test_channel_option_keys_are_ones_grpc_core_reads(key):
    # The compiled core holds every channel-argument name it reads as a C string.
    assert key.encode() + b"\0" in _core_strings(), f"{key} is not a gRPC core channel argument"


def test_max_connection_age_sets_the_age_and_an_equal_grace_in_ms():
    assert server_options(ServeSettings()) == SERVER_OPTIONS + ConnectionLimits().server_options()
    assert AGED[-2:] == [("grpc.max_connection_age_ms", 2500), ("grpc.max_connection_age_grace_ms", 2500)]


@pytest.mark.parametrize(("flags", "named"), [
    (["--max-connection-age", "0"], "--max-connection-age"),
    (["--kv-events-endpoint", "5557"], "--kv-events-endpoint"),
    (["--kv-events-replay-endpoint", "localhost:5558"], "--kv-events-replay-endpoint"),
])
def test_bad_mesh_flags_are_refused_by_name(flags, named):
    with pytest.raises(ValueError, match=named):
        mesh_settings(build_parser().parse_args(["serve", *flags]))


def test_mesh_flags_become_serve_settings():
    args = build_parser().parse_args(["serve", "--max-connection-age", "30", "--kv-events-endpoint", "tcp://*:5557"])
    settings = mesh_settings(args)
    assert settings["max_connection_age"] == 30 and settings["kv_events"].on
    assert settings["kv_events"].endpoint == "tcp://*:5557" and settings["kv_events"].topic is None
    assert not mesh_settings(build_parser().parse_args(["serve"]))["kv_events"].on


def test_the_misspelled_ping_key_would_be_caught():
    assert b"grpc.http2.min_recv_ping_interval_without_data_ms\0" not in _core_strings()


def test_serve_has_a_flag_for_every_engine_config_field():
    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert engine_config(args) == EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        assert hasattr(args, f.name)
    args = parser.parse_args(
        ["serve", "--tp", "2", "--max-num-seqs", "3", "--no-enable-prefix-caching", "--enforce-eager",
         "--kv-cache-memory", "0.25", "--num-kv-blocks", "40", "--dtype", "float32", "--max-queue", "5"]
    )
    cfg = engine_config(args)
    assert (cfg.tensor_parallel_size, cfg.max_num_seqs, cfg.num_kv_blocks) == (2, 3, 40)
    assert cfg.enable_prefix_caching is False and cfg.enforce_eager is True
    assert cfg.kv_cache_memory == 0.25 and cfg.dtype == "float32"
    assert (args.host, args.port, args.max_queue) == ("127.0.0.1", 50051, 5)


def test_serve_rejects_a_bad_choice():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "float64"])


def test_sampling_flags_cover_every_proto_field_and_unset_stays_unset():
    parser = build_parser()
    args = parser.parse_args(["generate", "hi"])
    assert sampling_kwargs(args) == {}
    args = parser.parse_args(
        ["generate", "hi", "--temperature", "0", "--max-tokens", "7", "--stop", "a", "--stop", "b",
         "--stop-token-ids", "5", "--no-skip-special-tokens", "--logprobs", "2", "--seed", "3"]
    )
    kw = sampling_kwargs(args)
    assert kw == {"temperature": 0.0, "max_tokens": 7, "stop": ["a", "b"], "stop_token_ids": [5],
                  "skip_special_tokens": False, "logprobs": 2, "seed": 3}
    msg = sampling_params(**kw)
    assert msg.HasField("temperature") and msg.temperature == 0.0
    assert not msg.HasField("top_p")
    for f in llm_pb2.SamplingParams.DESCRIPTOR.fields:
        flag = "--" + f.name.replace("_", "-")
        assert flag in parser._subparsers._group_actions[0].choices["generate"].format_help()


def test_build_request_takes_exactly_one_input_and_known_options():
    req = build_request(messages=[("user", "hi")], max_tokens=3)
    assert req.WhichOneof("input") == "messages" and req.messages.messages[0].role == "user"
    assert build_request(token_ids=[1, 2]).token_ids.ids == [1, 2]
    with pytest.raises(TypeError, match="exactly one"):
        build_request("a", token_ids=[1])
    with pytest.raises(TypeError, match="exactly one"):
        build_request()
    with pytest.raises(TypeError, match="max_new_tokens"):
        build_request("a", max_new_tokens=3)


def _req(**sampling) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(prompt="hello", sampling=llm_pb2.SamplingParams(**sampling))


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (llm_pb2.GenerateRequest(), "input"),
        (llm_pb2.GenerateRequest(prompt=""), "prompt"),
        (llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds()), "token_ids"),
        (llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds(ids=[1, VOCAB])), "token_ids"),
        (llm_pb2.GenerateRequest(messages=llm_pb2.ChatMessages()), "messages"),
        (_req(temperature=math.nan), "temperature"),
        (_req(temperature=math.inf), "temperature"),
        (_req(temperature=-0.5), "temperature"),
        (_req(top_p=0.0), "top_p"),
        (_req(top_p=1.01), "top_p"),
        (_req(top_k=-1), "top_k"),
        (_req(min_p=1.5), "min_p"),
        (_req(max_tokens=0), "max_tokens"),
        (_req(max_tokens=4, min_tokens=5), "min_tokens"),
        (_req(stop=["x"] * 17), "stop"),
        (_req(stop=["x" * 257]), "stop"),
        (_req(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (_req(logprobs=21), "logprobs"),
        (_req(repetition_penalty=0.0), "repetition_penalty"),
        (_req(repetition_penalty=1e-38), "repetition_penalty"),
        (_req(repetition_penalty=1e38), "repetition_penalty"),
        (_req(temperature=1e300), "temperature"),
        (_req(presence_penalty=3.0), "presence_penalty"),
        (llm_pb2.GenerateRequest(prompt="a", request_id="r" * 300), "request_id"),
    ],
)
def test_validation_errors_name_the_field(request_, field):
    with pytest.raises(ValueError, match=field):
        parse_generate_request(request_, VOCAB)


def test_a_valid_request_converts_field_by_field():
    req = llm_pb2.GenerateRequest(
        request_id="r1",
        token_ids=llm_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=llm_pb2.SamplingParams(temperature=0.0, max_tokens=9, stop=["\n"], ignore_eos=True, seed=7),
    )
    out = parse_generate_request(req, VOCAB)
    assert out.request_id == "r1" and out.prompt == [1, 2, 3] and out.messages is None
    p = out.params
    got = (p.temperature, p.max_tokens, p.stop, p.ignore_eos, p.seed, p.top_p)
    assert got == (0.0, 9, ["\n"], True, 7, 1.0)
    assert parse_generate_request(llm_pb2.GenerateRequest(prompt="x"), VOCAB).request_id  # server-made


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ValueError("top_p must be in (0, 1]"), grpc.StatusCode.INVALID_ARGUMENT),
        (EngineOverloaded("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (EngineUnavailable("draining"), grpc.StatusCode.UNAVAILABLE),
        (KeyError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_errors_map_to_the_contract_status_codes(error, code):
    assert status_for(error)[0] == code


def test_a_port_in_use_is_an_error_not_a_shared_socket():
    from kvserve.service.server import bind

    async def run():
        first, second = grpc.aio.server(options=SERVER_OPTIONS), grpc.aio.server(options=SERVER_OPTIONS)
        port = bind(first, "127.0.0.1", 0)
        await first.start()
        try:
            with pytest.raises(OSError, match="cannot listen"):
                bind(second, "127.0.0.1", port)
        finally:
            await first.stop(None)

    asyncio.run(run())


def test_unset_sampling_fields_take_the_models_recommendation(tmp_path):
    from kvserve.engine.model_loader.generation_defaults import sampling_defaults
    from kvserve.service.api.validation import sampling_from_proto

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "max_length": 20, "top_k": None})
    )
    assert sampling_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95}
    assert sampling_defaults("default") == {"temperature": 0.2, "top_p": 0.9}
    defaults = sampling_defaults("default")
    p = sampling_from_proto(llm_pb2.SamplingParams(max_tokens=5), defaults)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.2, 0.9, 5)
    p = sampling_from_proto(llm_pb2.SamplingParams(temperature=1.0), defaults)  # set wins, even 1.0
    assert (p.temperature, p.top_p) == (1.0, 0.9)


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"max_connections": 0}, "--max-connections"),
    ({"handshake_timeout": 0.0}, "--handshake-timeout"),
])
def test_connection_limits_refuse_values_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ConnectionLimits(**kwargs)


def test_connection_limits_become_core_options_in_milliseconds():
    assert dict(ConnectionLimits(100, 2.5).server_options()) == {
        "grpc.max_allowed_incoming_connections": 100, "grpc.server_handshake_timeout_ms": 2500}


def test_a_token_id_prompt_is_refused_by_its_length_before_its_ids_are_read():
    req = llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds(ids=[10**6] * 300))  # ids out of range too
    with pytest.raises(ValueError, match=r"token_ids.ids: 300 ids leave no room .* max_model_len \(256"):
        parse_generate_request(req, VOCAB, max_model_len=256)
    turns = [llm_pb2.ChatMessage(role="user")] * 257
    chat = llm_pb2.GenerateRequest(messages=llm_pb2.ChatMessages(messages=turns))
    with pytest.raises(ValueError, match=r"messages.messages: 257 messages cannot fit max_model_len \(256"):
        parse_generate_request(chat, VOCAB, max_model_len=256)


def test_kv_event_sockets_given_as_star_bind_the_grpc_host():
    """Issue 49: ``tcp://*`` (the form the help suggests) bound 0.0.0.0 while gRPC listened on
    127.0.0.1, and the events carry every tenant's prompt token ids."""
    async def bound(host: str, endpoint: str) -> str:
        hub = kv_event_hub(EngineConfig(block_size=16), KvEventSettings(endpoint=endpoint), host)
        try:
            return hub._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        finally:
            hub.close()

    assert asyncio.run(bound("127.0.0.1", "tcp://*:0")).startswith("tcp://127.0.0.1:")
    assert asyncio.run(bound("127.0.0.1", "tcp://0.0.0.0:0")).startswith("tcp://0.0.0.0:")  # as named
    assert on_host("tcp://*:5557", "::1") == "tcp://[::1]:5557"
    assert on_host("ipc:///tmp/kv", "127.0.0.1") == "ipc:///tmp/kv"
