"""Who may talk to the server: mutual TLS, the API key, reflection off, and the call limits,
on a real server (``secure_server``: certificates made for this session, key from
KVSERVE_API_KEY) and, for plain TLS without client certificates, an in-process grpc.aio
server with the same credentials code."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvserve.clients import Client, tls_credentials
from kvserve.clients.messages import build_request
from kvserve.service.guards.security import SecuritySettings, server_credentials
from kvserve.testing.plugin import SECURE_API_KEY, SECURE_LIMITS, TEST_SERVER_ENV
from kvserve.testing.process import ServerProcess
from kvserve.v1 import llm_pb2, llm_pb2_grpc

pytest_plugins = ["kvserve.testing.plugin"]


def mtls(tls_files, who: str = "client") -> grpc.ChannelCredentials:
    return tls_credentials(tls_files["ca"], tls_files[f"{who}_cert"], tls_files[f"{who}_key"])


def rpc_code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_mutual_tls_with_the_key_generates(secure_server):
    with Client(secure_server.target, **secure_server.client_options) as c:
        done = c.generate("The capital of France is", temperature=0, max_tokens=4)
        assert done.finish_reason == "LENGTH" and len(done.token_ids) == 4
        assert "".join(d.text for d in c.stream("Hello", temperature=0, max_tokens=3)) != ""
        assert c.stats()["num_running"] == 0


@pytest.mark.parametrize("api_key", [None, "wrong-key", SECURE_API_KEY + "x", ""])
def test_every_call_but_health_needs_the_key(secure_server, tls_files, api_key):
    with Client(secure_server.target, credentials=mtls(tls_files), api_key=api_key) as c:
        for call in (lambda: c.generate("Hi", max_tokens=1), lambda: list(c.stream("Hi", max_tokens=1)),
                     c.stats, lambda: next(c.watch_stats(1000))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in e.value.details()
        assert c.health() == "SERVING"  # probes need no key


def test_a_key_in_another_scheme_is_refused(secure_server, tls_files):
    with grpc.secure_channel(secure_server.target, mtls(tls_files)) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            basic = [("authorization", f"Basic {SECURE_API_KEY}")]
            stub.Stats(llm_pb2.StatsRequest(), metadata=basic, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in e.value.details()


def test_plaintext_and_certificate_less_clients_cannot_connect(secure_server, tls_files):
    def check(channel: grpc.Channel) -> grpc.StatusCode:
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return rpc_code(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=5))

    target = secure_server.target
    assert check(grpc.insecure_channel(target)) == grpc.StatusCode.UNAVAILABLE
    assert check(grpc.secure_channel(target, tls_credentials(tls_files["ca"]))) == grpc.StatusCode.UNAVAILABLE
    assert check(grpc.secure_channel(target, mtls(tls_files, "rogue"))) == grpc.StatusCode.UNAVAILABLE
    assert check(grpc.secure_channel(target, mtls(tls_files))) == grpc.StatusCode.OK


def test_reflection_can_be_turned_off(secure_server, tls_files):
    with grpc.secure_channel(secure_server.target, mtls(tls_files)) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        metadata = [("authorization", f"Bearer {SECURE_API_KEY}")]
        call = lambda: list(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10))
        code = rpc_code(call)
    assert code == grpc.StatusCode.UNIMPLEMENTED


def test_cli_connects_with_tls_and_the_key(secure_server, tls_files):
    base = [sys.executable, "-m", "kvserve", "stats", "--target", secure_server.target,
            "--tls-ca", tls_files["ca"], "--tls-cert", tls_files["client_cert"],
            "--tls-key", tls_files["client_key"]]
    ok = subprocess.run([*base, "--api-key", SECURE_API_KEY], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert '"kv_block_size": 16' in ok.stdout
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin"})
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def kvserve_health(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin"}  # no API key: health needs none
    return subprocess.run([sys.executable, "-m", "kvserve", "health", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_health_probe_follows_the_servers_tls(secure_server, tls_files):
    """`kvserve health` on the mutual-TLS port with the client's TLS flags, and in plaintext on the
    health port (``--service ""`` there is the Docker HEALTHCHECK's probe: tests/deploy/test_dockerfile.py);
    a plaintext probe of the TLS port fails with a one-line message."""
    tls = ["--tls-ca", tls_files["ca"], "--tls-cert", tls_files["client_cert"],
           "--tls-key", tls_files["client_key"]]
    for args in ([*tls, "--target", secure_server.target], ["--target", secure_server.health_target]):
        probe = kvserve_health(*args)
        assert (probe.returncode, probe.stdout) == (0, "SERVING\n"), (args, probe.stderr)
    plain = kvserve_health("--target", secure_server.target, "--timeout", "3")
    assert plain.returncode == 1 and plain.stderr.startswith("kvserve: UNAVAILABLE"), plain.stderr
    assert "Traceback" not in plain.stderr
    unknown = kvserve_health("--target", secure_server.health_target, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_health_port_answers_health_and_nothing_else(secure_server):
    with grpc.insecure_channel(secure_server.health_target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        reply = check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stats = llm_pb2_grpc.LLMServiceStub(channel).Stats
        assert rpc_code(lambda: stats(llm_pb2.StatsRequest(), timeout=10)) == grpc.StatusCode.UNIMPLEMENTED
        info = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        assert rpc_code(lambda: list(info(iter([request]), timeout=10))) == grpc.StatusCode.UNIMPLEMENTED


def test_watch_stats_and_connections_have_call_limits(secure_server):
    opts = secure_server.client_options
    with Client(secure_server.target, **opts) as a, Client(secure_server.target, **opts) as b:
        with pytest.raises(grpc.RpcError) as e:
            next(a.watch_stats(50))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "100" in e.value.details()
        watchers = [a.watch_stats(100) for _ in range(SECURE_LIMITS["max_watch_streams"])]
        for w in watchers:
            next(w)
        with pytest.raises(grpc.RpcError) as e:
            next(b.watch_stats(100))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-watch-streams" in e.value.details()
        # health Watch streams (open without the key) hold slots of their own (--max-open-streams):
        # none of the keyed calls'
        watches = [a._health.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
        for h in watches:
            next(h)
        assert rpc_code(a.stats) == grpc.StatusCode.OK
        holds = [a.stream(token_ids=[1, 2, 3 + i], max_tokens=2000, ignore_eos=True) for i in range(2)]
        for h in holds:
            next(h)
        with pytest.raises(grpc.RpcError) as e:  # a holds 4 keyed calls: its limit
            a.stats()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams-per-connection" in e.value.details()
        holds += [b.stream(token_ids=[4, 5, 6 + i], max_tokens=2000, ignore_eos=True) for i in range(2)]
        for h in holds[2:]:
            next(h)
        with Client(secure_server.target, **opts) as c, pytest.raises(grpc.RpcError) as e:
            c.stats()  # 6 keyed calls over all connections: the server's limit
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams " in e.value.details()
        assert a.health() == "SERVING"  # health checks are never refused
        for w in watchers + holds:
            w.close()  # the client cancels the call
        for h in watches:
            h.cancel()
        for _ in range(50):  # slots come back when the calls end
            if rpc_code(b.stats) == grpc.StatusCode.OK:
                break
            time.sleep(0.1)
        assert rpc_code(b.stats) == grpc.StatusCode.OK
        assert rpc_code(a.stats) == grpc.StatusCode.OK


def test_tls_without_client_certificates(tls_files):
    """Server-side TLS only: any client that trusts the CA connects, no certificate needed."""
    from grpc_health.v1.health import aio as health_aio

    async def run() -> str:
        settings = SecuritySettings(tls_cert=tls_files["server_cert"], tls_key=tls_files["server_key"])
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", server_credentials(settings))
        await server.start()
        try:
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", tls_credentials(tls_files["ca"])) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        finally:
            await server.stop(None)

    assert asyncio.run(run()) == "SERVING"


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"tls_cert": "c.pem"}, "--tls-key"),
        ({"tls_client_ca": "ca.pem"}, "--tls-client-ca"),
        ({"api_key": "  "}, "--api-key"),
    ],
)
def test_inconsistent_security_flags_are_refused(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SecuritySettings(**kwargs)


def test_unreadable_or_non_pem_files_name_the_flag(tmp_path, tls_files):
    with pytest.raises(ValueError, match="--tls-cert: cannot read"):
        missing = str(tmp_path / "none.pem")
        server_credentials(SecuritySettings(tls_cert=missing, tls_key=tls_files["server_key"]))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="--tls-key: .* is not a PEM file"):
        server_credentials(SecuritySettings(tls_cert=tls_files["server_cert"], tls_key=str(junk)))


def test_an_exposed_address_without_tls_or_key_is_warned_about(caplog):
    from kvserve.service.guards.security import warn_if_exposed

    with caplog.at_level("WARNING", logger="kvserve.service"):
        warn_if_exposed(SecuritySettings(), "127.0.0.1")
        assert caplog.records == []
        warn_if_exposed(SecuritySettings(api_key="k"), "0.0.0.0")
    assert [r.getMessage() for r in caplog.records] == [
        "listening on 0.0.0.0 without TLS: prompts, completions and the API key travel in clear text"
    ]


def test_client_strings_are_cut_and_escaped_for_logs():
    from kvserve.service.guards.redact import clip, for_log

    assert for_log("plain-id") == "plain-id"
    assert for_log("a\nb\x1b[31m\u2028") == "a\\nb\\x1b[31m\\u2028"
    assert for_log("x" * 100) == "x" * 64 + "...(100 chars)"
    assert clip("y" * 2000, 1024) == "y" * 1024 + "...(2000 chars)"


def test_kv_events_need_their_own_key_where_calls_need_one(tmp_path):
    """Issue 49: any API-key holder calling SubscribeKvEvents read every tenant's prompts block by
    block. With --api-key the events need --kv-events-key; without it nobody reads them."""
    import torch

    from kvserve.testing.random_model import write_random_model
    from kvserve.vllm import smg_common_pb2 as common
    from kvserve.vllm import vllm_engine_pb2_grpc

    model = str(write_random_model("qwen3-tiny", tmp_path / "m", dtype=torch.float32))
    key = (("authorization", "Bearer tenant-key"),)
    flags = ("--model", model, "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4",
             "--kv-events", "--api-key", "tenant-key", "--kv-events-key", "operator-key")
    with ServerProcess(*flags, env=TEST_SERVER_ENV) as server, grpc.insecure_channel(server.target) as ch:
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            next(vllm.SubscribeKvEvents(common.SubscribeKvEventsRequest(), metadata=key, timeout=30))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "x-kv-events-key" in e.value.details()
        events = vllm.SubscribeKvEvents(common.SubscribeKvEventsRequest(),
                                        metadata=(*key, ("x-kv-events-key", "operator-key")), timeout=60)
        llm_pb2_grpc.LLMServiceStub(ch).Generate(build_request(token_ids=[5, 6, 7, 8, 9, 10, 11, 12],
                                                               max_tokens=1), metadata=key, timeout=60)
        assert next(events).events  # the operator's subscriber sees the prompt's blocks
        events.cancel()
    only_api_key = SecuritySettings(api_key="tenant-key")
    assert "--kv-events-key" in only_api_key.kv_events_refusal(key)
    assert SecuritySettings().kv_events_refusal(()) is None  # an open server is open
