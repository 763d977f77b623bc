"""The interactive tenant's first token under the tenants benchmark's flood, step by step, in the
deterministic simulation of flood_sim.py (the real scheduler at the benchmark's shape on a synthetic
machine; model seconds, no wall clock): which step each request arrives into, and how long that step
and the one that admits it may be (engine/tenancy/rows.py's due steps and progress steps)."""

import pytest
from flood_sim import Flood

from kvserve.engine.tenancy.rows import DUE_STEP_FACTOR, LINGER_PROMPT, MAX_DUE_ROUNDS

SHORT_PROMPT = 24


def full_step(run: Flood, step) -> float:
    """Model seconds of a step that decodes every flood row of ``step`` (the flood alone)."""
    c0, a, b = run.machine
    context = max(q.num_tokens for q in run.flood)
    return c0 + step.flood_decoding * (a + b * context)


@pytest.fixture(scope="module")
def bench():
    return Flood(requests=12).run()


def test_each_request_after_the_first_arrives_into_a_held_step_and_is_admitted_in_the_next(bench):
    lingering = DUE_STEP_FACTOR * bench.alone(LINGER_PROMPT)  # the bound of a step while it lingers
    admitting = DUE_STEP_FACTOR * bench.alone(SHORT_PROMPT)  # ... and of the step that admits a request
    assert len(bench.reqs) == 12
    for r in bench.reqs[1:]:
        arrived, admitted = bench.steps[r.in_flight], bench.steps[r.admitted]
        assert arrived.kind == "held" and arrived.seconds <= lingering + 1e-9, (r.seq.request_id, arrived)
        assert r.admitted == r.in_flight + 1, (r.seq.request_id, r.in_flight, r.admitted)
        assert admitted.kind == "held" and admitted.seconds <= admitting + 1e-9, (r.seq.request_id, admitted)
        assert r.ttft <= lingering + admitting + 1e-9
        assert arrived.flood_decoding >= 63 and arrived.flood_rows < arrived.flood_decoding / 4


def test_the_first_request_arrives_into_a_whole_flood_step_that_no_share_can_shorten(bench):
    # the tenant is new: nothing is held before it arrives. Its wait is the rest of a lone flood step
    # (half of it here) and then its own held step: the floor of the benchmark's p99, which is the
    # largest of 40 requests (docs/performance/tenants.md)
    first = bench.reqs[0]
    arrived, admitted = bench.steps[first.in_flight], bench.steps[first.admitted]
    assert arrived.kind == "alone" and arrived.flood_rows == 64
    assert first.admitted == first.in_flight + 1 and admitted.kind == "held"
    assert first.ttft >= arrived.seconds / 2 - 1e-9
    assert first.ttft <= arrived.seconds + DUE_STEP_FACTOR * bench.alone(SHORT_PROMPT) + 1e-9
    assert first.ttft > 2.5 * bench.alone(SHORT_PROMPT)  # the 2x target is out of reach for it


def test_a_think_time_of_many_due_steps_never_meets_a_step_longer_than_the_floods_own():
    # the client thinks 0.6 s (about MAX_DUE_ROUNDS held steps) and its tenant lingers 1 s: before,
    # every MAX_DUE_ROUNDS-th due step was unheld and a request arrived into it (148 ms; 75 now)
    run = Flood(requests=12, think=0.6, linger=1.0).run()
    assert sum(st.kind == "progress" for st in run.steps) >= 1
    bound = 2 * DUE_STEP_FACTOR * run.alone(LINGER_PROMPT)
    for r in run.reqs[1:]:
        arrived = run.steps[r.in_flight]
        assert arrived.kind in ("held", "progress"), (r.seq.request_id, arrived)
        assert r.ttft <= bound + 1e-9, [round(x.ttft, 4) for x in run.reqs]
    for st in run.steps:  # a progress step is no longer than the flood's full decode step (and a chunk)
        if st.kind == "progress":
            assert st.seconds <= full_step(run, st) + run.alone(LINGER_PROMPT) + 1e-9, st


def test_without_heavy_prompt_tokens_every_due_step_is_held():
    # one request, then its tenant lingers for a minute: once the flood sequence its request took a
    # slot from is back (recomputed in progress steps), nothing of the flood waits for a prompt token
    run = Flood(requests=1, linger=60.0)
    run.run(until=30.0)
    end = run.reqs[0].first + 1.0
    after = [st for st in run.steps if st.start > end]
    last = max((k for k, st in enumerate(after) if st.kind == "progress" or st.flood_prefill), default=-1)
    quiet = after[last + 1:]
    assert len(quiet) >= 3 * MAX_DUE_ROUNDS
    assert all(st.kind == "held" and st.flood_prefill == 0 for st in quiet)


def test_the_floods_tokens_per_second_stay_within_ten_percent_of_fcfs(bench):
    start, end = bench.window()
    fcfs = Flood(policy="fcfs", requests=0).run(until=end)
    fair, alone = bench.flood_rate(start, end), fcfs.flood_rate(start, end)
    assert fair >= 0.9 * alone, (fair, alone)


CHUNK_PAIR = 3e-7  # a prefill chunk's query-key pair: a sixth of a decode row's (the machine's 1.8 us)


@pytest.fixture(scope="module")
def chunky():
    """The benchmark's start on a machine where a decode row's pair costs six times a prefill chunk's
    (as on a CPU: a decode row reads its whole KV for one query): the first request comes right after
    the flood's prompt was prefilled."""
    return Flood(requests=12, warmup=2, prefill_pair=CHUNK_PAIR).run()


def test_a_fit_over_prefill_then_decode_steps_keeps_the_decode_rows_cost_and_the_due_steps_held(chunky):
    # with one pair cost for both, the fit put the decode rows' cost into the fixed part (c0 155 ms, b 0):
    # every due step then kept all 63 flood rows and each request after the first waited 320-380 ms,
    # five times the bound below (docs/performance/tenants.md, what the step trace showed)
    c0, a, b = chunky.machine
    coef = chunky.s.step_clock.row_coef
    assert coef[0] < 2 * c0 and coef[2] > b / 2, coef
    lingering = DUE_STEP_FACTOR * chunky.alone(LINGER_PROMPT)
    admitting = DUE_STEP_FACTOR * chunky.alone(SHORT_PROMPT)
    for r in chunky.reqs[1:]:
        arrived, admitted = chunky.steps[r.in_flight], chunky.steps[r.admitted]
        assert arrived.kind == "held" and arrived.flood_rows <= arrived.flood_decoding / 4, arrived
        assert admitted.kind == "held" and admitted.flood_rows <= admitted.flood_decoding / 4, admitted
        assert r.ttft <= lingering + admitting, [round(x.ttft, 4) for x in chunky.reqs]


def test_on_that_machine_the_floods_tokens_per_second_stay_within_ten_percent_of_fcfs(chunky):
    start, end = chunky.window()
    fcfs = Flood(policy="fcfs", requests=0, warmup=2, prefill_pair=CHUNK_PAIR).run(until=end)
    fair, alone = chunky.flood_rate(start, end), fcfs.flood_rate(start, end)
    assert fair >= 0.9 * alone, (fair, alone)
