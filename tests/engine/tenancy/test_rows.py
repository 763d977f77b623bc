"""A tenant's share of a step's rows (engine/tenancy/rows.py), in a deterministic simulation of the
tenants benchmark's flood: the scheduler and block manager alone, every sampled token fixed, no model;
the step time model learns a synthetic machine (``C0 + A * tokens + B * pairs`` seconds a step, a
CPU-like one where each long-context decode row costs much), and a fake clock advances by it.

A flood tenant fills every slot with long-context choices; an interactive tenant sends short requests
one after another, each arriving during the step after the previous one ended. Checked: the flood's
decode rows per step while the interactive tenant waits, lingers or runs; that every flood sequence
still gets a token every ``MAX_ROUNDS`` steps; that its tokens per second stay within the configured
cost; that the interactive first token comes after far less time than with full flood steps; and that
a lone tenant's steps, and ``fcfs``, are unchanged."""

import math

import pytest

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence, SequenceStatus, Tenancy
from kvserve.engine.tenancy.rows import (
    DUE_STEP_FACTOR,
    LINGER_PROMPT,
    MAX_DUE_ROUNDS,
    MAX_ROUNDS,
    MIN_KEPT,
    PROGRESS_CHUNK,
    StepRows,
)
from kvserve.engine.tenancy.shares import TenantShares

BS, SEQS, PROMPT, TOKENS = 4, 16, 160, 120
C0, A, B = 0.02, 0.0005, 2e-5  # the synthetic machine: seconds = C0 + A * tokens + B * pairs
COST = 0.1
WARMUP = 24  # steps of the flood alone before the first interactive request (the model has learned)


GPU_LIKE = (0.02, 1e-5, 1e-8)  # the fixed part (the weights read) dominates: rows are cheap


class Run:
    """One simulated server: ``steps`` lists, per step, (its seconds, flood rows decoded, flood
    sequences decoding, the interactive tenant's state: "waiting", "running", "lingering" or None)."""

    def __init__(self, policy="fair", cost=COST, linger=0.5, interactive=6, gap=1, machine=None):
        self.machine = machine or (C0, A, B)
        self.s = Scheduler(BlockManager(4096, BS, True), SEQS, 512, PROMPT + TOKENS + 8, [0],
                           shares=TenantShares(policy, row_cost=cost, linger=linger))
        self.now = 0.0
        self.s.shares.rows.clock = lambda: self.now
        prompt = list(range(1000, 1000 + PROMPT))
        self.flood = [Sequence(f"flood-{i}", list(prompt), SamplingParams(max_tokens=TOKENS, ignore_eos=True),
                               Tenancy("flood")) for i in range(SEQS)]
        for seq in self.flood:
            self.s.add(seq)
        self.steps, self.schedules, self.ttft = [], [], []
        self.streak = dict.fromkeys((seq.seq_id for seq in self.flood), 0)
        self.longest = 0  # most steps in a row a decoding flood sequence got no row
        self.interactive, self.gap, self.linger = interactive, gap, linger

    def run(self):
        s, sent, current, ended, arrived, first, left = self.s, 0, None, None, None, None, None
        while s.has_unfinished():
            i = len(self.steps)
            if current is not None and current.is_finished:
                self.ttft.append(first - arrived)
                current, ended, left = None, i, self.now
            # the next request arrives during the ``gap``-th step after the last one ended: its wait
            # counts from that step's start (a whole step in flight, the p99 case)
            due = i >= WARMUP and sent < self.interactive and current is None
            if due and (ended is None or i - ended >= self.gap):
                current = Sequence(f"interactive-{sent}", [5, 6, 7, 8] * 6,
                                   SamplingParams(max_tokens=8, ignore_eos=True), Tenancy("interactive"))
                s.add(current)
                sent, first = sent + 1, None
                arrived = self.now - (self.steps[-1][0] if self.gap else 0.0)
            state = None
            if current is not None:
                state = "waiting" if current.status is SequenceStatus.WAITING else "running"
            elif ended is not None and (sent < self.interactive or self.now - left <= self.linger):
                state = "lingering"
            decoding = {q.seq_id for q in s.running if q.tenancy.tenant == "flood"
                        and q.num_tokens - q.num_computed_tokens == 1}
            out = s.schedule()
            c0, a, b = self.machine
            pairs = out.attended_pairs  # (before postprocess advances the counts)
            dt = c0 + a * out.num_tokens + b * pairs
            rows = {x.seq.seq_id for x in out.scheduled if x.seq.seq_id in decoding}
            for seq_id, streak in self.streak.items():  # steps each decoding flood sequence waited for a row
                self.streak[seq_id] = streak + 1 if seq_id in decoding and seq_id not in rows else 0
                self.longest = max(self.longest, self.streak[seq_id])
            self.schedules.append([(x.seq.request_id, x.num_tokens) for x in out.scheduled])
            self.now += dt  # the step ends: a request it finishes ends then
            s.postprocess(out, [7] * len(out.sampling_seqs))
            if s.step_clock is not None:  # (fcfs: no deadlines, no clock)
                s.step_clock.observe(out.num_tokens, pairs, dt)
            if current is not None and first is None and current.num_completion_tokens:
                first = self.now
            self.steps.append((dt, len(rows), len(decoding), state))
        s.bm.check_integrity()
        return self


@pytest.fixture(scope="module")
def shared():
    return Run().run()


def test_the_flood_decodes_fewer_rows_while_the_interactive_tenant_waits_or_runs(shared):
    by_state = {}
    for _, rows, decoding, state in shared.steps:
        if decoding >= SEQS - 1:
            by_state.setdefault(state, []).append((rows, decoding))
    assert set(by_state) >= {"waiting", "running", "lingering", None}
    # its first token is due (a request waiting, or one just ended): the flood at its floor (one less
    # where the waiting request took the slot of one of those rows)
    for state in ("waiting", "lingering"):
        floor = [(rows, math.ceil(decoding / MAX_ROUNDS)) for rows, decoding in by_state[state]]
        assert all(1 <= f - 1 <= rows <= f for rows, f in floor), (state, floor)
    # it runs: cut by the cost, never below half
    running = by_state["running"]
    assert all(math.ceil(decoding * MIN_KEPT) <= rows < decoding for rows, decoding in running), running
    # alone (before the first request, after the last one and the linger): every row
    assert all(rows == decoding for rows, decoding in by_state[None])


def test_every_flood_sequence_still_gets_a_token_every_max_rounds_steps(shared):
    assert shared.longest == MAX_ROUNDS - 1
    for seq in shared.flood:  # the sequence a request's slot was taken from too, once it is back
        assert seq.num_completion_tokens == TOKENS


def test_the_flood_keeps_its_tokens_per_second_within_the_cost_while_the_interactive_tenant_runs(shared):
    checked = 0
    for dt, rows, decoding, state in shared.steps:
        if state == "running" and decoding >= SEQS - 1:
            n, all_rows = rows + 1, decoding + 1  # the interactive request's row with them
            per_row = (dt - C0) / n
            assert n / dt >= (1 - COST) * all_rows / (C0 + all_rows * per_row) - 1e-9, (rows, decoding, dt)
            checked += 1
    assert checked >= 20


def test_the_interactive_first_token_comes_far_sooner_than_with_full_flood_steps(shared):
    full = Run(cost=0.0).run()  # the fair policy without the rows' share: the admission step as before
    assert len(shared.ttft) == len(full.ttft) == 6
    # the first request of a tenant new to the server lands in a full flood step; the next ones in a
    # step of the flood's floor (its tenant lingers), and are admitted into another
    assert shared.ttft[0] < 0.8 * full.ttft[0]
    assert max(shared.ttft[1:]) <= 0.5 * min(full.ttft[1:]), (shared.ttft, full.ttft)


def test_where_rows_are_cheap_the_flood_keeps_them_all_while_the_interactive_tenant_decodes():
    run = Run(machine=GPU_LIKE).run()
    running = [(rows, decoding) for _, rows, decoding, state in run.steps if state == "running"]
    assert running and all(rows == decoding for rows, decoding in running), running


def test_a_lone_tenant_and_fcfs_steps_are_unchanged():
    alone = Run(interactive=0).run()
    off = Run(interactive=0, cost=0.0).run()
    assert alone.schedules == off.schedules
    assert all(rows == decoding for _, rows, decoding, _ in alone.steps)
    fcfs = Run(policy="fcfs").run()
    assert all(rows == decoding for _, rows, decoding, _ in fcfs.steps)
    assert fcfs.s.shares.rows.held == 0


@pytest.mark.parametrize("field,value", [("tenant_row_cost", -0.1), ("tenant_row_cost", 0.6),
                                         ("tenant_linger_ms", -1.0), ("tenant_linger_ms", 60_001.0)])
def test_the_knobs_are_range_checked(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_step_rows_refuse_out_of_range_values():
    with pytest.raises(ValueError, match="tenant_row_cost"):
        StepRows(TenantShares(), cost=0.9)


def test_a_request_its_running_cap_holds_back_does_not_shorten_the_steps():
    shares = TenantShares(max_running=2)
    mine = [Sequence(f"i-{k}", [5, 6, 7], SamplingParams(max_tokens=4), Tenancy("interactive"))
            for k in range(3)]
    for seq in mine:
        shares.join(seq)
        shares.enqueue(seq)
    for seq in mine[:2]:  # two run, the third waits for the cap
        shares.started(seq)
    assert not shares.rows._first_token_due({"interactive"}, mine[:2])
    assert shares.rows._first_token_due({"interactive"}, mine[:1])  # a slot of its cap is free


def test_a_tenant_lingers_from_when_its_last_sequence_ended_even_if_no_step_ran_since():
    shares, now = TenantShares(linger=0.25), [0.0]
    shares.rows.clock = lambda: now[0]
    seq = Sequence("a-0", [5, 6, 7], SamplingParams(max_tokens=4), Tenancy("a"))
    shares.join(seq)
    shares.leave(seq)
    now[0] = 0.2
    assert shares.rows._tenants() == {"a": 0}
    now[0] = 1.0  # the engine was idle: no step saw it leave
    assert shares.rows._tenants() == {}


@pytest.mark.parametrize("policy,cost", [("fcfs", COST), ("fair", 0.0)])
def test_without_the_rows_share_no_departed_tenant_is_kept(policy, cost):
    shares = TenantShares(policy, row_cost=cost)
    for k in range(100):
        seq = Sequence(f"t{k}-0", [5, 6, 7], SamplingParams(max_tokens=4), Tenancy(f"t{k}"))
        shares.join(seq)
        shares.leave(seq)
    assert shares.rows._left == {}


ROW_COSTLY = (C0, A, 1e-4)  # each long-context row costs as much as the step's fixed part


def alone(prompt):
    """Seconds of a step holding only a ``prompt``-token prefill, on the ROW_COSTLY machine."""
    c0, a, b = ROW_COSTLY
    return c0 + a * prompt + b * prompt * (prompt + 1) / 2


def test_a_due_step_is_held_to_a_multiple_of_the_newcomers_step_alone():
    run = Run(machine=ROW_COSTLY).run()
    quarter = math.ceil(SEQS / MAX_ROUNDS)
    due = [(dt, rows, state) for dt, rows, decoding, state in run.steps
           if state in ("waiting", "lingering") and decoding >= SEQS - 1]
    assert len(due) >= 10
    for dt, rows, state in due:
        # the step that admits the 24-token prompt; a lingering step reserves a 32-token chunk's time
        bound = DUE_STEP_FACTOR * alone(24 if state == "waiting" else LINGER_PROMPT)
        assert dt <= bound + 1e-9 and rows < quarter, (dt, bound, rows, state)
    # the next requests arrive at the start of a lingering step, and are admitted in the one after
    assert max(run.ttft[1:]) <= DUE_STEP_FACTOR * (alone(LINGER_PROMPT) + alone(24)) + 1e-9, run.ttft
    quarter_run = Run(machine=ROW_COSTLY)
    quarter_run.s.shares.rows.due_factor = 1e6  # unbounded: the flood keeps a quarter of its rows
    quarter_run.run()
    assert max(run.ttft[1:]) < 0.6 * min(quarter_run.ttft[1:]), (run.ttft, quarter_run.ttft)
    for seq in run.flood:  # every flood sequence still finishes
        assert seq.num_completion_tokens == TOKENS


def test_a_heavy_tenants_prefill_chunk_shrinks_in_a_step_that_admits_a_newcomer():
    s = Scheduler(BlockManager(4096, BS, True), 8, 512, 4096, [0], shares=TenantShares("fair"))
    coef = (C0, A, B)
    for k in range(4):  # four long prompts fill the flood tenant's share: prefilled 512 tokens a step
        s.add(Sequence(f"flood-{k}", list(range(1000 * k, 1000 * k + 2000)),
                       SamplingParams(max_tokens=4, ignore_eos=True), Tenancy("flood")))
    s.step_clock.coef = coef
    out = s.schedule()
    s.postprocess(out, [7] * len(out.sampling_seqs))
    assert [x.num_tokens for x in out.scheduled] == [512]
    newcomer = Sequence("interactive-0", [5, 6, 7, 8] * 6, SamplingParams(max_tokens=4, ignore_eos=True),
                        Tenancy("interactive"))
    s.add(newcomer)
    out = s.schedule()
    chunks = {x.seq.request_id: (x.seq.num_computed_tokens, x.num_tokens) for x in out.scheduled}
    assert chunks["interactive-0"] == (0, 24)  # admitted in this very step
    position, flood = chunks["flood-0"]
    assert 0 < flood < 512
    c0, a, b = coef
    step = sum(a * n + b * (n * p + n * (n + 1) / 2) for p, n in chunks.values()) + c0
    assert step <= DUE_STEP_FACTOR * (c0 + a * 24 + b * 24 * 25 / 2) + 1e-9, (chunks, step)


def test_a_heavy_prompt_progresses_while_a_light_tenant_keeps_every_step_due():
    shares = TenantShares("fair", row_cost=COST, linger=60.0)
    s = Scheduler(BlockManager(4096, BS, True), 8, 512, 4096, [0], shares=shares)
    now = [0.0]
    shares.rows.clock = lambda: now[0]
    for k in range(4):
        s.add(Sequence(f"flood-{k}", list(range(1000 * k, 1000 * k + 2000)),
                       SamplingParams(max_tokens=4, ignore_eos=True), Tenancy("flood")))
    s.step_clock.coef = ROW_COSTLY
    light = Sequence("light-0", [5, 6, 7], SamplingParams(max_tokens=1), Tenancy("light"))
    shares.join(light)
    shares.leave(light)  # it lingers for a minute: every step has its first token due
    chunks, progress = [], []
    for _ in range(2 * MAX_DUE_ROUNDS):
        out = s.schedule()
        chunks.append(sum(x.num_tokens for x in out.scheduled))
        progress.append(shares.rows.progress)
        s.postprocess(out, [7] * len(out.sampling_seqs))
    # one due step in MAX_DUE_ROUNDS is a progress step: the first heavy chunk keeps PROGRESS_CHUNK
    # tokens (no decode rows here, whose time it could take); no step takes the scheduler's whole chunk
    steps = [k for k, p in enumerate(progress) if p]
    assert steps == [MAX_DUE_ROUNDS - 1, 2 * MAX_DUE_ROUNDS - 1], progress
    assert all(chunks[k] >= PROGRESS_CHUNK for k in steps), chunks
    assert all(0 < c < 512 for c in chunks), chunks
