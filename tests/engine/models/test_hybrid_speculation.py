"""Speculative decoding on the linear-attention hybrids (Qwen3.5, Qwen3-Next), float32, tiny random
checkpoints (``kvserve.testing.engine.scaled_hybrid_model``): with n-gram drafts on, every request gives the
tokens it gives with them off (greedy and seeded; single, batched, chunked prefill, a prefix-cache
hit, preemption), drafts are verified and partly rejected, and after a partly rejected verification
the slot's conv window and recurrent state equal, bit for bit, those plain decoding reaches.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.kv_cache.state_slots import StateSlots
from kvserve.engine.layers.gated_delta import row_waves
from kvserve.engine.sequence import Sequence
from kvserve.engine.spec_decode.speculator import Speculator
from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.testing.engine import (
    ECHO_BASES,
    ECHO_GREEDY,
    FLAT_STEP_COSTS,
    HYBRID_BLOCK,
    assert_partly_rejected,
    assert_slots_all_free,
    echo_prompts,
    greedy_tokens,
    scaled_hybrid_model,
)

BASES, GREEDY = ECHO_BASES, ECHO_GREEDY
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)


def speculating(path: str, **config) -> LLM:
    """An engine with n-gram drafts whose step-cost table makes up to 8 rows nearly free
    (``testing.engine.FLAT_STEP_COSTS``): the drafts do not depend on what the start-up measurement
    gave on a busy machine; no step-time bound, which would cut prefill chunks by wall time, and
    steps that prefill verify no drafts."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, threads=1, speculative="ngram",
              max_step_time_ms=0, **config)
    llm.engine.speculator = Speculator(llm.engine.config, FLAT_STEP_COSTS, llm.engine.executor.exact_rows())
    return llm


def echo(path: str, bases=BASES) -> list[list[int]]:
    """``testing.engine.echo_prompts`` of ``bases`` on a plain engine of ``path``."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, threads=1)
    try:
        return echo_prompts(llm, bases)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return scaled_hybrid_model("qwen3.5-tiny", tmp_path_factory.mktemp("qwen3.5-spec"))


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return echo(model_dir)


def on_and_off(path: str, prompts, params=GREEDY, together: bool = True, **config):
    """The tokens of each prompt alone without speculation, and with n-gram drafts (all at once, or
    each alone), each engine built with ``config``; the speculative engine's stats. Every slot and
    block is free at the end. (The plain arm runs alone, as tests/engine/core/test_speculation.py's:
    without speculation a step of several decode rows may multiply in other kernels.)"""
    out = []
    for mode in ("off", "ngram"):
        llm = (speculating(path, **config) if mode == "ngram"
               else LLM(path, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, threads=1,
                        max_step_time_ms=0, **config))
        try:
            at_once = together and mode == "ngram"
            out.append(greedy_tokens(llm, prompts, params) if at_once
                       else [greedy_tokens(llm, [p], params)[0] for p in prompts])
            stats = llm.stats()
            assert_slots_all_free(llm)
            assert stats.kv_blocks_free == stats.kv_blocks_total
        finally:
            llm.shutdown()
    return out[0], out[1], stats


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculation_gives_the_tokens_of_plain_decoding_alone_and_batched(model_dir, prompts, params):
    # seeded: each prompt alone in both arms. A batched prefill multiplies its rows as a runner that
    # does not speculate does (cpu_matmul.RowsAlike: only decode-only steps keep rows alike), so a
    # sampled token at temperature 0.9 may move with the batch; greedy tokens are compared batched
    plain, spec, stats = on_and_off(model_dir, prompts, params, together=params is GREEDY)
    assert spec == plain
    if params is GREEDY:  # (sampled at temperature 0.9, the tiny model's tokens stop echoing)
        assert_partly_rejected(stats)
    assert stats.spec_decode_num_draft_tokens > 0
    plain, spec, stats = on_and_off(model_dir, prompts[:2], params, together=False)
    assert spec == plain
    assert stats.spec_decode_num_draft_tokens > 0


def test_speculation_under_chunked_prefill_and_preemption_gives_the_same_tokens(model_dir, prompts):
    # chunks of 37 tokens beside two decoding sequences (steps mix chunks with verifications)
    plain, spec, stats = on_and_off(model_dir, prompts, max_num_batched_tokens=37, max_num_seqs=2)
    assert spec == plain
    assert_partly_rejected(stats)
    # 20 blocks of 16 for four prompts of 84 to 104 tokens growing by 24: the later ones yield
    plain, spec, stats = on_and_off(model_dir, prompts, num_kv_blocks=20, max_num_batched_tokens=64,
                                    max_num_seqs=4)
    assert spec == plain
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0


def test_a_prefix_cache_hit_under_speculation_gives_the_tokens_of_a_cold_run(model_dir, prompts):
    """The first prompt's prefill keeps the (committed) state at its checkpoint, 96 tokens; the
    second, its first 100 tokens, hits there and computes 4 tokens; both verify drafts."""
    pair = [prompts[0], prompts[0][:100]]
    cold = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, threads=1,
               enable_prefix_caching=False)
    try:
        want = [greedy_tokens(cold, [p], GREEDY)[0] for p in pair]
    finally:
        cold.shutdown()
    llm = speculating(model_dir)
    try:
        first = llm.generate([pair[0]], GREEDY, use_tqdm=False)[0]
        second = llm.generate([pair[1]], GREEDY, use_tqdm=False)[0]
        assert (first.cached_tokens, second.cached_tokens) == (0, 96)
        assert llm.stats().state_snapshot_hits == 1
        assert [list(first.token_ids), list(second.token_ids)] == want
        assert llm.stats().spec_decode_num_draft_tokens > 0
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


def test_qwen3_next_speculation_gives_the_tokens_of_plain_decoding(tmp_path):
    path = scaled_hybrid_model("qwen3-next-tiny", tmp_path)
    plain, spec, stats = on_and_off(path, echo(path, BASES[:3]), max_num_batched_tokens=64)
    assert spec == plain
    assert_partly_rejected(stats)


def _slot_state(llm: LLM, seq) -> tuple[torch.Tensor, torch.Tensor]:
    cache = llm.engine.executor.state_cache
    return cache.conv[:, seq.state_slot].clone(), cache.recurrent[:, seq.state_slot].clone()


def test_after_a_partly_rejected_verification_the_state_is_that_of_plain_decoding(model_dir, prompts):
    """Step a speculative engine until a verification keeps only some of its drafts; the rollback
    it queues, applied, leaves the slot's conv windows and recurrent states of every linear layer
    equal to those of a plain engine at the same token: bit for bit where the CPU kernels compute a
    verification's rows as plain decode rows (``RowsAlike``, the C decode step); with them off
    (``KVSERVE_CPU_KERNELS=0``) the projections' GEMMs round by row count, up to float32's last bits."""
    exact = load_kernels() is not None
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    spec = speculating(model_dir)
    plain = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, threads=1)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        spec.engine.add_request("r", prompts[0], params)
        plain.engine.add_request("r", prompts[0], params)
        seq, plain_seq, checked = spec.engine.requests["r"].seq, plain.engine.requests["r"].seq, 0
        slots = spec.engine.block_manager.state_slots
        while spec.engine.has_unfinished_requests() and checked < 3:
            spec.engine.step()
            rollbacks = slots.take_rollbacks()
            if not rollbacks or seq.is_finished:
                continue
            ((slot, kept),) = rollbacks
            assert slot == seq.state_slot and kept >= 1
            before = _slot_state(spec, seq)  # the state after every verified row
            spec.engine.executor.state_cache.roll_back(rollbacks)
            while plain_seq.num_tokens < seq.num_tokens:
                plain.engine.step()
            assert plain_seq.token_ids == seq.token_ids
            assert plain_seq.num_computed_tokens == seq.num_computed_tokens
            after, want = _slot_state(spec, seq), _slot_state(plain, plain_seq)
            assert not torch.equal(before[1], want[1])  # the rows it rejected had moved the state on
            assert same(after[0], want[0]) and same(after[1], want[1])
            checked += 1
        assert checked > 0
    finally:
        spec.shutdown()
        plain.shutdown()


def test_row_waves_step_each_slot_once_per_wave_in_order():
    assert row_waves([3, 3, 3, 1, 2, 2]) == [[0, 3, 4], [1, 5], [2]]
    assert row_waves([0, 1, 2]) == [[0, 1, 2]]


def test_a_slot_given_back_drops_its_pending_rollback():
    slots = StateSlots(2)
    a, b = (Sequence(f"r{i}", [1, 2, 3], GREEDY) for i in range(2))
    slots.take(a)
    slots.take(b)
    slots.rollback(a, 2)
    slots.rollback(b, 1)
    slots.release(a)
    assert slots.take_rollbacks() == [[b.state_slot, 1]]
    assert slots.take_rollbacks() == []
