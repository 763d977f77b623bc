"""Tenants from outside (issue 49): a real server on a tiny random-weight model, tenants by the
``--cache-salt-from header`` identity, real gRPC clients. A tenant flooding the engine with n=16
streams it never reads cannot starve another tenant's short request; ``priority`` orders a
tenant's own work and preempts its lower-priority streams; ``--max-queued-per-tenant`` refuses with
RESOURCE_EXHAUSTED naming the limit; a request that cannot start, or cannot finish, before its
deadline is refused at once with DEADLINE_EXCEEDED. Everything is asserted by order and counts,
never by elapsed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvserve.clients.messages import build_request
from kvserve.engine.tenancy.accounts import tenant_label
from kvserve.service.api.validation import CacheSalting
from kvserve.testing.plugin import TEST_SERVER_ENV
from kvserve.testing.process import ServerProcess
from kvserve.v1 import llm_pb2, llm_pb2_grpc

HEADER = "x-team"
SEQS = 16
QUEUED = 3
PROMPT = list(range(100, 228))  # 128 ids
# tokens a flood choice may make: it outlives every test below, and the work it leaves ahead of a
# request (tens of seconds at any step time this model can reach) dwarfs the deadlines below
LONG = 30000
SHORT = {"max_tokens": 8, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import torch

    from kvserve.testing.random_model import make_config, write_model_dir

    config = make_config("qwen3-tiny")
    config.max_position_embeddings = 32768  # room for LONG
    model = str(write_model_dir(config, tmp_path_factory.mktemp("qwen3-tiny"), dtype=torch.float32))
    flags = ("--model", model, "--dtype", "float32", "--max-model-len", "32768", "--num-kv-blocks", "4096",
             "--block-size", "16", "--max-num-seqs", str(SEQS), "--max-queued-per-tenant", str(QUEUED),
             "--cache-salt-from", "header", "--cache-salt-header", HEADER, "--metrics-port", "0")
    with ServerProcess(*flags, env=TEST_SERVER_ENV) as server:
        yield server


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as ch:
        yield llm_pb2_grpc.LLMServiceStub(ch)


def team(name: str | None):
    """The call's tenant header (None: no header, the tenant of the callers that send none)."""
    return () if name is None else ((HEADER, name),)


def stats(stub) -> llm_pb2.StatsResponse:
    return stub.Stats(llm_pb2.StatsRequest(), timeout=30)


def wait_for(stub, ok, what: str):
    """Poll Stats until ``ok(stats)``; a generous bound only so that a broken server fails the test."""
    for _ in range(1200):
        s = stats(stub)
        if ok(s):
            return s
        time.sleep(0.1)
    raise AssertionError(f"never reached: {what} (last: running {s.num_running}, waiting {s.num_waiting})")


@contextlib.contextmanager
def flood(stub, name: str | None, n: int = SEQS, priority: int = 0, settle: bool = True):
    """A Stream call with ``n`` long choices that nobody reads; cancelled on exit, then (``settle``)
    waited for until the engine is idle: floods entered later exit first, so only the first waits."""
    request = build_request(token_ids=PROMPT, max_tokens=LONG, ignore_eos=True, n=n, temperature=1.0)
    request.priority = priority
    call = stub.Stream(request, metadata=team(name))  # no deadline: cancelled on exit
    try:
        yield call
    finally:
        call.cancel()
        if settle:
            wait_for(stub, lambda s: s.num_running == 0 and s.num_waiting == 0, "the flood cancelled")


def short(stub, name: str, priority: int = 0, timeout: float = 300, tokens: int = 8):
    request = build_request(token_ids=[7, 8, 9, 10], max_tokens=tokens, ignore_eos=True, temperature=0.0)
    request.priority = priority
    return stub.Generate(request, metadata=team(name), timeout=timeout)


def test_a_flood_of_never_read_streams_cannot_starve_another_tenant(stub):
    before = stats(stub)
    with flood(stub, "flood"):
        wait_for(stub, lambda s: s.num_running == SEQS, "the flood fills every slot")
        reply = short(stub, "interactive")
        after = stats(stub)
    assert reply.finish_reason == llm_pb2.LENGTH and len(reply.token_ids) == 8
    # it finished while the flood still ran: a flood choice gave its slot, none of them ended
    assert after.requests_finished == before.requests_finished + 1
    assert after.num_running >= SEQS - 1 and after.num_preemptions > before.num_preemptions


def test_priority_orders_a_tenants_work_and_preempts_its_lower_priority_streams(stub):
    finished = []

    def generate(priority):
        # a deadline beyond the flood's whole run: the low-priority request waits for the streams to
        # end, and deadline admission would refuse it if it could not start in time
        reply = short(stub, "prio", priority=priority, timeout=3600)
        finished.append(priority)
        return reply

    with ThreadPoolExecutor(2) as pool:
        with flood(stub, "prio", priority=0):
            wait_for(stub, lambda s: s.num_running == SEQS, "the tenant's streams fill every slot")
            low = pool.submit(generate, 10)  # below the running streams: waits behind them
            wait_for(stub, lambda s: s.num_waiting >= 1, "the low-priority request waits")
            high = pool.submit(generate, -5)  # above them: one of them gives way
            assert high.result().finish_reason == llm_pb2.LENGTH
            assert not low.done()
        assert low.result().finish_reason == llm_pb2.LENGTH  # once the streams are gone
    assert finished == [-5, 10]


def test_a_tenants_queue_cap_refuses_with_resource_exhausted_naming_the_limit(stub):
    with contextlib.ExitStack() as stack:
        stack.enter_context(flood(stub, "busy"))
        wait_for(stub, lambda s: s.num_running == SEQS, "the tenant's streams fill every slot")
        for _ in range(QUEUED):
            stack.enter_context(flood(stub, "busy", n=1, settle=False))
        wait_for(stub, lambda s: s.num_waiting == QUEUED, "the tenant's requests wait")
        with pytest.raises(grpc.RpcError) as refused:
            short(stub, "busy")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-queued-per-tenant {QUEUED}" in refused.value.details()
        assert short(stub, "other").finish_reason == llm_pb2.LENGTH  # another tenant's queue is its own


def test_a_request_that_cannot_start_before_its_deadline_is_refused_at_once(stub):
    with flood(stub, "late"):
        wait_for(stub, lambda s: s.num_running == SEQS, "the tenant's streams fill every slot")
        with pytest.raises(grpc.RpcError) as refused:
            short(stub, "late", timeout=3.0)
    # the server's refusal (its message), not the client's own expiry ("Deadline Exceeded")
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot start before its deadline" in refused.value.details()


def test_a_request_that_could_start_but_not_finish_before_its_deadline_is_refused_at_once(stub):
    with flood(stub, "bulk"):
        wait_for(stub, lambda s: s.num_running == SEQS, "the flood fills every slot")
        # another tenant's request starts at once (a flood choice gives way), but 30,000 tokens in 16-row
        # steps take far longer than a second: refused before it runs, not left to expire
        with pytest.raises(grpc.RpcError) as refused:
            short(stub, "hasty", timeout=1.0, tokens=LONG)
        assert short(stub, "hasty").finish_reason == llm_pb2.LENGTH  # one that can finish runs
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot finish before its deadline" in refused.value.details()


def test_the_server_names_weighted_tenants_by_the_identity_that_salts_their_cache():
    salting = CacheSalting("header", "x-team")
    (entry,) = salting.tenant_weights("red=3").split(",")
    assert entry == f"{salting.tenant([('x-team', 'red')])}=3.0"
    with pytest.raises(ValueError, match="--tenant-weights .*--cache-salt-from"):
        CacheSalting().tenant_weights("red=3")
    assert CacheSalting().tenant_weights(None) is None


def test_the_clients_and_the_cli_send_priority_that_preempts_the_callers_own_streams(server, stub):
    """``Client``/``AsyncClient`` ``priority=`` and ``kvserve generate --priority`` set
    GenerateRequest.priority: above the caller's own running streams, each request takes a slot at
    once while the streams still run (at priority 0 it would wait for them to end)."""
    from kvserve.clients import AsyncClient, Client

    async def via_async_client():
        async with AsyncClient(server.target) as c:
            return [d async for d in c.stream(token_ids=[7, 8, 9, 10], priority=-5, timeout=300, **SHORT)]

    with flood(stub, None) as streams, Client(server.target) as client:
        wait_for(stub, lambda s: s.num_running == SEQS, "the caller's streams fill every slot")
        before = stats(stub)
        done = client.generate(token_ids=[7, 8, 9, 10], priority=-5, timeout=300, **SHORT)
        deltas = list(client.stream(token_ids=[7, 8, 9, 10], priority=-5, timeout=300, **SHORT))
        deltas += asyncio.run(via_async_client())
        cli = subprocess.run([sys.executable, "-m", "kvserve", "generate", "hi", "--target", server.target,
                              "--priority", "-5", "--max-tokens", "8", "--ignore-eos", "--temperature", "0"],
                             capture_output=True, text=True, timeout=300)
        after = stats(stub)
        assert streams.running()
    assert done.finish_reason == "LENGTH" and len(done.token_ids) == 8
    assert [d.finish_reason for d in deltas if d.finished] == ["LENGTH", "LENGTH"]
    assert cli.returncode == 0, cli.stderr
    assert after.requests_finished == before.requests_finished + 4  # the four, none of the streams
    # a stream gave way (a request may also take the slot its predecessor left before the stream is back)
    assert after.num_preemptions > before.num_preemptions


def test_a_priority_outside_int32_is_refused_naming_the_field_before_any_call():
    with pytest.raises(ValueError, match=r"priority: must be in \[-2147483648, 2147483647\].*got 2147483648"):
        build_request("hi", priority=2**31)
    with pytest.raises(TypeError, match="priority: an integer, got float"):
        build_request("hi", priority=1.5)
    cli = subprocess.run([sys.executable, "-m", "kvserve", "generate", "hi", "--priority", "-2147483649"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "argument --priority: must be in [-2147483648, 2147483647]" in cli.stderr


def test_metrics_show_each_tenants_series_under_its_hashed_label_never_its_header(server, stub):
    """Two tenants' generated tokens; a flooding tenant's running sequences and its deadline refusal."""
    for name in ("metrics-red", "metrics-blue"):
        assert short(stub, name).finish_reason == llm_pb2.LENGTH
    with flood(stub, "metrics-late"):
        wait_for(stub, lambda s: s.num_running == SEQS, "the tenant's streams fill every slot")
        for _ in range(20):  # until the step time model has seen enough steps to refuse it at once,
            with pytest.raises(grpc.RpcError) as refused:  # a try may run into the client's own expiry
                short(stub, "metrics-late", timeout=3.0)
            assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if "(step time model)" in (refused.value.details() or ""):
                break
        else:
            raise AssertionError("the server never refused the request by its step time model")
        text = scrape_metrics(server)
    label = {name: tenant_label(CacheSalting("header", HEADER).identity(name))
             for name in ("metrics-red", "metrics-blue", "metrics-late")}
    assert sample(text, "kvserve:tenant_generation_tokens_total", tenant=label["metrics-red"]) >= 8
    assert sample(text, "kvserve:tenant_generation_tokens_total", tenant=label["metrics-blue"]) >= 8
    assert sample(text, "kvserve:tenant_num_sequences_running", tenant=label["metrics-late"]) == SEQS
    assert sample(text, "kvserve:tenant_requests_refused_total", tenant=label["metrics-late"],
                  reason="deadline") == 1
    assert "metrics-red" not in text and "metrics-blue" not in text and "metrics-late" not in text


def scrape_metrics(server) -> str:
    import urllib.request

    (line,) = [ln for ln in server.log_text().splitlines() if ln.startswith("kvserve: metrics on ")]
    with urllib.request.urlopen(line.removeprefix("kvserve: metrics on "), timeout=30) as r:
        return r.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    (value,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and labels.items() <= s.labels.items()]
    return value
