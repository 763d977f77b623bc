"""Qwen3.5 (Gated DeltaNet + gated full attention) and Qwen3-Next (the same with mixtures of
experts) end to end on the CPU in float32 against transformers 5.24, with tiny random-weight
checkpoints from ``Qwen3_5TextConfig`` / ``Qwen3NextConfig`` whose linear layers' weights are
scaled up so that their state visibly steers the tokens; and the state slots the sequences hold:
returned at finish, abort and preemption, a burst larger than the pool waits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.kv_cache.state_slots import turn_checkpoints
from kvserve.engine.layers import gated_delta
from kvserve.engine.sequence import Sequence
from kvserve.testing.engine import (
    HYBRID_BLOCK,
    HYBRID_GREEDY,
    HYBRID_PROMPTS,
    assert_slots_all_free,
    greedy_tokens,
    hf_greedy,
    scaled_hybrid_model,
)
from kvserve.testing.random_model import make_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return scaled_hybrid_model("qwen3.5-tiny", tmp_path_factory.mktemp("qwen3.5"))


@pytest.fixture(scope="module")
def want(model_dir) -> list[list[int]]:
    return hf_greedy(model_dir, HYBRID_PROMPTS)


def test_the_rule_in_chunks_of_any_size_matches_transformers_whole_sequence():
    """Chunks of 1, 2, 70, 3 and 74 tokens (inside the conv window, across 64-token blocks) carry the
    conv window and the recurrent state to the same outputs as transformers' rule over all 150."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    gen = torch.Generator().manual_seed(0)
    T, hk, hv, dk, dv, channels, kernel = 150, 2, 4, 8, 8, 12, 4
    q, k = torch.randn(T, hk, dk, generator=gen), torch.randn(T, hk, dk, generator=gen)
    v = torch.randn(T, hv, dv, generator=gen)
    g, beta = -torch.rand(T, hv, generator=gen), torch.rand(T, hv, generator=gen)
    want, _ = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                                  use_qk_l2norm_in_kernel=True)
    x, weight = torch.randn(T, channels, generator=gen), torch.randn(channels, kernel, generator=gen)
    conv_want = torch.nn.functional.silu(torch.nn.functional.conv1d(
        x.t()[None], weight[:, None], padding=kernel - 1, groups=channels)[0, :, :T]).t()
    state, conv_state = torch.zeros(hv, dk, dv), torch.zeros(channels, kernel - 1)
    outs, convs, start = [], [], 0
    for n in (1, 2, 70, 3, 74):
        span = slice(start, start + n)
        rule = gated_delta.delta_rule_recurrent if n == 1 else gated_delta.delta_rule_chunked
        states = state.unsqueeze(0) if n == 1 else state
        outs.append(rule(q[span], k[span], v[span], g[span], beta[span], states))
        convs.append(gated_delta.causal_conv(x[span], weight, conv_state))
        start += n
    torch.testing.assert_close(torch.cat(outs), want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(convs), conv_want, atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_transformers_alone_and_batched(model_dir, want):
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK)
    try:
        assert greedy_tokens(llm, HYBRID_PROMPTS) == want
        assert [greedy_tokens(llm, [p])[0] for p in HYBRID_PROMPTS[:2]] == want[:2]
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("chunk", [2, 37])  # inside the conv window (K - 1 = 3); across blocks
def test_chunked_prefill_leaves_the_tokens_unchanged(model_dir, want, chunk):
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, max_num_batched_tokens=chunk,
              max_num_seqs=2)
    try:
        prompts = HYBRID_PROMPTS if chunk > 2 else HYBRID_PROMPTS[2:]  # two-token steps: the shorter prompts
        assert greedy_tokens(llm, prompts) == (want if chunk > 2 else want[2:])
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


def test_preemption_rebuilds_the_state_and_leaves_the_tokens_unchanged(model_dir, want):
    # 40 blocks of 16 tokens for four prompts of up to 312 tokens: the later admitted are preempted
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, num_kv_blocks=40,
              max_num_batched_tokens=64, max_num_seqs=4)
    try:
        assert greedy_tokens(llm, HYBRID_PROMPTS) == want
        assert llm.stats().num_preemptions > 0
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


def test_n_choices_fork_with_a_copy_of_the_state_and_give_the_tokens_of_separate_requests(model_dir, want):
    """The choices share the prompt's full blocks and copy choice 0's state there (137 tokens: 128
    shared); greedy, each gives transformers' tokens; seeded, choice i gives what a request of
    seed + i alone gives."""
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3)
        out = llm.generate([HYBRID_PROMPTS[2]], greedy, use_tqdm=False)
        assert [list(c.token_ids) for c in out[0].choices] == [want[2]] * 3
        assert [c.cached_tokens for c in out[0].choices[1:]] == [128, 128]
        seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
        out = llm.generate([HYBRID_PROMPTS[2]], dataclasses.replace(seeded, n=3), use_tqdm=False)
        alone = [greedy_tokens(llm, [HYBRID_PROMPTS[2]], dataclasses.replace(seeded, seed=5 + i))[0]
                 for i in range(3)]
        assert [list(c.token_ids) for c in out[0].choices] == alone
        assert len({tuple(a) for a in alone}) > 1
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


def test_a_shared_64_token_prefix_hits_a_state_snapshot_and_gives_the_tokens_of_a_cold_run(model_dir):
    """The first prompt's prefill stops at the end of its last full block (64 tokens here) and keeps
    the state there; the second, sharing those 64 tokens, takes the blocks and a copy of that state
    and computes only its own 23 tokens."""
    shared = [(11 * i + 5) % 7000 + 9 for i in range(64)]
    prompts = [shared + list(range(500, 510)), shared + list(range(900, 923))]
    cold = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, enable_prefix_caching=False)
    try:
        want = [greedy_tokens(cold, [p])[0] for p in prompts]
        assert cold.stats().state_snapshots_total == 0
    finally:
        cold.shutdown()
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK)
    try:
        first = llm.generate([prompts[0]], HYBRID_GREEDY, use_tqdm=False)[0]
        second = llm.generate([prompts[1]], HYBRID_GREEDY, use_tqdm=False)[0]
        assert (first.cached_tokens, second.cached_tokens) == (0, 64)
        assert [list(first.token_ids), list(second.token_ids)] == want
        stats = llm.stats()
        assert stats.state_snapshot_hits == 1 and stats.state_snapshots_cached == 2  # at 64 and at 80
        assert_slots_all_free(llm)
        assert llm.engine.reset_prefix_cache().success
        assert llm.stats().state_snapshots_cached == 0
    finally:
        llm.shutdown()


def test_turn_checkpoints_are_the_first_turn_and_the_history_before_the_last_turn():
    end = 2
    assert turn_checkpoints([5] * 40, {end}, 16, 32) == ()  # a plain completion: its own checkpoint only
    ids = [5] * 69 + [end] + [6] * 39 + [end] + [7] * 34 + [end] + [8] * 19 + [end] + [9] * 3
    assert turn_checkpoints(ids, {end}, 16, 160) == (64, 144)  # turns end at 70, 110, 145, 165
    assert turn_checkpoints(ids, {end}, 16, 144) == (64,)  # none at or past the prompt's own
    assert turn_checkpoints([5] * 10 + [end] + [6] * 30, {end}, 16, 32) == ()  # the first block: none


def test_chat_turn_boundaries_keep_snapshots_that_other_conversations_hit(model_dir):
    """A system turn shared by another conversation, and a history shared by a branched one: the
    first prompt keeps its state at both turn boundaries (the ends of their last full blocks, 64 and
    144) besides its own checkpoint, and the others hit there with the tokens of a cold run."""
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK)
    end = min(llm.engine.scheduler.eos_token_ids)

    def turn(seed: int, n: int) -> list[int]:
        return [(31 * i + seed) % 7000 + 9 for i in range(n - 1)] + [end]

    system, user, reply, header = turn(1, 70), turn(2, 40), turn(3, 35), [11, 12, 13]
    prompts = [system + user + reply + turn(4, 20) + header, system + turn(5, 30) + header,
               system + user + reply + turn(6, 25) + header]
    params = dataclasses.replace(HYBRID_GREEDY, max_tokens=4)
    try:
        got = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert [o.cached_tokens for o in got] == [0, 64, 144]
        assert llm.stats().state_snapshot_hits == 2
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()
    cold = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, enable_prefix_caching=False)
    try:
        assert [list(o.token_ids) for o in got] == [greedy_tokens(cold, [p], params)[0] for p in prompts]
    finally:
        cold.shutdown()


def test_an_aborted_request_gives_its_slot_back(model_dir):
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, max_num_batched_tokens=64)
    try:
        engine = llm.engine
        for i, prompt in enumerate(HYBRID_PROMPTS[:3]):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                               ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert llm.stats().state_slots_free < llm.stats().state_slots_total
        assert engine.abort("r1")
        while engine.has_unfinished_requests():
            engine.step()
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


def test_qwen3_next_greedy_tokens_equal_transformers_batched_and_chunked(tmp_path):
    """Qwen3-Next: per-key-head projections regrouped, experts with a shared one."""
    path = scaled_hybrid_model("qwen3-next-tiny", tmp_path)
    prompts = HYBRID_PROMPTS[1:3]
    want = hf_greedy(path, prompts)
    llm = LLM(path, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, max_num_batched_tokens=37,
              max_num_seqs=2)
    try:
        assert greedy_tokens(llm, prompts) == want
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()


def test_a_burst_beyond_the_slots_waits_its_turn_and_every_slot_comes_back():
    """Control plane: 2 slots, 6 requests: two run at a time, all finish, nothing is wedged."""
    bm = BlockManager(64, 4, enable_prefix_caching=False, state_slots=2)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    seqs = [Sequence(f"r{i}", list(range(1, 10 + i)), SamplingParams(max_tokens=3, ignore_eos=True))
            for i in range(6)]
    for seq in seqs:
        scheduler.add(seq)
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        assert out.scheduled, "wedged: nothing scheduled while requests wait"
        assert len(scheduler.running) <= 2
        held = [s for s in scheduler.running if s.state_slot is not None]
        assert held == scheduler.running
        bm.state_slots.check_integrity(scheduler.running)
        scheduler.postprocess(out, [7] * len(out.sampling_seqs))
        steps += 1
        assert steps < 100
    assert all(s.is_finished for s in seqs)
    assert bm.state_slots.num_free == 2 and all(s.state_slot is None for s in seqs)


def test_prefix_caching_without_state_snapshots_is_refused():
    with pytest.raises(ValueError, match="prefix caching needs state snapshots"):
        BlockManager(8, 4, enable_prefix_caching=True, state_slots=2)


def test_the_state_slots_come_out_of_kv_cache_memory(model_dir):
    from kvserve.engine.runner.state_cache import slot_bytes

    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=HYBRID_BLOCK, max_num_seqs=8,
              kv_cache_memory=0.001)
    try:
        per_slot = slot_bytes(llm.engine.executor.model, torch.float32)
        stats = llm.stats()
        budget = int(0.001 * 2**30)  # half of it for the slots and as many snapshot rows
        assert stats.state_slots_total == stats.state_snapshots_total == min(8, budget // 2 // (2 * per_slot))
        assert stats.state_cache_bytes == 2 * stats.state_slots_total * per_slot
        block_bytes = llm.engine.executor.kv_block_bytes
        assert stats.kv_blocks_total == (budget - stats.state_cache_bytes) // block_bytes
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="kv_cache_memory .* cannot hold the recurrent state of one"):
        LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory=1e-6)


def test_a_hub_qwen3_5_checkpoint_serves_its_text_model_as_transformers_does(model_dir, tmp_path):
    """The Hub's Qwen3.5 checkpoints are ``Qwen3_5ForConditionalGeneration``: text settings under
    text_config, the decoder under model.language_model.*, a vision tower under model.visual.*, a
    multi-token-prediction head under mtp.*. The text weights load (the tower and the head are
    skipped, as transformers skips the head) and greedy tokens equal transformers' on text alone."""
    import shutil

    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    config = Qwen3_5Config(text_config=make_config("qwen3.5-tiny").to_dict(), vision_config=vision,
                           tie_word_embeddings=False, architectures=["Qwen3_5ForConditionalGeneration"])
    torch.manual_seed(0)
    hf_model = Qwen3_5ForConditionalGeneration(config).eval()
    text = {k.replace("model.", "model.language_model.", 1): v
            for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    missing, unexpected = hf_model.load_state_dict(text, strict=False)
    assert not unexpected and missing and all(k.startswith("model.visual.") for k in missing)
    hf_model.save_pretrained(tmp_path)
    saved = load_file(f"{tmp_path}/model.safetensors")
    saved["mtp.fc.weight"] = torch.zeros(64, 128)  # (transformers builds no MTP head to save)
    save_file(saved, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_dir}/{tokenizer_file}", tmp_path)
    prompts = HYBRID_PROMPTS[:2]
    with torch.no_grad():
        want = [hf_model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False)[0, len(p):].tolist() for p in prompts]
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=HYBRID_BLOCK)
    try:
        assert llm.engine.architecture == "Qwen3_5ForConditionalGeneration"
        assert greedy_tokens(llm, prompts) == want
        assert_slots_all_free(llm)
    finally:
        llm.shutdown()
