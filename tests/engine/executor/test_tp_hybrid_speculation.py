"""Speculative decoding under tensor parallelism on the linear-attention hybrids (Qwen3.5, Qwen3-Next),
float32, tiny random checkpoints (``kvserve.testing.engine.scaled_hybrid_model``: 2 key heads, so one
key head and its value heads per rank). Rank 0's engine proposes the n-gram drafts, samples, and
decides how many rows of each verification are kept; the rollback of a partly rejected verification
travels in the next step's ``ModelInput.state_rollbacks`` to every rank, and each rank puts back and
recomputes its own heads' states. With n-gram drafts on at TP=2, batched, under chunked prefill and
after a prefix-cache hit, every prompt gets the greedy tokens plain decoding gives it alone at TP=1;
drafts are both accepted and rejected, so the rollback really runs on both ranks.
"""

from __future__ import annotations

import pytest

from kvserve.engine import LLM
from kvserve.testing.engine import (
    ECHO_BASES,
    ECHO_GREEDY,
    HYBRID_BLOCK,
    assert_partly_rejected,
    assert_slots_all_free,
    echo_prompts,
    greedy_tokens,
    scaled_hybrid_model,
    with_control_plane,
)

BASES, GREEDY = ECHO_BASES, ECHO_GREEDY


@pytest.fixture(scope="module", params=["qwen3.5-tiny", "qwen3-next-tiny"])
def case(request, tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    """The checkpoint, its echo prompts, and the greedy tokens of each alone at TP=1 without
    speculation or prefix caching."""
    path = scaled_hybrid_model(request.param, tmp_path_factory.mktemp(request.param))
    llm = LLM(path, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, threads=1, max_step_time_ms=0,
              enable_prefix_caching=False)
    try:
        prompts = echo_prompts(llm, BASES)
        want = [greedy_tokens(llm, [p], GREEDY)[0] for p in prompts]
    finally:
        llm.shutdown()
    return path, prompts, want


@pytest.fixture(scope="module")
def spec_tp2(case):
    """n-gram drafts at TP=2 (drafts priced by a fixed step-cost table, not by the start-up's
    measurement on a busy machine), prefills in steps of 37 tokens: chunks across the conv window
    and the blocks, beside sequences that verify drafts."""
    llm = LLM(case[0], dtype="float32", device="cpu", block_size=HYBRID_BLOCK, tensor_parallel_size=2,
              speculative="ngram", max_step_time_ms=0, max_num_batched_tokens=37, max_num_seqs=4)
    try:
        yield with_control_plane(llm, speculative="ngram")
    finally:
        llm.shutdown()


def test_speculation_at_tp2_batched_and_chunked_gives_the_tokens_of_plain_decoding_at_tp1(case, spec_tp2):
    _, prompts, want = case
    before = spec_tp2.stats()
    assert greedy_tokens(spec_tp2, prompts, GREEDY) == want
    stats = spec_tp2.stats()
    assert_partly_rejected(stats, before)
    assert spec_tp2.engine.is_healthy()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert_slots_all_free(spec_tp2)


def test_a_prefix_hit_under_speculation_at_tp2_gives_the_tokens_of_a_cold_run(case, spec_tp2):
    """The first prompt (104 tokens) keeps its committed state at its checkpoint, 96 tokens, on each
    rank (or already has, from the test above); sent again, it hits there, takes each rank's
    snapshot of its heads, computes the last 8 tokens and verifies drafts."""
    _, prompts, want = case
    first = spec_tp2.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    hits, drafted = spec_tp2.stats().state_snapshot_hits, spec_tp2.stats().spec_decode_num_draft_tokens
    again = spec_tp2.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    assert again.cached_tokens == (len(prompts[0]) - 1) // HYBRID_BLOCK * HYBRID_BLOCK == 96
    assert spec_tp2.stats().state_snapshot_hits == hits + 1
    assert spec_tp2.stats().spec_decode_num_draft_tokens > drafted
    assert list(first.token_ids) == list(again.token_ids) == want[0]
    assert_slots_all_free(spec_tp2)
