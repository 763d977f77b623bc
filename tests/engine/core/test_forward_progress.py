"""Forward progress under a tight KV cache with n > 1: every request finishes and every block is free.

The other choices of an n > 1 request wait holding references on the prompt's blocks; a cache
too small for all of them at once must still run every request to its end. Three levels: the
scheduler alone with random workloads (many seeded cases in a few seconds), the engine on a
tiny random-weight model, and a real server with issue 29's recipe (``--num-kv-blocks 8
--max-num-seqs 2``), which used to wedge with running 0, waiting 3 and 7 of 8 blocks free.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import FinishReason, Sequence

EOS = 0


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(2, 12))
    cap = num_blocks * bs
    max_model_len = draw(st.sampled_from([cap, 2 * cap, max(2, cap // 2)]))
    cap = min(cap, max_model_len)
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        prompt_len = draw(st.integers(1, max(1, cap - 1)))
        max_tokens = draw(st.one_of(st.none(), st.integers(1, max(1, cap - prompt_len))))
        requests.append(dict(
            n=draw(st.sampled_from([1, 2, 3, 16])), prompt_len=prompt_len, max_tokens=max_tokens,
            arrive=draw(st.integers(0, 12)), abort=draw(st.one_of(st.none(), st.integers(0, 40))),
            ignore_eos=draw(st.booleans()),
        ))
    return dict(
        bs=bs, num_blocks=num_blocks, max_model_len=max_model_len, requests=requests,
        max_num_seqs=draw(st.integers(1, 8)), budget=draw(st.sampled_from([1, bs, 3 * bs, 256])),
        caching=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )


def run_workload(w: dict) -> None:
    """Drive the scheduler as the engine does (choices forked after choice 0's prefill, aborts of
    whole requests) and check that it never stalls and ends with every block free."""
    rng = random.Random(w["seed"])
    bm = BlockManager(w["num_blocks"], w["bs"], w["caching"])
    s = Scheduler(bm, w["max_num_seqs"], w["budget"], w["max_model_len"], [EOS])
    pending, forks = [], {}
    for i, r in enumerate(w["requests"]):
        prompt = [rng.randint(1, 3) for _ in range(r["prompt_len"])]  # few ids: prefix hits happen
        params = SamplingParams(max_tokens=r["max_tokens"], n=r["n"], ignore_eos=r["ignore_eos"])
        seqs = [Sequence(f"r{i}", prompt, params) for _ in range(r["n"])]
        s.check_fits(seqs[0])  # the workload only holds requests that admission accepts
        pending.append((r, seqs))
    requests = list(pending)
    everything = [q for _, seqs in requests for q in seqs]
    step = idle = 0
    limit = 100 + 4 * sum(r["n"] * s.max_seq_len for r in w["requests"])  # a livelock ends here too
    while pending or s.has_unfinished():
        assert step < limit, (step, s.running, list(s.waiting), bm.num_free_blocks)
        for r, seqs in [p for p in pending if p[0]["arrive"] <= step]:
            pending.remove((r, seqs))
            if len(seqs) > 1:
                forks[seqs[0].seq_id] = seqs[1:]
            s.add(seqs[0])
        for seqs in [seqs for r, seqs in requests if r["abort"] == step]:
            forks.pop(seqs[0].seq_id, None)
            for q in seqs:
                s.finish(q, FinishReason.ABORT)
        out = s.schedule()
        sampling = out.sampling_seqs
        for q in sampling:
            if q.num_completion_tokens == 0 and q.seq_id in forks:
                s.fork(q, forks.pop(q.seq_id))
        s.postprocess(out, [rng.randint(0, 3) for _ in sampling])
        bm.check_integrity()
        idle = 0 if out.scheduled or not s.has_unfinished() else idle + 1
        # a step may only preempt; the next one always runs something
        assert idle < 2, (step, s.running, list(s.waiting), bm.num_free_blocks)
        step += 1
    assert all(q.is_finished for q in everything)
    assert bm.num_free_blocks == bm.num_blocks and not s.running and not s.waiting


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(w=workloads())
def test_random_workloads_with_forked_choices_always_finish(w):
    run_workload(w)


def test_issue_recipe_finishes_in_the_scheduler():
    """L (10 + 118 tokens: the whole 8-block cache) then B (n = 2, one full prompt block):
    B's waiting second choice pinned B's prompt block while L needed all eight."""
    w = dict(bs=16, num_blocks=8, max_model_len=2048, max_num_seqs=2, budget=512, caching=True, seed=1,
             requests=[dict(n=1, prompt_len=10, max_tokens=118, arrive=0, abort=None, ignore_eos=True),
                       dict(n=2, prompt_len=20, max_tokens=100, arrive=3, abort=None, ignore_eos=True)])
    run_workload(w)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from kvserve.testing.random_model import write_random_model

    return str(write_random_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"), dtype=torch.float32))


@pytest.mark.slow  # ~12 s on the shared CPU; the server recipe below runs the same engine path by default
def test_engine_runs_n_gt_1_requests_to_the_end_in_a_tiny_cache(tiny_model):
    from kvserve.engine import LLM

    llm = LLM(tiny_model, dtype="float32", num_kv_blocks=4, block_size=16, max_num_seqs=2)
    try:
        # a request that needs the whole cache, then 16 choices of a 40-token prompt (2 blocks pinned)
        prompts = [list(range(1, 11)), list(range(200, 240))]
        params = [SamplingParams(max_tokens=54, ignore_eos=True),
                  SamplingParams(max_tokens=6, n=16, ignore_eos=True, temperature=1.0, seed=3)]
        eng = llm.engine
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            eng.add_request(f"q{i}", p, sp)
        tokens: dict[tuple[str, int], int] = {}
        for _ in range(20_000):  # bounded: a wedged engine fails here instead of hanging
            if not eng.has_unfinished_requests():
                break
            for out in eng.step():
                key = (out.request_id, out.index)
                tokens[key] = tokens.get(key, 0) + len(out.new_token_ids)
        assert not eng.has_unfinished_requests(), (eng.scheduler.running, list(eng.scheduler.waiting))
        assert tokens == {(f"q{i}", j): sp.max_tokens for i, sp in enumerate(params) for j in range(sp.n)}
        assert llm.stats().kv_blocks_free == 4 and llm.stats().num_waiting == 0
    finally:
        llm.shutdown()


async def _recipe(target: str) -> list:
    from kvserve.clients.messages import build_request
    from kvserve.v1 import llm_pb2, llm_pb2_grpc

    async with grpc.aio.insecure_channel(target) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        long = stub.Stream(build_request(token_ids=list(range(1, 11)), max_tokens=118, ignore_eos=True))
        first = await long.read()  # L runs: now B arrives
        b_request = build_request(token_ids=list(range(100, 120)), max_tokens=100, n=2, ignore_eos=True)
        b = stub.Generate(b_request, timeout=30)
        tokens = len(first.token_ids)  # a message carries every token its stream had pending
        while (msg := await long.read()) is not grpc.aio.EOF:
            tokens += len(msg.token_ids)
        b = await b
        other = await stub.Generate(build_request(token_ids=[5, 6, 7], max_tokens=4), timeout=30)
        stats = await stub.Stats(llm_pb2.StatsRequest(), timeout=10)
        return [tokens, [len(c.token_ids) for c in b.choices], len(other.token_ids), stats]


def test_server_recipe_n2_in_an_8_block_cache_finishes(tiny_model):
    from kvserve.testing.plugin import TEST_SERVER_ENV
    from kvserve.testing.process import ServerProcess

    flags = ("--model", tiny_model, "--dtype", "float32", "--num-kv-blocks", "8", "--block-size", "16",
             "--max-num-seqs", "2")
    with ServerProcess(*flags, env=TEST_SERVER_ENV) as server:
        tokens, b_choices, other, stats = asyncio.run(asyncio.wait_for(_recipe(server.target), 60))
    assert tokens == 118 and b_choices == [100, 100] and other == 4
    assert stats.kv_blocks_free == stats.kv_blocks_total == 8
    assert stats.num_running == stats.num_waiting == 0
