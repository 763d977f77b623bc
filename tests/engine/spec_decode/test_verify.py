"""Sample-then-match: which tokens a verification keeps, and what each row's sampler sees."""

from __future__ import annotations

from kvserve.engine.core.step_time import ScheduledSeq
from kvserve.engine.layers.sampling_batch import SamplingBatch
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence
from kvserve.engine.spec_decode.verify import accepted_run, sampling_rows


def test_the_run_ends_at_the_first_mismatch_or_takes_the_bonus_token():
    assert accepted_run([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accepted_run([1, 2, 3], [1, 9, 3, 4]) == [1, 9]
    assert accepted_run([1, 2, 3], [7, 2, 3, 4]) == [7]


def test_each_row_sees_the_earlier_drafts_as_its_own_tokens():
    seq = Sequence("r", [10, 11, 12], SamplingParams(seed=1, repetition_penalty=1.2, presence_penalty=0.5,
                                                     min_tokens=3))
    seq.token_ids.append(13)
    seq.num_computed_tokens = 3
    plain = Sequence("p", [1, 2], SamplingParams())
    plain.num_computed_tokens = 1
    rows = sampling_rows([ScheduledSeq(plain, 1), ScheduledSeq(seq, 3, [14, 15])])
    assert rows.counts == [1, 3]
    assert rows.seqs == [plain, seq, seq, seq] and rows.drafts == [[], [], [14], [14, 15]]
    batch = SamplingBatch.of(rows.seqs, [99], 100, rows.drafts)  # EOS 99
    assert batch.positions == [2, 4, 5, 6]  # a seeded draw is keyed by the row's absolute position
    assert batch.seen_tokens[3] == [10, 11, 12, 13, 14, 15] and batch.output_tokens[3] == [13, 14, 15]
    assert batch.seen_tokens[1] == [10, 11, 12, 13] and batch.seen_tokens[0] is None
    # min_tokens 3: the rows after 1 and 2 completion tokens may not end it, the row after 3 may
    assert batch.forbidden[1:] == [[99], [99], []]
