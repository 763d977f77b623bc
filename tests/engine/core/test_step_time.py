"""The step-time model (engine/core/step_time.py) and the scheduler's time-bounded prefill chunks."""

import random

import pytest

from kvserve.engine.core import step_time
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.core.step_time import (
    DECODE_SHARE,
    MAX_STRETCH,
    MIN_PREFILL_CHUNK,
    MIN_STEPS,
    StepTimeModel,
    attended_pairs,
)
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence

C0, A, B = 0.012, 9e-4, 3e-8  # seconds: fixed, per token, per attended pair (the dev CPU's order)


def cost(tokens, pairs):
    return C0 + A * tokens + B * pairs


def trained(bound=0.5, steps=40, noise=0.0, seed=0):
    rng = random.Random(seed)
    m = StepTimeModel(bound)
    for _ in range(steps):
        decode = rng.randint(1, 48)
        ctx = rng.randint(50, 3000)
        chunk = rng.choice([0, 0, 64, 256, 480])
        pos = rng.randint(0, 6000)
        tokens = decode + chunk
        pairs = decode * (ctx + 1) + attended_pairs(pos, chunk)
        m.observe(tokens, pairs, cost(tokens, pairs) * (1 + rng.uniform(-noise, noise)))
    return m


def test_attended_pairs_counts_causal_keys():
    assert attended_pairs(0, 1) == 1
    assert attended_pairs(10, 1) == 11
    assert attended_pairs(10, 3) == 11 + 12 + 13
    assert attended_pairs(0, 4) == 1 + 2 + 3 + 4


def test_fit_recovers_the_cost_of_steps():
    m = trained()
    c0, a, b = m.coef
    assert c0 == pytest.approx(C0, rel=1e-3) and a == pytest.approx(A, rel=1e-3)
    assert b == pytest.approx(B, rel=1e-3)
    noisy = trained(noise=0.1, seed=1)
    late = attended_pairs(4000, 512)
    assert noisy.predict(512, late) == pytest.approx(cost(512, late), rel=0.15)


def test_first_steps_bound_by_seconds_per_token():
    m = StepTimeModel(0.5)
    assert m.coef is None and m.prefill_tokens_within(0.0, 5000, 512) == 512  # nothing seen: no limit
    # right after start-up (a burst of prompts): 512 tokens took 1 s, so the next chunk is cut
    # to what that rate says fits, before the three-part fit has steps enough to tell parts apart
    m.observe(512, attended_pairs(0, 512), 1.0)
    assert m.coef == (0.0, pytest.approx(1.0 / 512), 0.0)
    assert m.prefill_tokens_within(0.0, 0, 2048) == 256
    for _ in range(MIN_STEPS - 2):
        m.observe(256, attended_pairs(0, 256), 0.5)
    assert m.coef[0] == 0.0 and m.coef[2] == 0.0  # still seconds per token alone
    assert trained(steps=MIN_STEPS).coef[0] > 0  # then all three parts


def test_prefill_chunk_is_the_largest_that_fits():
    m = trained(bound=0.5)
    for position in (0, 1000, 4000, 7500):
        spent = m.predict(8, 8 * 2000)  # eight decode rows already in the step
        n = m.prefill_tokens_within(spent, position, 4096)
        c0, a, b = m.coef
        assert spent + a * n + b * attended_pairs(position, n) <= 0.5 + 1e-9
        assert spent + a * (n + 1) + b * attended_pairs(position, n + 1) > 0.5
    # later in a prompt each token attends to more keys: the chunk that fits shrinks
    sizes = [m.prefill_tokens_within(0.0, p, 4096) for p in (0, 2000, 8000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_floor_keeps_prompts_moving_but_only_once():
    m = trained(bound=0.05)  # a bound smaller than the decode rows alone
    assert m.prefill_tokens_within(0.2, 0, 10) == 10
    assert m.prefill_tokens_within(0.2, 0, 5000, floor=False) == 0
    # the first chunk may take as long as the rest of the step: the step at most doubles
    n = m.prefill_tokens_within(0.2, 0, 5000)
    assert MIN_PREFILL_CHUNK < n < 5000
    assert A * n + B * attended_pairs(0, n) == pytest.approx(0.2, rel=0.01)
    assert m.prefill_tokens_within(0.2, 100_000, 5000) >= MIN_PREFILL_CHUNK


def test_a_step_stretches_so_that_decodes_stay_a_small_share_of_it():
    m = trained(bound=0.5)
    assert m.step_limit(0.02) == 0.5  # few decodes: the configured bound
    assert m.step_limit(0.09) == pytest.approx(0.09 / DECODE_SHARE)  # many: decodes 10% of the step
    assert m.step_limit(1.0) == MAX_STRETCH * 0.5  # never beyond MAX_STRETCH times the bound
    spent = 0.09
    n = m.prefill_tokens_within(spent, 0, 100_000, limit=m.step_limit(spent))
    c0, a, b = m.coef
    assert spent + a * n + b * attended_pairs(0, n) == pytest.approx(0.9, rel=0.01)
    assert n > m.prefill_tokens_within(spent, 0, 100_000)  # against the plain 500 ms bound


def test_a_burst_beside_many_streams_takes_longer_steps_than_one_prompt_beside_one():
    """The scheduler sets each step's bound at its first prefill chunk, from the decodes before it."""
    s = make(0.5, budget=4096, blocks=4096)
    s.max_num_seqs = 64
    for i in range(60):
        s.add(seq(300, f"early{i}", max_tokens=200))
    run(s, 40)  # all 60 prefilled and decoding
    for i in range(3):
        s.add(seq(3000, f"late{i}"))
    predicted = []
    run(s, 1, predicted)
    decodes = s.step_time.predict(60, sum(len(q.token_ids) for q in s.running[:60]))
    assert predicted[0] == pytest.approx(decodes / DECODE_SHARE, rel=0.02) and predicted[0] > 0.6
    lone = make(0.5, budget=4096)
    lone.add(seq(10, "short", max_tokens=50))
    lone.add(seq(3000, "long"))
    alone = []
    run(lone, 3, alone)
    assert max(alone) <= 0.5 + 1e-9


def make(bound, budget=2048, blocks=1024, bs=16):
    s = Scheduler(BlockManager(blocks, bs, True), 8, budget, 16384, [0], max_step_time=bound)
    model = trained(bound)
    s.step_time = model
    return s


def seq(n, rid, max_tokens=4):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run(s, steps, predicted=None):
    chunks = []
    for _ in range(steps):
        out = s.schedule()
        chunks.append([(x.seq.request_id, x.num_tokens) for x in out.scheduled])
        if predicted is not None:
            predicted.append(s.step_time.predict(out.num_tokens, out.attended_pairs))
        s.postprocess(out, [7] * len(out.sampling_seqs))
    return chunks


def test_scheduler_cuts_long_prompt_chunks_to_the_step_bound():
    s = make(0.4)
    s.add(seq(10, "short", max_tokens=50))
    s.add(seq(8000, "long"))
    predicted = []
    chunks = run(s, 40, predicted)
    long_chunks = [n for step in chunks for rid, n in step if rid == "long" and n > 1]
    assert sum(long_chunks) == 8000  # the whole prompt, in chunks
    assert long_chunks[0] > long_chunks[-1]  # dearer at the end of the prompt
    # every step stays within the bound by the model's own prediction (the true cost here)
    assert max(predicted) <= 0.4 + 1e-9
    assert cost(2048, attended_pairs(6000, 2048)) > 1.0  # what the token budget alone would allow
    # the short stream got a token in every step while the long prompt was prefilled
    both = [step for step in chunks[1:40] if any(r == "long" for r, _ in step)]
    assert all(any(rid == "short" for rid, _ in step) for step in both)


def test_without_a_bound_the_budget_alone_applies():
    s2 = Scheduler(BlockManager(1024, 16, True), 8, 2048, 16384, [0])
    s2.add(seq(8000, "long"))
    assert [c for step in run(s2, 4) for _, c in step] == [2048, 2048, 2048, 1856]


# ---- served: a long prompt while another stream runs (issue 29's shape) ---------------------------
LONG_PROMPT_TOKENS = 8000
ITL_LIMIT_S = 1.0  # the bound on this 2-core machine, with the default step bound (500 ms)


async def _gaps_while_long_prompt(target: str, long_tokens: int) -> tuple[list[float], float]:
    """A running stream's gaps between tokens while a ``long_tokens`` prompt is prefilled, and the
    long prompt's time to first token."""
    import asyncio
    import time

    from kvserve.clients import AsyncClient

    async with AsyncClient(target) as c:
        gaps, stamps = [], []
        first_long = asyncio.Event()

        async def short():
            async for _ in c.stream(token_ids=list(range(100, 120)), max_tokens=4000, ignore_eos=True,
                                    temperature=0.0):
                stamps.append(time.monotonic())
                if first_long.is_set():
                    return

        async def long():
            while len(stamps) < 5:
                await asyncio.sleep(0.05)
            start = time.monotonic()
            async for _ in c.stream(token_ids=[(7 * i) % 40000 + 50 for i in range(long_tokens)],
                                    max_tokens=1):
                break
            first_long.set()
            return start, time.monotonic()

        _, (start, end) = await asyncio.gather(short(), long())
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if a >= start]
        return gaps, end - start


@pytest.mark.slow
def test_served_long_prompt_keeps_running_streams_moving():
    """An 8,000-token prompt on the default bound: every gap of a running stream <= 1 s."""
    import asyncio

    from kvserve.testing.process import ServerProcess

    with ServerProcess("--dtype", "bfloat16") as server:
        gaps, ttft = asyncio.run(_gaps_while_long_prompt(server.target, LONG_PROMPT_TOKENS))
    assert gaps, "the short stream produced no token while the long prompt was prefilled"
    print(f"long prompt TTFT {ttft:.1f} s; running stream: {len(gaps)} gaps, max {max(gaps):.2f} s")
    assert max(gaps) <= ITL_LIMIT_S, sorted(gaps)[-5:]


# ---- the chunk floor: a step's fixed part against a large model's tokens (model seconds) -------------
def burst(machine, bound=0.5, requests=16, seed=1):
    """The peers harness's burst (``requests`` prompts of 64-400 tokens, 64 new tokens each, all at once)
    through the real scheduler on a synthetic machine (``c0 + a * tokens + b * pairs`` seconds a step,
    model seconds, no wall clock), its step time model trained on that machine first, as a server's is
    by the requests before. Returns per step: its seconds, prompt tokens and prompt tokens left after it."""
    rng = random.Random(seed)
    s = Scheduler(BlockManager(4096, 16, False), requests, 2048, 1024, [0], max_step_time=bound)
    c0, a, b = machine
    for _ in range(40):  # one stream's requests before: prompts in chunks, then decode steps
        tokens, pos = rng.choice([(1, 300), (1, 100), (64, 0), (200, 100)])
        pairs = attended_pairs(pos, tokens)
        s.step_time.observe(tokens, pairs, c0 + a * tokens + b * pairs)
    for i in range(requests):
        s.add(Sequence(f"r{i}", [rng.randrange(1, 30000) for _ in range(rng.randint(64, 400))],
                       SamplingParams(max_tokens=64, ignore_eos=True)))
    steps = []
    while s.has_unfinished():
        out = s.schedule()
        prompt = sum(x.num_tokens for x in out.scheduled if x.seq.num_completion_tokens == 0)
        pairs = out.attended_pairs
        seconds = c0 + a * out.num_tokens + b * pairs
        s.postprocess(out, [7] * len(out.sampling_seqs))
        s.step_time.observe(out.num_tokens, pairs, seconds)
        left = sum(q.num_prompt_tokens - q.num_computed_tokens for q in s.running + list(s.waiting)
                   if q.num_completion_tokens == 0)
        steps.append((seconds, prompt, left))
    return steps


LARGE = (0.6, 6e-3, 5e-7)  # a step's fixed part longer than the bound (a 2B model in bf16 on two cores)


def test_a_large_models_prefill_steps_are_not_mostly_their_fixed_part(monkeypatch):
    """Each step that computes prompt tokens while more wait is long enough that its fixed part is at
    most FIXED_SHARE of it, even where that is past the stretched bound: fewer prefill steps and less
    time for the same burst than with the bound alone, each step at most c0 / FIXED_SHARE long."""
    c0 = LARGE[0]
    steps = burst(LARGE)
    prefill = [t for t, n, left in steps if n and left]
    assert prefill and all(c0 <= step_time.FIXED_SHARE * t * (1 + 1e-6) for t in prefill)
    assert max(t for t, _, _ in steps) <= max(MAX_STRETCH * 0.5, c0 / step_time.FIXED_SHARE) + LARGE[1]
    monkeypatch.setattr(step_time, "FIXED_SHARE", 0.0)  # the bound alone (and MIN_PREFILL_CHUNK)
    before = burst(LARGE)
    before_prefill = [t for t, n, left in before if n and left]
    assert max(c0 / t for t in before_prefill) > 0.25  # steps at the stretched bound: 30% fixed part
    assert len(prefill) < len(before_prefill) and sum(prefill) < sum(before_prefill)
    assert sum(t for t, _, _ in steps) < sum(t for t, _, _ in before)


def test_the_chunk_floor_leaves_a_small_models_steps_alone(monkeypatch):
    """The default model's fixed part is small against its bound's chunks: the same steps either way."""
    floor = burst((C0, A, B))
    monkeypatch.setattr(step_time, "FIXED_SHARE", 0.0)
    assert burst((C0, A, B)) == floor
