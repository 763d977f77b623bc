"""Mistral (a window on every layer) and Ministral (windows on some layers, from ``layer_types``)
end to end on the CPU in float32, with tiny random-weight checkpoints from transformers 5.24's own
config classes: a window of 8 tokens over blocks of 4, prompts several windows long, greedy tokens
equal to transformers' alone and batched."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.testing.random_model import make_config, write_model_dir

BLOCK = 4
PROMPTS = [list(range(100, 131)), [7, 3, 9000, 12, 5], list(range(2000, 2050, 2)), [42] * 19]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: str(write_model_dir(make_config(name), tmp_path_factory.mktemp(name), dtype=torch.float32))
            for name in ("mistral-tiny", "ministral-tiny")}


def hf_greedy(path: str, prompts) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=14, min_new_tokens=14,
                                 do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


def greedy_tokens(llm: LLM, prompts) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", ["mistral-tiny", "ministral-tiny"])
def test_window_models_greedy_tokens_equal_transformers_alone_and_batched(model_dirs, name):
    llm = LLM(model_dirs[name], dtype="float32", device="cpu", block_size=BLOCK)
    try:
        layers = llm.engine.executor.model.model.layers
        windows = [layer.self_attn.attn.impl.sliding_window for layer in layers]
        assert windows == ([8, 8] if name == "mistral-tiny" else [8, None, 8])
        batched = greedy_tokens(llm, PROMPTS)
        alone = [greedy_tokens(llm, [p])[0] for p in PROMPTS[:2]]
    finally:
        llm.shutdown()
    want = hf_greedy(model_dirs[name], PROMPTS)
    assert batched == want
    assert alone == want[:2]


def test_the_fused_decode_step_takes_window_models_of_one_group_and_of_several(model_dirs):
    """Mistral (one group, a window on every layer) and Ministral (three groups) decode through
    decode_row.c, each layer on its own group's block tables: their tokens are transformers'."""
    from kvserve.kernels.cpu.bindings import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.fused_rows:
        pytest.skip("the fused decode step is built for x86 CPUs")
    for name in ("mistral-tiny", "ministral-tiny"):
        llm = LLM(model_dirs[name], dtype="float32", device="cpu", block_size=BLOCK)
        try:
            assert llm.engine.executor.model.model.decode_row() is not None, name
            assert greedy_tokens(llm, PROMPTS) == hf_greedy(model_dirs[name], PROMPTS)
        finally:
            llm.shutdown()


def test_a_family_without_window_support_is_still_refused():
    from kvserve.engine.models import model_class_for

    config = make_config("mixtral-tiny", sliding_window=8)
    with pytest.raises(ValueError, match="MixtralForCausalLM with sliding_window=8"):
        model_class_for(config)


def test_preemption_chunking_prefix_hits_and_forks_leave_window_model_tokens_unchanged(model_dirs):
    """Ministral (window, full and window groups) under a cache of 40 blocks of 4 (preemption), a
    6-token step budget (chunked prefill), prompts sharing 6 full blocks (prefix hits) and n = 2."""
    path = model_dirs["ministral-tiny"]
    shared = list(range(300, 324))
    prompts = [*PROMPTS, shared + [11, 12, 13], shared + [14]]
    alone = LLM(path, dtype="float32", device="cpu", block_size=BLOCK, enable_prefix_caching=False)
    try:
        want = [greedy_tokens(alone, [p])[0] for p in prompts]
    finally:
        alone.shutdown()
    squeezed = LLM(path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=40,
                   max_num_batched_tokens=6, max_num_seqs=4)
    try:
        assert greedy_tokens(squeezed, prompts) == want
        stats = squeezed.stats()
        assert stats.num_preemptions > 0 and stats.kv_blocks_free == stats.kv_blocks_total == 39
        squeezed.generate(prompts[-2:-1], GREEDY, use_tqdm=False)  # (the run above may have evicted it)
        warm = squeezed.generate(prompts[-1:], GREEDY, use_tqdm=False)[0]  # 6 shared blocks cached
        assert list(warm.token_ids) == want[-1] and warm.cached_tokens == 24
        two = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, n=2)
        forked = squeezed.generate([prompts[0]], two, use_tqdm=False)[0]
        assert [list(c.token_ids) for c in forked.choices] == [want[0], want[0]]
        assert squeezed.stats().kv_blocks_free == 39
    finally:
        squeezed.shutdown()


def test_speculative_decoding_leaves_window_model_tokens_unchanged(model_dirs):
    path, prompts = model_dirs["mistral-tiny"], [[5, 6, 7, 8, 9] * 6, [1, 2, 3] * 9]
    plain = LLM(path, dtype="float32", device="cpu", block_size=BLOCK)
    try:
        want = greedy_tokens(plain, prompts)
    finally:
        plain.shutdown()
    spec = LLM(path, dtype="float32", device="cpu", block_size=BLOCK, speculative="ngram")
    try:
        assert greedy_tokens(spec, prompts) == want
        assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total
    finally:
        spec.shutdown()


def test_window_model_at_tp2_gives_the_tokens_of_tp1(model_dirs):
    """Ministral's groups on two ranks (a KV head each): every rank keeps the groups' tables."""
    path = model_dirs["ministral-tiny"]
    want = hf_greedy(path, PROMPTS[:2])
    llm = LLM(path, dtype="float32", device="cpu", block_size=BLOCK, tensor_parallel_size=2,
              num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=8, max_num_seqs=2)
    try:
        assert llm.engine.block_manager.windows == (8, 8, None)
        assert greedy_tokens(llm, PROMPTS[:2]) == want
    finally:
        llm.shutdown()
