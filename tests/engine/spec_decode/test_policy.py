"""How many drafts a step verifies: many where rows are nearly free, none where they cost in
proportion or where drafts keep failing."""

from __future__ import annotations

import pytest

from kvserve.engine.spec_decode.ngram import NgramIndex
from kvserve.engine.spec_decode.policy import (
    INITIAL_ACCEPTANCE,
    INITIAL_FORCED_ACCEPTANCE,
    OBSERVED_QUANTILE,
    OBSERVED_STEP,
    SpecState,
    StepCosts,
    allocate,
    match_prior,
)

CPU_LIKE = StepCosts({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 9: 2.5, 32: 8.0})


def test_step_costs_interpolate_and_extend_the_last_slope():
    costs = StepCosts({1: 1.0, 3: 2.0, 5: 2.0})
    assert costs(2) == pytest.approx(1.5)
    assert costs(7) == pytest.approx(2.0)  # flat last slope stays flat, never below
    assert StepCosts({1: 1.0, 2: 3.0})(4) == pytest.approx(7.0)
    assert costs.relative() == {1: 1.0, 3: 2.0, 5: 2.0}


def test_a_size_measured_slower_than_a_larger_one_takes_the_larger_ones_time():
    """A disturbed measurement at two rows (int4 weights, once) must not stop all drafting."""
    measured = {1: 1.0, 2: 1.93, 3: 1.49, 4: 1.5, 5: 1.61, 6: 2.02}
    costs = StepCosts(measured)
    assert costs.relative() == {**measured, 2: 1.49}
    assert allocate(costs, 1, [(INITIAL_ACCEPTANCE, 5)])[0] >= 2
    assert StepCosts({1: 2.0, 2: 1.0})(1) == 1.0


def test_observed_steps_refresh_the_costs_and_dearer_rows_stop_the_drafts():
    """The start-up table says 2-6 rows cost barely more than one; the serving steps find each
    verification row dear (long contexts). Observations move a size's ratio to the table toward
    the steps' lower quartile (a step up: 1/4 of OBSERVED_STEP, down: 3/4), the larger sizes not
    observed yet follow the nearest observed size's ratio, one disturbed step barely moves it, and
    the drafts that paid under the table stop."""
    up, down = 1 + OBSERVED_STEP * OBSERVED_QUANTILE, 1 - OBSERVED_STEP * (1 - OBSERVED_QUANTILE)
    costs = StepCosts({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 6: 1.25})
    assert allocate(costs, 1, [(0.5, 5)]) == [3]  # cheap rows pay (a 4th and 5th would not)
    costs.observe(7, 9.0)  # a size the table does not hold: nothing to fold in
    costs.observe(2, 0.0)
    costs.observe(1, 1.0)  # as the table says: no move
    assert costs.relative() == {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 6: 1.25}
    costs.observe(2, 2.1)
    assert costs(2) == pytest.approx(1.05 * up)
    assert costs(3) == pytest.approx(1.1 * up)  # not observed: the ratio observed at 2
    for _ in range(80):
        costs.observe(2, 2.1)
    assert 2.1 * down <= costs(2) <= 2.1 * up
    # 1.5 tokens for 2.1x the time, ... 1.97 tokens for 6 rows at 2.5x: each a loss
    assert allocate(costs, 1, [(0.5, 5)]) == [0]
    before = costs(2)
    costs.observe(2, 40.0)  # a step slowed by other load
    assert costs(2) == pytest.approx(before * up)
    for _ in range(3):
        costs.observe(4, 1.15)  # as measured: a smaller size observed slower takes 4's time
    assert costs(2) == costs(3) == costs(4) == pytest.approx(1.15) and costs(6) == pytest.approx(1.25)


def test_a_single_stream_with_good_drafts_verifies_them_all():
    assert allocate(CPU_LIKE, 1, [(0.9, 5)]) == [5]


def test_drafts_that_keep_failing_stop_being_verified():
    state = SpecState(NgramIndex(2, 3), match=3)
    assert state.acceptance() == match_prior(3) and state.acceptance(2) == INITIAL_ACCEPTANCE
    for _ in range(12):
        state.record(3, 0)
    assert state.drafted == 36 and state.accepted == 0
    assert allocate(CPU_LIKE, 1, [(state.acceptance(), 3)]) == [0]
    assert state.acceptance(2) == INITIAL_ACCEPTANCE  # a match of another length keeps its own


def test_longer_matches_are_surer_and_verify_more_drafts():
    assert [round(match_prior(n), 3) for n in (1, 2, 3, 4, 5)] == [0.2, 0.6, 0.8, 0.9, 0.95]
    costs = StepCosts({1: 1.0, 2: 1.05, 3: 1.11, 4: 1.11, 5: 1.26, 6: 1.26, 7: 1.57, 9: 1.63})
    ks = [allocate(costs, 1, [(match_prior(n), 8)])[0] for n in (2, 5)]
    assert ks[0] < ks[1]


def test_the_best_draft_count_past_a_step_in_the_costs():
    """Rows 2-4 cost one price and 5-9 another: a fifth draft alone loses, five more pay."""
    costs = StepCosts({1: 1.0, 4: 1.0, 5: 1.3, 9: 1.3})
    assert allocate(costs, 1, [(0.95, 8)]) == [8]
    assert allocate(costs, 1, [(0.95, 4)]) == [3]  # the fourth draft's row costs 0.3 for 0.81


def test_a_large_batch_drafts_less_when_rows_cost_in_proportion():
    linear = StepCosts({1: 1.0, 64: 64.0})
    assert allocate(linear, 32, [(0.7, 5)] * 32) == [0] * 32
    ks = allocate(CPU_LIKE, 4, [(0.9, 5), (0.3, 5), (0.9, 5), (0.9, 5)])
    assert sum(ks) <= 4 and ks[1] == 0  # the 8-row step is the cheap one; the weak drafter gets none


def test_drafts_keep_a_step_within_the_rows_computed_exactly():
    flat = StepCosts({1: 1.0, 64: 1.0})
    assert sum(allocate(flat, 3, [(0.9, 5), (0.9, 5)], max_rows=8)) == 5
    assert sum(allocate(flat, 3, [(0.9, 5), (0.9, 5)])) == 10


def test_forced_drafts_have_their_own_acceptance():
    state = SpecState(NgramIndex(2, 3), match=2)
    state.forced = 2
    assert state.rates(4) == [INITIAL_FORCED_ACCEPTANCE] * 2 + [INITIAL_ACCEPTANCE] * 2
    state.record(4, 2)  # both forced kept, the first n-gram draft rejected
    assert state.forced_acceptance > INITIAL_FORCED_ACCEPTANCE and state.acceptance() < INITIAL_ACCEPTANCE
    # per-position rates: a sure first draft before weak ones is worth one row, not three
    assert allocate(CPU_LIKE, 1, [([1.0, 0.05, 0.05], 3)]) == [1]
