"""Qwen3-MoE, Mixtral and Qwen2-MoE (shared expert) end to end on the CPU, float32, with tiny
random-weight checkpoints (8 experts, top-2) written under Hugging Face's per-expert names.

- against transformers' own implementation on the same directory: logits close, greedy tokens
  equal (also a Qwen3-MoE with a dense layer and unnormalised top-k, saved by transformers);
- the engine's invariances on the MoE model: forced preemption, forced chunked prefill, prefix
  cache hits and other requests in the batch leave the greedy tokens unchanged;
- tensor parallel: two ranks give the tokens and the logits of one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.executor.executor import create_executor
from kvserve.engine.model_input import ModelInput
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.testing.random_model import make_config, write_model_dir

BLOCK = 16
IDS = [5, 17, 250, 3, 99, 42, 7, 7, 1, 0, 123, 64, 31, 400, 2, 8, 8, 9, 1000, 77]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 75)), [9000]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {name: str(write_model_dir(make_config(name), tmp_path_factory.mktemp(name), dtype=torch.float32))
            for name in ("qwen3-moe-tiny", "mixtral-tiny", "qwen2-moe-tiny")}
    # saved by transformers itself: its own initialisation and its own per-expert names, layer 1
    # dense (mlp_only_layers) and the top-k weights left unnormalised
    config = make_config("qwen3-moe-tiny", num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3-moe-hf")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    dirs["qwen3-moe-hf-saved"] = str(path)
    return dirs


def hf_model(path: str):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # every tensor of ours was read
    return model.eval()


def one_sequence(ids: list[int], start: int, blocks: list[int], all_logits: bool) -> ModelInput:
    end = start + len(ids)
    return ModelInput(
        input_ids=ids, positions=list(range(start, end)),
        query_lens=[len(ids)], context_lens=[end], block_tables=[blocks],
        slot_mapping=[blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)],
        logits_indices=list(range(len(ids))) if all_logits else [len(ids) - 1],
    )


def prefill_then_decode(executor, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt row and of one decode step through the paged cache."""
    blocks = [3, 1]
    prefill = executor.execute_model(one_sequence(ids[:-1], 0, blocks, all_logits=True))
    decode = executor.execute_model(one_sequence(ids[-1:], len(ids) - 1, blocks, all_logits=False))
    return torch.cat([prefill, decode]).cpu()


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny", "qwen3-moe-hf-saved", "qwen2-moe-tiny"])
def test_moe_logits_match_transformers(model_dirs, name):
    path = model_dirs[name]
    runner = ModelRunner(EngineConfig(model=path, dtype="float32", device="cpu", num_kv_blocks=8,
                                      block_size=BLOCK))
    try:
        ours = prefill_then_decode(runner, IDS)
    finally:
        runner.shutdown()
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def greedy_tokens(llm: LLM, prompts) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_moe_greedy_tokens_equal_transformers(model_dirs, name):
    llm = LLM(model_dirs[name], dtype="float32", device="cpu")
    try:
        ours = greedy_tokens(llm, PROMPTS)
    finally:
        llm.shutdown()
    hf = hf_model(model_dirs[name])
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert tokens == out[0, len(prompt):].tolist()


def test_qwen2_moe_with_int8_weights_runs_its_shared_expert_through_the_int8_path(model_dirs):
    llm = LLM(model_dirs["qwen2-moe-tiny"], dtype="float32", device="cpu", quantization="int8")
    try:
        shared = llm.engine.executor.model.model.layers[0].mlp.shared_expert
        assert shared.down_proj.quantized is not None and shared.down_proj.weight.numel() == 0
        tokens = greedy_tokens(llm, PROMPTS)
    finally:
        llm.shutdown()
    assert all(len(t) == 12 for t in tokens)


def test_preemption_chunking_prefix_hits_and_batching_leave_moe_tokens_unchanged(model_dirs):
    path = model_dirs["qwen3-moe-tiny"]
    shared = list(range(300, 348))  # three full blocks shared by the last two prompts
    prompts = [*PROMPTS, shared + [11, 12], shared + [13]]
    alone = LLM(path, dtype="float32", device="cpu", enable_prefix_caching=False)
    try:
        want = [greedy_tokens(alone, [p])[0] for p in prompts]
    finally:
        alone.shutdown()
    # 5 blocks of 16 slots for six sequences of up to 62 tokens; 16-token steps chunk the prompts
    squeezed = LLM(path, dtype="float32", device="cpu", num_kv_blocks=5, max_num_batched_tokens=16,
                   max_num_seqs=4)
    try:
        assert greedy_tokens(squeezed, prompts) == want
        stats = squeezed.stats()
        assert stats.num_preemptions > 0 and stats.kv_blocks_free == 5
        warm = squeezed.generate(prompts[-2:], GREEDY, use_tqdm=False)  # their prefix is cached now
        assert [list(o.token_ids) for o in warm] == want[-2:]
        assert all(o.cached_tokens >= 32 for o in warm)
    finally:
        squeezed.shutdown()


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "qwen2-moe-tiny"])  # qwen2: the shared expert too
def test_moe_at_tp2_gives_the_tokens_and_logits_of_tp1(model_dirs, name):
    config = EngineConfig(model=model_dirs[name], dtype="float32", device="cpu", num_kv_blocks=16,
                          max_model_len=256, max_num_batched_tokens=32, max_num_seqs=8)
    runs = []
    for tp in (1, 2):
        executor = create_executor(config.replace(tensor_parallel_size=tp))
        try:
            runs.append(prefill_then_decode(executor, IDS))
        finally:
            executor.shutdown()
        llm = LLM(**{**config.__dict__, "tensor_parallel_size": tp})
        try:
            runs.append(greedy_tokens(llm, PROMPTS))
        finally:
            llm.shutdown()
    one_logits, one_tokens, two_logits, two_tokens = runs
    torch.testing.assert_close(two_logits, one_logits, atol=1e-4, rtol=1e-4)
    assert two_tokens == one_tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton MoE kernel, CUDA graphs)")
@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_moe_on_the_gpu_with_cuda_graphs_matches_the_cpu(model_dirs, name):
    runs = {}
    for device in ("cpu", "cuda"):
        config = EngineConfig(model=model_dirs[name], dtype="float32", device=device, num_kv_blocks=16,
                              max_model_len=256, max_num_batched_tokens=32, max_num_seqs=8)
        runner = ModelRunner(config)
        try:
            logits = prefill_then_decode(runner, IDS)
        finally:
            runner.shutdown()
        llm = LLM(**config.__dict__)  # decode steps replay CUDA graphs on the GPU
        try:
            runs[device] = logits, greedy_tokens(llm, PROMPTS)
        finally:
            llm.shutdown()
    torch.testing.assert_close(runs["cuda"][0], runs["cpu"][0], atol=1e-3, rtol=1e-3)
    assert runs["cuda"][1] == runs["cpu"][1]


def test_a_checkpoint_lacking_one_experts_tensor_is_refused_by_name():
    from kvserve.engine.model_loader.checkpoint import random_weights
    from kvserve.engine.model_loader.weights import load_named_weights
    from kvserve.engine.models import build_model

    config = make_config("mixtral-tiny")
    model = build_model(config, torch.float32, "cpu")
    lacking = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    weights = [(name, t) for name, t in random_weights(config, seed=0) if name != lacking]
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\), e.g. \[\"model.layers.1.mlp.experts."
                                         r"gate_up_proj\[\(5, 'up'\)\]\"\]"):
        load_named_weights(model, weights)


def test_mixtral_with_a_sliding_window_is_refused():
    from kvserve.engine.models import model_class_for

    with pytest.raises(ValueError, match=r"sliding_window=512 \(below max_position_embeddings=2048\)"):
        model_class_for(make_config("mixtral-tiny", sliding_window=512))


def test_offline_benchmark_on_a_moe_model_prints_active_parameter_flops_and_the_ratio(model_dirs, capsys):
    from kvserve.benchmarks import offline

    offline.main(["--model", model_dirs["qwen3-moe-tiny"], "--dtype", "float32", "--num-requests", "3",
                  "--min-prompt", "8", "--max-prompt", "24", "--min-output", "4", "--max-output", "8",
                  "--peer", "hf", "--quiet"])
    out = capsys.readouterr().out
    total, active = offline.active_parameters(make_config("qwen3-moe-tiny"))
    assert total - active == 2 * 8 * (3 * 32 * 64) * 6 // 8  # 2 layers x 8 experts, 6 of 8 idle
    assert f"{active / 1e6:.1f}M active per token" in out and "ratio kvserve / transformers" in out
