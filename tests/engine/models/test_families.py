"""The 2026 families end to end on the CPU in float32 against transformers 5.24's own
implementation, with tiny random-weight checkpoints built from each family's config class:
SmolLM3 (a layer without RoPE), Phi-3 (fused checkpoint projections; Phi-4-mini's partial rotary),
Gemma 2 (alternating 8-token windows, logit soft caps), Gemma 3 (five window layers per global
one, QK-norm, a RoPE base per layer type) and gpt-oss (alternating windows, sinks, biased MoE).

Prompts run several windows long over blocks of 4: logits of a prefill and of a decode through
the paged cache close to transformers', greedy tokens equal alone and batched; each family's
chat format renders through the engine; what a family lacks is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.model_input import ModelInput
from kvserve.engine.models.decode_row import DecodeRow
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.testing.engine import sequence_step
from kvserve.testing.random_model import make_config, write_model_dir

BLOCK = 4
FAMILIES = ["smollm3-tiny", "phi3-tiny", "phi4-mini-tiny", "gemma2-tiny", "gemma3-tiny", "gpt-oss-tiny"]
IDS = [5, 17, 250, 3, 99, 42, 7, 7, 1, 0, 123, 64, 31, 400, 2, 8, 8, 9, 1000, 77, 6, 13, 500, 21, 4]
PROMPTS = [list(range(100, 131)), [7, 3, 9000, 12, 5], list(range(2000, 2050, 2)), [42] * 19]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# gpt-oss with its SwiGLU clamp low enough to bite at these weights' scale
CLAMPED = ("gpt-oss-tiny", {"swiglu_limit": 0.05})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {name: str(write_model_dir(make_config(name), tmp_path_factory.mktemp(name), dtype=torch.float32))
            for name in FAMILIES}
    clamped = tmp_path_factory.mktemp("gpt-oss-clamped")
    dirs["gpt-oss-clamped"] = str(write_model_dir(make_config(CLAMPED[0], **CLAMPED[1]), clamped,
                                                  dtype=torch.float32))
    return dirs


def hf_model(path: str):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # every tensor of ours was read
    return model.eval()


# one sequence's seven blocks, out of order, in each KV cache group (up to six: Gemma 3's layers
# make six groups of one): the groups' layers share cache tensors, each at its own group's blocks
TABLES = [[7 * group + b for b in (5, 2, 6, 0, 3, 1, 4)] for group in range(6)]


def step(ids: list[int], start: int, all_logits: bool) -> ModelInput:
    """One sequence's tokens at ``start``.. through the paged cache."""
    return sequence_step(ids, start, TABLES, BLOCK, all_logits)


@pytest.mark.parametrize("name", [*FAMILIES, "gpt-oss-clamped"])
def test_family_logits_match_transformers(model_dirs, name):
    """Every prompt row's logits and one decode's, the blocks out of order in the cache."""
    path = model_dirs[name]
    runner = ModelRunner(EngineConfig(model=path, dtype="float32", device="cpu", num_kv_blocks=48,
                                      block_size=BLOCK))
    try:
        assert runner.kv_groups.num_groups <= len(TABLES)
        prefill = runner.execute_model(step(IDS[:-1], 0, all_logits=True))
        decode = runner.execute_model(step(IDS[-1:], len(IDS) - 1, all_logits=False))
    finally:
        runner.shutdown()
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(torch.cat([prefill, decode]), theirs, atol=1e-4, rtol=1e-4)


def greedy_tokens(llm: LLM, prompts) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_greedy_tokens_equal_transformers_alone_and_batched(model_dirs, name):
    llm = LLM(model_dirs[name], dtype="float32", device="cpu", block_size=BLOCK)
    try:
        batched = greedy_tokens(llm, PROMPTS)
        alone = [greedy_tokens(llm, [p])[0] for p in PROMPTS[:2]]
    finally:
        llm.shutdown()
    hf = hf_model(model_dirs[name])
    want = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        want.append(out[0, len(prompt):].tolist())
    assert batched == want
    assert alone == want[:2]


def test_each_layer_asks_for_its_own_variant(model_dirs):
    """Windows where layer_types put them, Gemma 2's soft cap, gpt-oss's sinks; every layer attends
    in the C kernel (soft cap and sinks in its portable loop); the fused decode step takes the soft
    cap (Gemma 2) and refuses sinks (gpt-oss: also a mixture of experts)."""
    want = {"gemma2-tiny": ([8, None, 8, None], 50.0, False), "gemma3-tiny": ([8] * 5 + [None], None, False),
            "gpt-oss-tiny": ([8, None], None, True), "smollm3-tiny": ([None] * 4, None, False)}
    for name, (windows, cap, sinks) in want.items():
        llm = LLM(model_dirs[name], dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=8)
        try:
            model = llm.engine.executor.model.model
            impls = [layer.self_attn.attn.impl for layer in model.layers]
            assert [impl.sliding_window for impl in impls] == windows
            assert {impl.logits_soft_cap for impl in impls} == {cap}
            assert {impl.has_sinks for impl in impls} == {sinks}
            assert all(impl.attends_in_c for impl in impls) == (load_kernels() is not None)
            assert DecodeRow.fits(model) == (load_kernels() is not None and bool(load_kernels().fused_rows)
                                             and not sinks)
        finally:
            llm.shutdown()


@pytest.mark.parametrize("name", ["smollm3-tiny", "phi3-tiny", "gemma2-tiny", "gpt-oss-tiny"])
def test_a_chat_request_renders_the_familys_format_through_the_engine(model_dirs, name):
    messages = [{"role": "system", "content": "<t5> <t6>"}, {"role": "user", "content": "<t7> <t8>"}]
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[name])
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    marks = {"smollm3-tiny": "<|im_start|>assistant\n", "phi3-tiny": "<|assistant|>\n",
             "gemma2-tiny": "<start_of_turn>user\n<t5> <t6>\n\n<t7> <t8><end_of_turn>",  # no system turn
             "gpt-oss-tiny": "<|start|>developer<|message|># Instructions"}
    assert marks[name] in text
    llm = LLM(model_dirs[name], dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=32)
    try:
        out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(out.prompt_token_ids) == tokenizer.encode(text, add_special_tokens=False)
    assert len(out.token_ids) == 4


def test_harmony_ends_a_turn_at_return_not_at_each_messages_end(model_dirs):
    from kvserve.engine.model_loader.loader import load_generation_eos
    from kvserve.engine.model_loader.source import resolve_model

    for name, ends, not_ends in (("gpt-oss-tiny", ["<|return|>", "<|call|>"], ["<|end|>"]),
                                 ("phi3-tiny", ["<|end|>"], [])):
        tokenizer = AutoTokenizer.from_pretrained(model_dirs[name])
        stops = load_generation_eos(resolve_model(model_dirs[name]), make_config(name), tokenizer)
        vocab = tokenizer.get_vocab()
        assert all(vocab[t] in stops for t in ends) and not any(vocab[t] in stops for t in not_ends)


@pytest.mark.parametrize("name, overrides, refusal", [
    ("gpt-oss-tiny", {"quantization_config": {"quant_method": "bitsandbytes"}},
     "GptOssForCausalLM with bitsandbytes weights"),
    ("gemma3-tiny", {"attn_logit_softcapping": 50.0}, "Gemma3ForCausalLM with attn_logit_softcapping"),
    ("gemma2-tiny", {"hidden_activation": "relu"}, "Gemma2ForCausalLM with hidden_activation 'relu'"),
])
def test_what_a_family_lacks_is_refused_by_name(name, overrides, refusal):
    from kvserve.engine.models import model_class_for

    with pytest.raises(ValueError, match=refusal):
        model_class_for(make_config(name, **overrides))


@pytest.mark.parametrize("name", ["phi3-tiny", "gpt-oss-tiny"])  # fused checkpoint tensors; sinks, experts
def test_family_at_tp2_gives_the_logits_of_tp1(model_dirs, name):
    from kvserve.engine.executor.executor import create_executor

    config = EngineConfig(model=model_dirs[name], dtype="float32", device="cpu", num_kv_blocks=48,
                          block_size=BLOCK, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=8)
    runs = []
    for tp in (1, 2):
        executor = create_executor(config.replace(tensor_parallel_size=tp))
        try:
            runs.append(torch.cat([executor.execute_model(step(IDS[:-1], 0, True)),
                                   executor.execute_model(step(IDS[-1:], len(IDS) - 1, False))]))
        finally:
            executor.shutdown()
    torch.testing.assert_close(runs[1], runs[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gemma2-tiny", "gpt-oss-tiny"])  # the soft cap; sinks
def test_chunking_preemption_and_prefix_hits_leave_a_variant_models_tokens_unchanged(model_dirs, name):
    shared = list(range(300, 324))  # six blocks shared by the last two prompts, three windows long
    prompts = [*PROMPTS, shared + [11, 12], shared + [13]]
    alone = LLM(model_dirs[name], dtype="float32", device="cpu", block_size=BLOCK,
                enable_prefix_caching=False)
    try:
        want = [greedy_tokens(alone, [p])[0] for p in prompts]
    finally:
        alone.shutdown()
    # 24 blocks of 4 slots for six sequences of up to 43 tokens; 8-token steps chunk the prompts
    squeezed = LLM(model_dirs[name], dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=24,
                   max_num_batched_tokens=8, max_num_seqs=4)
    try:
        assert greedy_tokens(squeezed, prompts) == want
        assert squeezed.stats().num_preemptions > 0
        # their prefix was cached (in so small a pool the first may find it evicted; the second
        # then hits the first's)
        warm = squeezed.generate(prompts[-2:], GREEDY, use_tqdm=False)
        assert [list(o.token_ids) for o in warm] == want[-2:]
        assert max(o.cached_tokens for o in warm) >= 16
    finally:
        squeezed.shutdown()


def test_phi3_and_smollm3_keep_the_fused_decode_step_and_partial_rotary_does_not(model_dirs):
    from kvserve.kernels.cpu.bindings import load_kernels

    kernels = load_kernels()
    fused_here = kernels is not None and bool(kernels.fused_rows)  # (x86 builds)
    for name, fits in (("phi3-tiny", fused_here), ("phi4-mini-tiny", False), ("smollm3-tiny", fused_here)):
        llm = LLM(model_dirs[name], dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=8)
        try:
            assert (llm.engine.executor.model.model.decode_row() is not None) == fits, name
        finally:
            llm.shutdown()


def test_smollm3_in_the_fused_decode_step_keeps_the_per_op_paths_tokens_and_logprobs(model_dirs):
    """decode_row.c leaves a NoPE layer's q and k unturned (``row_layer_t.rope``), as the per-op
    path does: its greedy tokens equal with the fused step off, and its log-probabilities agree to
    float32's last digits (at this 16-wide head the two paths' attention sums differ in order, as
    they do for a Llama of that shape)."""
    from kvserve.engine.models.decode_row import DecodeRow
    from kvserve.kernels.cpu.bindings import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.fused_rows:
        pytest.skip("the fused decode step is built for x86 CPUs")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    llm = LLM(model_dirs["smollm3-tiny"], dtype="float32", device="cpu", block_size=BLOCK)
    try:
        model = llm.engine.executor.model.model
        assert [layer.self_attn.use_rope for layer in model.layers] == [True, True, True, False]
        runs = []
        for fused in (True, False):
            model._decode_row = DecodeRow(model) if fused else None
            outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
            runs.append([(list(o.token_ids), [lp.logprob for lp in o.logprobs]) for o in outs])
    finally:
        llm.shutdown()
    assert [tokens for tokens, _ in runs[0]] == [tokens for tokens, _ in runs[1]]
    fused, per_op = (torch.tensor([lps for _, lps in run]) for run in runs)
    torch.testing.assert_close(fused, per_op, rtol=0, atol=1e-5)
