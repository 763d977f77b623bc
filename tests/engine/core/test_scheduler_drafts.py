"""The scheduler with draft tokens (speculative decoding), without a model: drafts fit the budget,
max_tokens, max_model_len and the free blocks, never preempt; rejected drafts' slots go back;
only committed tokens are hashed; a run ends at the first token that ends the sequence; and a
prompt's last token is computed alone when asked."""

from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.model_input import build_model_input
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import FinishReason, Sequence

BS = 4
EOS = 0


def make(num_blocks=64, budget=64, max_model_len=256, alone=False):
    return Scheduler(BlockManager(num_blocks, BS, True), 8, budget, max_model_len, [EOS],
                     last_prompt_token_alone=alone)


def decoding(s: Scheduler, prompt=5, max_tokens=20, first=1) -> Sequence:
    """A sequence past its prefill, its first token sampled."""
    seq = Sequence(f"r{first}", list(range(first, first + prompt)), SamplingParams(max_tokens=max_tokens))
    s.add(seq)
    out = s.schedule()
    s.postprocess(out, [50] * len(out.sampling_seqs))
    return seq


def test_drafts_ride_as_extra_rows_and_rejected_ones_give_their_blocks_back():
    s = make()
    seq = decoding(s, prompt=7)  # 8 tokens, 7 computed: 2 blocks
    seq.draft_token_ids = [60, 61, 62, 63, 64]
    out = s.schedule()
    (sched,) = out.scheduled
    assert (sched.num_tokens, sched.drafts, sched.samples) == (6, [60, 61, 62, 63, 64], True)
    assert len(seq.block_table) == 4  # positions up to 12
    inp = build_model_input(out.scheduled, BS)
    assert inp.query_lens == [1] * 6 and inp.positions == list(range(7, 13))
    assert inp.input_ids == [50, 60, 61, 62, 63, 64] and inp.context_lens == list(range(8, 14))
    assert inp.logits_indices == list(range(6))
    s.postprocess(out, [[60, 61, 99]])  # two drafts kept, the third rejected: 99 sampled there
    assert seq.token_ids[-4:] == [50, 60, 61, 99]
    assert seq.num_computed_tokens == 10 and seq.num_tokens == 11
    assert len(seq.block_table) == 3  # the block of positions 12.. held only rejected drafts
    assert seq.num_hashed_blocks == 2  # committed full blocks only
    s.bm.check_integrity()


def test_drafts_never_overshoot_max_tokens_nor_max_model_len_nor_the_budget():
    s = make(budget=4)
    seq = decoding(s, prompt=3, max_tokens=3)  # 1 completion token: 2 more allowed, so at most 1 draft
    seq.draft_token_ids = [60, 61, 62]
    assert s.schedule().scheduled[0].drafts == [60]
    s = make(max_model_len=8)
    seq = decoding(s, prompt=5, max_tokens=None)  # 6 tokens of 8: the run may add 2, so 1 draft
    seq.draft_token_ids = [60, 61, 62]
    assert s.schedule().scheduled[0].drafts == [60]
    s = make(budget=3)
    seq = decoding(s, prompt=3)
    seq.draft_token_ids = [60, 61, 62, 63]
    assert s.schedule().scheduled[0].drafts == [60, 61]


def test_drafts_never_take_blocks_others_need_nor_preempt():
    s = make(num_blocks=4)
    b = decoding(s, prompt=3, max_tokens=8, first=100)  # decoded once more while a prefilled
    a = decoding(s, prompt=3, max_tokens=8, first=1)  # 4 tokens, 3 computed: one block
    assert (len(b.block_table), len(a.block_table), s.bm.num_free_blocks) == (1, 1, 2)
    a.draft_token_ids = [7, 8, 9, 10, 11, 12]
    out = s.schedule()
    assert s.num_preemptions == 0 and not out.preempted
    assert len(out.scheduled) == 2
    # b's next token takes a block first; the one left holds a's positions 4..7
    assert [x.drafts for x in out.scheduled] == [[], [7, 8, 9, 10]]
    assert s.bm.num_free_blocks == 0
    s.bm.check_integrity()


def test_a_run_ends_at_the_first_token_that_ends_the_sequence():
    s = make()
    seq = decoding(s)
    seq.draft_token_ids = [60, EOS, 61]
    out = s.schedule()
    s.postprocess(out, [[60, EOS, 61, 62]])
    assert seq.completion_token_ids == [50, 60, EOS]
    assert seq.finish_reason is FinishReason.STOP
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_the_last_prompt_token_is_computed_alone_when_asked():
    """Only for seeded requests (the ones promised the same tokens with or without a cache hit):
    the others do not wait a step longer for their first token."""
    s = make(alone=True)
    seq = Sequence("r", list(range(1, 11)), SamplingParams(max_tokens=4, seed=7))
    s.add(seq)
    out = s.schedule()
    assert [(x.num_tokens, x.samples) for x in out.scheduled] == [(9, False)]
    s.postprocess(out, [])
    out = s.schedule()
    assert [(x.num_tokens, x.samples) for x in out.scheduled] == [(1, True)]
    unseeded = make(alone=True)
    unseeded.add(Sequence("u", list(range(1, 11)), SamplingParams(max_tokens=4)))
    assert [(x.num_tokens, x.samples) for x in unseeded.schedule().scheduled] == [(10, True)]


def test_no_drafts_in_a_step_that_prefills():
    s = make()
    seq = decoding(s)
    s.add(Sequence("late", list(range(200, 209)), SamplingParams(max_tokens=4)))
    seq.draft_token_ids = [60, 61]
    out = s.schedule()
    scheduled = [(x.seq.request_id, x.num_tokens, x.drafts) for x in out.scheduled]
    assert scheduled == [("r1", 1, []), ("late", 9, [])]


def test_a_verification_that_rejects_drafts_rolls_the_state_back_to_its_kept_rows():
    """With state slots (a hybrid model): the verification's rows all carry the slot; kept 3 of 6
    rows queues (slot, 3) for the next step, before its copies; all kept queues nothing; a sequence
    that ends (or is preempted) before the next step drops its rollback with its slot."""
    s = Scheduler(BlockManager(64, BS, False, state_slots=2), 8, 64, 256, [EOS])
    seq = decoding(s, prompt=7)  # its prefill stopped at its checkpoint (4 tokens): one more step
    s.postprocess(out := s.schedule(), [50] * len(out.sampling_seqs))
    slot = seq.state_slot
    seq.draft_token_ids = [60, 61, 62, 63, 64]
    out = s.schedule()
    assert build_model_input(out.scheduled, BS).state_slots == [slot] * 6
    s.postprocess(out, [[60, 61, 99]])  # rows 50, 60, 61 kept
    seq.draft_token_ids = [70, 71]
    out = s.schedule()
    assert out.state_rollbacks == [[slot, 3]]
    s.postprocess(out, [[70, 71, 72]])  # all kept: the state after every row is the right one
    assert s.schedule().state_rollbacks == []
    other = decoding(s, prompt=3, first=30)  # (3 tokens: no full block before the last, no stop)
    other.draft_token_ids = [80, 81]
    out = s.schedule()
    s.postprocess(out, [[EOS], [7]])  # seq's run ends the sequence; other's keeps 1 row of 3
    assert seq.is_finished and s.bm.state_slots.take_rollbacks() == [[other.state_slot, 1]]
