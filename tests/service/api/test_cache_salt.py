"""Prefix-cache isolation: ``cache_salt`` and ``--cache-salt-from``.

Issue 29's side channel: another caller's ``usage.cached_tokens`` was 32 for a right guess of a
PIN inside a prompt and 16 for every wrong one. Requests share cached blocks only when their
salt is the same: the request's own ``cache_salt``, and with ``--cache-salt-from header`` the
tenant header the server puts in front of it (``--cache-salt-from api-key``: the bearer
credential); the server salts vLLM's engine protocol (``VllmEngine/Generate``) the same way. A
server on a tiny random-weight model, prompts as token ids.
"""

from __future__ import annotations

import random

import grpc
import pytest

from kvserve.clients.messages import build_request
from kvserve.service.api.validation import CacheSalting
from kvserve.testing.plugin import TEST_SERVER_ENV
from kvserve.testing.process import ServerProcess
from kvserve.v1 import llm_pb2_grpc
from kvserve.vllm import vllm_engine_pb2 as vllm_pb
from kvserve.vllm import vllm_engine_pb2_grpc

HEADER = "x-team"


@pytest.fixture(scope="module")
def channel(tmp_path_factory):
    import torch

    from kvserve.testing.random_model import write_random_model

    model = str(write_random_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"), dtype=torch.float32))
    flags = ("--model", model, "--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "16",
             "--cache-salt-from", "header", "--cache-salt-header", HEADER)
    with ServerProcess(*flags, env=TEST_SERVER_ENV) as server, grpc.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return llm_pb2_grpc.LLMServiceStub(channel)


@pytest.fixture(scope="module")
def vllm(channel):
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


def cached(stub, ids: list[int], team: str | None = None, salt: str | None = None) -> int:
    metadata = ((HEADER, team),) if team is not None else None
    request = build_request(token_ids=ids, max_tokens=1, cache_salt=salt)
    reply = stub.Generate(request, metadata=metadata, timeout=60)
    return reply.usage.cached_tokens


def vllm_cached(vllm, ids: list[int], team: str | None = None) -> int:
    metadata = ((HEADER, team),) if team is not None else None
    request = vllm_pb.GenerateRequest(tokenized=vllm_pb.TokenizedInput(input_ids=ids),
                                      sampling_params=vllm_pb.SamplingParams(temperature=0.0, max_tokens=1))
    (reply,) = vllm.Generate(request, metadata=metadata, timeout=60)
    return reply.complete.cached_tokens


def pin_prompts(seed: int) -> tuple[list[int], list[int], list[int]]:
    """A secret prompt (28 ids, a 4-id PIN, 8 more), a right guess and a wrong one (other tails)."""
    rng = random.Random(seed)
    base, pin, tail = ([rng.randint(10, 9000) for _ in range(n)] for n in (28, 4, 8))
    other_tail = [rng.randint(10, 9000) for _ in range(8)]
    wrong = [p + 1 for p in pin]
    return base + pin + tail, base + pin + other_tail, base + wrong + other_tail


def test_without_isolation_a_right_guess_shows_in_cached_tokens(stub):
    """The side channel itself, between two callers without the tenant header (one shared salt)."""
    secret, right, wrong = pin_prompts(1)
    cached(stub, secret)
    assert cached(stub, right) == 32 and cached(stub, wrong) == 16


def test_tenant_header_isolates_the_prefix_cache(stub):
    secret, right, wrong = pin_prompts(2)
    cached(stub, secret, team="alice")
    # each guess as a fresh tenant (a tenant's own guesses share with one another)
    assert cached(stub, right, team="mallory-1") == 0 and cached(stub, wrong, team="mallory-2") == 0
    assert cached(stub, right) == 0  # no header: not alice's cache either
    assert cached(stub, right, team="alice") == 32  # alice's own requests still share


def test_request_salt_shares_only_with_the_same_salt(stub):
    secret, right, _ = pin_prompts(3)
    cached(stub, secret, team="bob", salt="s1")
    assert cached(stub, right, team="bob", salt="s1") == 32
    assert cached(stub, right, team="bob", salt="s2") == 0
    assert cached(stub, right, team="bob") == 0
    assert cached(stub, right, team="carol", salt="s1") == 0  # a salt does not reach another tenant


def test_tenant_header_isolates_the_prefix_cache_of_vllm_generate(vllm, stub):
    """The gateways' API (vllm.grpc.engine) is salted as kvserve.v1 is: no other tenant's blocks."""
    secret, right, _ = pin_prompts(4)
    vllm_cached(vllm, secret, team="dave")
    assert vllm_cached(vllm, right, team="erin") == 0
    assert vllm_cached(vllm, right) == 0
    assert vllm_cached(vllm, right, team="dave") == 32
    assert cached(stub, right, team="dave") == 32  # one tenant, one salt, whichever API


def test_an_overlong_salt_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as err:
        cached(stub, [1, 2, 3], salt="x" * 257)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt: at most 256 characters" in err.value.details()


def test_cache_salting_derives_from_the_bearer_credential_or_the_header():
    by_key = CacheSalting("api-key")
    a = by_key.salt((("authorization", "Bearer key-a"),), None)
    assert a == by_key.salt((("authorization", "bearer key-a"),), None)
    assert a != by_key.salt((("authorization", "Bearer key-b"),), None)
    assert "key-a" not in a  # hashed: the engine never holds the key
    assert by_key.salt((), "own") != by_key.salt((), None) != CacheSalting().salt((), None)
    assert CacheSalting().salt((("authorization", "Bearer k"),), "own") == "own"
    by_header = CacheSalting("header", "x-tenant")
    assert by_header.salt((("x-tenant", b"t1"),), None) == by_header.salt((("x-tenant", "t1"),), None)
    for source, header in (("tenant", "x-t"), ("header", "X-Tenant"), ("header", "")):
        with pytest.raises(ValueError, match="--cache-salt"):
            CacheSalting(source, header)


def test_abort_reaches_only_the_callers_own_tenant(vllm):
    """Issue 49: Abort looked request ids up server-wide, so whoever knew or guessed another
    client's id ended its request. Under --cache-salt-from the tenant scopes the ids."""
    def stream(team: str):
        request = vllm_pb.GenerateRequest(
            request_id="shared-id", tokenized=vllm_pb.TokenizedInput(input_ids=[5, 6, 7]), stream=True,
            sampling_params=vllm_pb.SamplingParams(temperature=0, ignore_eos=True, max_tokens=400))
        return vllm.Generate(request, metadata=((HEADER, team),), timeout=120)

    theirs = stream("alpha")
    assert next(theirs).HasField("chunk")
    vllm.Abort(vllm_pb.AbortRequest(request_ids=["shared-id"]), metadata=((HEADER, "beta"),))
    assert [m.complete.finish_reason for m in theirs if m.HasField("complete")] == ["length"]
    ours = stream("beta")
    assert next(ours).HasField("chunk")
    vllm.Abort(vllm_pb.AbortRequest(request_ids=["shared-id"]), metadata=((HEADER, "beta"),))
    assert [m.complete.finish_reason for m in ours if m.HasField("complete")] == ["abort"]
