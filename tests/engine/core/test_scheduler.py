"""Scheduler without a model: budget rules, mixed batches, chunking, preemption order, abort."""

import pytest

from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.model_input import build_model_input
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import FinishReason, Sequence, SequenceStatus

BS = 4
EOS = 0


def make(num_blocks=64, max_num_seqs=8, budget=64, max_model_len=256, caching=True):
    bm = BlockManager(num_blocks, BS, caching)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, [EOS])


def seq(n, rid=None, max_tokens=8, first=1, **kw):
    return Sequence(
        rid or f"r{n}-{first}", list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, **kw)
    )


def step(s: Scheduler, token=7):
    """One scheduling step where every sampling sequence draws ``token``."""
    out = s.schedule()
    s.postprocess(out, [token] * len(out.sampling_seqs))
    return out


def test_prefill_then_decode_one_token_each():
    s = make()
    a = seq(10)
    s.add(a)
    out = step(s)
    assert [(x.seq, x.num_tokens) for x in out.scheduled] == [(a, 10)]
    assert a.num_computed_tokens == 10 and a.num_tokens == 11
    out = step(s)
    assert [x.num_tokens for x in out.scheduled] == [1]


def test_token_budget_chunks_long_prompt_while_decodes_continue():
    s = make(budget=8)
    a = seq(3, "a")
    s.add(a)
    step(s)  # a prefilled, now decoding
    b = seq(20, "b", first=100)
    s.add(b)
    out = step(s)
    # a's decode token goes first, b gets the remaining 7 tokens of budget
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]
    assert b.num_completion_tokens == 0  # chunk did not reach the end: nothing sampled
    out = step(s)
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]
    out = step(s)
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 6)]
    assert b.num_completion_tokens == 1


def test_max_num_seqs_bounds_running():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(seq(4, f"r{i}", first=10 * i + 1))
    out = step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_preemption_takes_most_recent_and_requeues_at_head():
    s = make(num_blocks=6, budget=64)
    a, b, c = seq(8, "a", max_tokens=8), seq(8, "b", first=50, max_tokens=8), seq(4, "c", first=90)
    s.add(a)
    s.add(b)
    step(s)  # a and b take 2 blocks each + 1 each for the first decode token
    s.add(c)
    while s.num_preemptions == 0:
        admitted_order = list(s.running)
        out = step(s)
    victim = out.preempted[0]
    assert victim is admitted_order[-1]  # the most recently admitted one
    assert victim.status == SequenceStatus.WAITING and s.waiting[0] is victim
    assert victim.block_table == [] and victim.num_computed_tokens == 0
    s.bm.check_integrity()
    # everything still completes
    for _ in range(200):
        if not s.has_unfinished():
            break
        step(s)
    assert not s.has_unfinished()
    assert s.bm.num_free_blocks == 6
    assert all(x.finish_reason == FinishReason.LENGTH for x in (a, b, c))


def test_preempted_sequence_resumes_with_its_generated_tokens():
    s = make(num_blocks=5, budget=64)
    a, b = seq(8, "a", max_tokens=6), seq(7, "b", first=40, max_tokens=6)
    s.add(a)
    s.add(b)
    history = []
    while s.has_unfinished():
        out = step(s)
        history.append(out)
    assert s.num_preemptions >= 1
    assert a.completion_token_ids == [7] * 6 and b.completion_token_ids == [7] * 6
    assert s.bm.num_free_blocks == 5


def test_request_that_can_never_fit_is_refused():
    s = make(num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(seq(60, max_tokens=8))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(seq(16, max_tokens=8))  # 24 tokens = 6 blocks > 4


def test_eos_stop_token_and_min_tokens():
    s = make()
    a = seq(4, "a", min_tokens=2)
    s.add(a)
    step(s, token=EOS)  # below min_tokens: EOS does not stop
    assert not a.is_finished
    step(s, token=EOS)
    assert a.finish_reason == FinishReason.STOP
    b = seq(4, "b", first=20, stop_token_ids=[5])
    s.add(b)
    step(s, token=5)
    assert b.finish_reason == FinishReason.STOP
    c = seq(4, "c", first=30, ignore_eos=True, max_tokens=2)
    s.add(c)
    step(s, token=EOS)
    step(s, token=EOS)
    assert c.finish_reason == FinishReason.LENGTH


def test_abort_in_any_state_frees_blocks():
    s = make(budget=4)
    a, b = seq(10, "a"), seq(10, "b", first=40)
    s.add(a)
    s.add(b)
    step(s)  # a partly prefilled (4 of 10), b waiting
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    s.finish(a, FinishReason.ABORT)
    s.finish(b, FinishReason.ABORT)
    assert not s.has_unfinished() and s.bm.num_free_blocks == 64
    s.bm.check_integrity()


def test_fully_cached_prompt_is_scheduled_for_one_token():
    s = make()
    a = seq(8, "a", max_tokens=1)
    s.add(a)
    step(s)
    b = seq(8, "b", max_tokens=1)
    s.add(b)
    out = s.schedule()
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [("b", 4)]
    assert b.num_cached_prompt_tokens == 4


def test_model_input_layout_for_mixed_batch():
    s = make(budget=6)
    a = seq(3, "a")
    s.add(a)
    step(s)
    b = seq(9, "b", first=50)
    s.add(b)
    out = s.schedule()
    inp = build_model_input(out.scheduled, BS)
    assert inp.query_lens == [1, 5]
    assert inp.input_ids == [7, 50, 51, 52, 53, 54]
    assert inp.positions == [3, 0, 1, 2, 3, 4]
    assert inp.context_lens == [4, 5]
    assert inp.slot_mapping[0] == a.block_table[0] * BS + 3
    assert inp.slot_mapping[1:] == [b.block_table[0] * BS + i for i in range(4)] + [b.block_table[1] * BS]
    assert inp.logits_indices == [0]  # b's chunk does not reach its end
    assert type(inp).from_bytes(inp.to_bytes()) == inp


def test_unset_max_tokens_generates_up_to_max_model_len():
    s = make(max_model_len=40)
    a = seq(10, max_tokens=None)
    s.add(a)
    while not a.is_finished:
        step(s)
    assert a.num_tokens == 40 and a.finish_reason == FinishReason.LENGTH
    with pytest.raises(ValueError, match="leaves no room for a completion"):
        s.add(seq(40, max_tokens=None))


def test_unset_max_tokens_is_bounded_by_the_whole_kv_cache():
    s = make(num_blocks=5, max_model_len=256)  # 20 slots
    a = seq(6, max_tokens=None)
    s.add(a)
    while not a.is_finished:
        step(s)
    assert a.num_tokens == 20 and a.finish_reason == FinishReason.LENGTH
    assert s.bm.num_free_blocks == 5
