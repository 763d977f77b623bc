"""Deadline-aware admission that predicts the finish (engine/tenancy/deadlines.py): the real Scheduler and
block manager, the step time model's coefficients set (or learned from a synthetic machine), a fake clock.
Checked: a request that starts in time but cannot finish is refused at once; one whose row would make
an admitted request miss its deadline is refused; and, in an open-loop overload simulation (arrivals at
a fixed rate, each with a deadline, requests aborted when their deadline passes as the server does),
the fair policy finishes requests within their deadline where fcfs, which admits everything, finishes
none. Counted, not timed."""

import pytest

from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import FinishReason, Sequence, Tenancy
from kvserve.engine.tenancy import deadlines
from kvserve.engine.tenancy.shares import DeadlineUnreachable, TenantShares

PROMPT = [9707, 11, 1246, 525, 498, 30] * 4
C0, A, B = 0.02, 0.0005, 1e-6  # the synthetic machine: seconds = C0 + A * tokens + B * pairs


@pytest.fixture
def now(monkeypatch):
    t = [1000.0]
    monkeypatch.setattr(deadlines, "clock", lambda: t[0])
    return t


def make(policy="fair", max_num_seqs=64):
    return Scheduler(BlockManager(4096, 16, True), max_num_seqs, 2048, 512, [0], shares=TenantShares(policy))


def req(i, max_tokens, deadline=None, tenant="load"):
    return Sequence(f"r{i}", list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    Tenancy(tenant, 0, deadline))


def run_step(s, clock=None):
    out = s.schedule()
    dt = C0 + A * out.num_tokens + B * out.attended_pairs
    s.postprocess(out, [7] * len(out.sampling_seqs))
    if s.step_clock is not None:
        s.step_clock.observe(out.num_tokens, out.attended_pairs, dt)
    if clock is not None:
        clock[0] += dt
    return dt


def test_a_request_that_starts_in_time_but_cannot_finish_is_refused(now):
    s = make(max_num_seqs=8)
    for i in range(4):
        s.add(req(i, 400))
    run_step(s)  # four rows run: slots are free, so a new request starts at once
    s.step_clock.coef = (0.01, 0.001, 0.0)  # 10 ms a step + 1 ms a token
    # 200 tokens at 5 rows a step: about 200 x 15 ms = 3 s
    with pytest.raises(DeadlineUnreachable, match="cannot finish before its deadline") as refused:
        s.check_admission(req(9, 200, deadline=now[0] + 1.0))
    assert "at 5 rows a step" in str(refused.value)
    s.check_admission(req(9, 200, deadline=now[0] + 10.0))
    s.check_admission(req(9, 200))  # no deadline: queued as before


def test_a_requests_choices_each_add_a_row(now):
    s = make(max_num_seqs=8)
    for i in range(4):
        s.add(req(i, 400))
    run_step(s)
    s.step_clock.coef = (0.01, 0.001, 0.0)
    # 200 tokens: about 3.0 s at 5 rows (n=1), 3.6 s at 8 rows (n=4)
    s.check_admission(req(9, 200, deadline=now[0] + 3.3))
    four = Sequence("r9", list(PROMPT), SamplingParams(n=4, max_tokens=200, ignore_eos=True),
                    Tenancy("load", 0, now[0] + 3.3))
    with pytest.raises(DeadlineUnreachable, match="at 8 rows a step"):
        s.check_admission(four)


def test_a_request_whose_row_would_make_an_admitted_one_late_is_refused(now):
    s = make(max_num_seqs=8)
    # 100 tokens left at 4 rows (14 ms a step): 1.4 s; at 5 rows (15 ms): 1.5 s
    tight = [req(i, 101, deadline=now[0] + 1.45) for i in range(4)]
    for seq in tight:
        s.add(seq)
    run_step(s)
    s.step_clock.coef = (0.01, 0.001, 0.0)
    with pytest.raises(DeadlineUnreachable, match="without making an admitted request miss its deadline"):
        s.check_admission(req(9, 4, deadline=now[0] + 60.0))
    for seq in tight:  # the same running set without deadlines: nothing to keep
        s.finish(seq, FinishReason.ABORT)
    for i in range(4):
        s.add(req(10 + i, 101))
    run_step(s)
    s.step_clock.coef = (0.01, 0.001, 0.0)
    s.check_admission(req(9, 4, deadline=now[0] + 60.0))


def test_fcfs_refuses_nothing_for_the_finish(now):
    s = make("fcfs", max_num_seqs=8)
    for i in range(4):
        s.add(req(i, 400))
    run_step(s)
    s.check_admission(req(9, 200, deadline=now[0] + 0.5))


def overload(policy, rate=16.0, seconds=20.0, tokens=128, deadline=5.0):
    """Open-loop arrivals at ``rate`` a second for ``seconds``, each of ``tokens`` with a ``deadline``;
    returns (finished within the deadline, refused at once, expired)."""
    s, clock = make(policy), deadlines.clock
    now = [clock()]
    deadlines.clock = lambda: now[0]
    try:
        start, sent, ok, refused, expired, live = now[0], 0, 0, 0, 0, []
        for i in range(8):  # a warm start: the model has seen steps (the server's warm-up request)
            s.add(req(f"w{i}", 4))
        while s.has_unfinished():
            run_step(s, now)
        start = now[0]
        while sent < rate * seconds or s.has_unfinished():
            while sent < rate * seconds and start + sent / rate <= now[0]:
                seq = req(sent, tokens, deadline=start + sent / rate + deadline)
                sent += 1
                try:
                    s.check_admission(seq)
                except DeadlineUnreachable:
                    refused += 1
                    continue
                s.add(seq)
                live.append(seq)
            for seq in [q for q in live if not q.is_finished and q.tenancy.deadline <= now[0]]:
                s.finish(seq, FinishReason.ABORT)  # the call's deadline passed: the server aborts it
                expired += 1
            for seq in [q for q in live if q.is_finished]:
                live.remove(seq)
                ok += seq.finish_reason is FinishReason.LENGTH
            if s.has_unfinished():
                run_step(s, now)
            else:
                now[0] = start + sent / rate
        ok += sum(q.finish_reason is FinishReason.LENGTH for q in live)
        s.bm.check_integrity()
        return ok, refused, expired
    finally:
        deadlines.clock = clock


def test_under_overload_fair_finishes_requests_in_time_where_fcfs_finishes_none():
    fcfs = overload("fcfs")
    fair = overload("fair")
    assert fcfs[0] == 0 and fcfs[1] == 0  # every request admitted, every one late
    assert fair[0] >= 0.2 * 16 * 20, fair  # a fifth of the arrivals or more finish within the deadline
    assert fair[1] > 0 and fair[2] <= 0.1 * fair[0], fair  # the rest are refused at once, few expire


def test_without_overload_fair_refuses_nothing():
    ok, refused, expired = overload("fair", rate=4.0, seconds=10.0, tokens=16)
    assert (ok, refused, expired) == (40, 0, 0)
