"""Sample-then-match: which tokens a verification keeps, and what each row's sampler sees."""

from __future__ import annotations

from kvserve.engine.core.scheduler import ScheduledSeq
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence
from kvserve.engine.spec_decode.verify import accepted_run, sampling_rows


def test_the_run_ends_at_the_first_mismatch_or_takes_the_bonus_token():
    assert accepted_run([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accepted_run([1, 2, 3], [1, 9, 3, 4]) == [1, 9]
    assert accepted_run([1, 2, 3], [7, 2, 3, 4]) == [7]


def test_each_row_sees_the_earlier_drafts_as_its_own_tokens():
    seq = Sequence("r", [10, 11, 12], SamplingParams(seed=1))
    seq.token_ids.append(13)
    seq.num_computed_tokens = 3
    plain = Sequence("p", [1, 2], SamplingParams())
    plain.num_computed_tokens = 1
    rows, counts = sampling_rows([ScheduledSeq(plain, 1), ScheduledSeq(seq, 3, [14, 15])])
    assert counts == [1, 3]
    assert rows[0] is plain and rows[1] is seq
    assert rows[3].token_ids == [10, 11, 12, 13, 14, 15]
    assert rows[3].completion_token_ids == [13, 14, 15]
    assert (rows[2].num_tokens, rows[2].num_completion_tokens) == (5, 2)
    assert rows[3].params is seq.params
