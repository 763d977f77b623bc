"""Qwen3.5 and Qwen3-Next at tensor_parallel_size=2 on the CPU, float32, tiny random checkpoints
(``Qwen3_5TextConfig`` / ``Qwen3NextConfig`` shapes: 2 key heads, 4 value heads, so one key head
and its two value heads per rank; the linear layers' weights scaled up so that their state steers
the tokens): the Gated DeltaNet heads split across ranks as attention heads do, each rank keeping
its heads' state. Logits equal TP=1's, greedy tokens equal transformers' alone, batched, under
chunked prefill with preemption, after a prefix-cache hit (a snapshot on each rank) and for n > 1;
a size that does not divide the linear layers' key heads is refused by name before any process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.engine import LLM
from kvserve.engine.config import EngineConfig
from kvserve.engine.executor.executor import check_tensor_parallel, create_executor
from kvserve.engine.models.qwen3_5 import state_shapes
from kvserve.testing.engine import (
    HYBRID_BLOCK,
    HYBRID_GREEDY,
    HYBRID_PROMPTS,
    assert_slots_all_free,
    greedy_tokens,
    hf_greedy,
    scaled_hybrid_model,
    sequence_step,
)
from kvserve.testing.random_model import make_config

IDS = HYBRID_PROMPTS[2][:70]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-tp")
    return {name: scaled_hybrid_model(name, root / name) for name in ("qwen3.5-tiny", "qwen3-next-tiny")}


@pytest.fixture(scope="module")
def want(model_dirs) -> list[list[int]]:
    """Transformers' greedy tokens of HYBRID_PROMPTS on the Qwen3.5 checkpoint."""
    return hf_greedy(model_dirs["qwen3.5-tiny"], HYBRID_PROMPTS)


def tp2(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, tensor_parallel_size=2, **kwargs)


def prefill_then_decode(executor) -> torch.Tensor:
    """Logits of a 70-token prompt in two chunks (40 + 30: across a 64-token block of the rule)
    and three decode steps, on state slot 1."""
    tables, rows = [[3, 1, 7, 0, 5]], []
    for start, end in ((0, 40), (40, 70)):
        step = sequence_step(IDS[start:end], start, tables, HYBRID_BLOCK, state_slots=[1])
        rows.append(executor.execute_model(step))
    token = int(rows[-1][-1].argmax())
    for at in range(70, 73):
        rows.append(executor.execute_model(sequence_step([token], at, tables, HYBRID_BLOCK, state_slots=[1])))
        token = int(rows[-1][-1].argmax())
    return torch.cat(rows).cpu()


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3-next-tiny"])
def test_logits_at_tp2_equal_tp1_and_each_rank_holds_half_the_state(model_dirs, name):
    config = EngineConfig(model=model_dirs[name], dtype="float32", device="cpu", num_kv_blocks=16,
                          block_size=HYBRID_BLOCK, max_model_len=256, max_num_seqs=4)
    logits, state_bytes = {}, {}
    for tp in (1, 2):
        executor = create_executor(config.replace(tensor_parallel_size=tp))
        try:
            logits[tp] = prefill_then_decode(executor)
            state_bytes[tp] = executor.state_cache_bytes
            assert executor.num_state_slots == 4
            if tp == 2:  # Stats report the total over the ranks; each holds its heads' share
                assert executor.state_cache_bytes == 2 * executor.state_cache_bytes_per_rank
        finally:
            executor.shutdown()
    torch.testing.assert_close(logits[2], logits[1], atol=1e-4, rtol=1e-4)
    assert state_bytes[2] == state_bytes[1]
    hf_config = make_config(name)
    (channels, window), (heads, k_dim, v_dim) = state_shapes(hf_config, 2)
    assert heads == hf_config.linear_num_value_heads // 2
    key_size, value_size = hf_config.linear_num_key_heads * k_dim, hf_config.linear_num_value_heads * v_dim
    assert channels == (2 * key_size + value_size) // 2


def test_qwen3_5_at_tp2_gives_transformers_tokens_alone_batched_and_forked(model_dirs, want):
    llm = tp2(model_dirs["qwen3.5-tiny"])
    try:
        assert greedy_tokens(llm, HYBRID_PROMPTS) == want
        assert [greedy_tokens(llm, [p])[0] for p in HYBRID_PROMPTS[:2]] == want[:2]
        forked = llm.generate([HYBRID_PROMPTS[2]], dataclasses.replace(HYBRID_GREEDY, n=2), use_tqdm=False)[0]
        assert [list(c.token_ids) for c in forked.choices] == [want[2]] * 2
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


def test_qwen3_5_at_tp2_chunked_and_preempted_gives_transformers_tokens(model_dirs, want):
    """37-token steps (chunks across the conv window and the rule's blocks), 40 blocks of 16 for
    four prompts of up to 312 tokens: the later admitted are preempted and rebuild their state."""
    llm = tp2(model_dirs["qwen3.5-tiny"], num_kv_blocks=40, max_num_batched_tokens=37, max_num_seqs=4)
    try:
        assert greedy_tokens(llm, HYBRID_PROMPTS) == want
        assert llm.stats().num_preemptions > 0
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


def test_a_prefix_hit_at_tp2_restores_every_ranks_snapshot(model_dirs):
    """Two prompts sharing 64 tokens: the second takes the blocks and, on each rank, a copy of that
    rank's snapshot of its heads' state, and gives transformers' tokens of a cold run."""
    path = model_dirs["qwen3.5-tiny"]
    shared = [(11 * i + 5) % 7000 + 9 for i in range(64)]
    prompts = [shared + list(range(500, 510)), shared + list(range(900, 923))]
    want = hf_greedy(path, prompts)
    llm = tp2(path)
    try:
        first = llm.generate([prompts[0]], HYBRID_GREEDY, use_tqdm=False)[0]
        second = llm.generate([prompts[1]], HYBRID_GREEDY, use_tqdm=False)[0]
        assert (first.cached_tokens, second.cached_tokens) == (0, 64)
        assert [list(first.token_ids), list(second.token_ids)] == want
        assert llm.stats().state_snapshot_hits == 1
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


def test_qwen3_next_at_tp2_gives_transformers_tokens_batched_and_chunked(model_dirs):
    """Qwen3-Next: the per-key-head in_proj_qkvz / in_proj_ba split by key-head group, experts as
    the other mixtures split them."""
    path = model_dirs["qwen3-next-tiny"]
    want = hf_greedy(path, HYBRID_PROMPTS[1:3])
    llm = tp2(path, max_num_batched_tokens=37, max_num_seqs=2)
    try:
        assert greedy_tokens(llm, HYBRID_PROMPTS[1:3]) == want
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3-next-tiny"])
def test_a_tp_size_that_does_not_divide_the_linear_key_heads_is_refused_by_name(name):
    """2 key heads: TP=4 fits the 4 attention heads (the 2 KV heads replicated) but not the linear
    layers, refused before any process starts."""
    config = EngineConfig(model="unused", tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not fit the model's linear-attention "
                                         r"heads \(linear_num_key_heads=2, linear_num_value_heads=4\)"):
        check_tensor_parallel(config, make_config(name))
    check_tensor_parallel(config.replace(tensor_parallel_size=2), make_config(name))
