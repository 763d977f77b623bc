"""Random-weight model directories: kvserve and transformers load the same model from one."""

import math

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.testing.random_model import make_config, write_random_model


def test_qwen3_06b_shape_has_the_parameter_count_of_qwen3_06b():
    from kvserve.engine.model_loader.checkpoint import checkpoint_shapes
    from kvserve.engine.models import model_class_for

    config = make_config("qwen3-0.6b")
    assert model_class_for(config).__name__ == "Qwen3ForCausalLM"
    params = sum(math.prod(shape) for shape in checkpoint_shapes(config).values())
    assert 0.59e9 < params < 0.61e9  # 0.6B with tied embeddings


@pytest.mark.parametrize(("shape", "billions"), [("smollm2-1.7b", 1.71), ("llama-3.2-1b", 1.24),
                                                 ("llama-3.2-3b", 3.21), ("qwen3-1.7b", 1.72)])
def test_the_gguf_benchmark_shapes_have_their_models_parameter_counts(shape, billions):
    """``make bench-scale``'s shapes, counted as their model cards count them (tied embeddings once)."""
    from kvserve.engine.model_loader.checkpoint import checkpoint_shapes

    params = sum(math.prod(s) for s in checkpoint_shapes(make_config(shape)).values())
    assert abs(params / 1e9 - billions) < 0.005


def test_kvserve_and_transformers_agree_on_greedy_tokens_of_a_random_model_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_random_model("llama-tiny", tmp_path / "llama-tiny", dtype=torch.float32)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300]]
    llm = LLM(str(path), dtype="float32", device="cpu")
    try:
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert list(out.token_ids) == ids[0, len(prompt) :].tolist()
    assert outs[0].text.split()[0].startswith("<t")


def test_the_2026_families_realistic_shapes_have_their_released_parameter_counts():
    from kvserve.engine.model_loader.checkpoint import checkpoint_shapes

    released = {"smollm3-3b": 3.08e9, "phi3-mini": 3.82e9, "gemma2-2b": 2.61e9, "gemma3-1b": 1.00e9,
                "gpt-oss-20b": 20.91e9}
    for name, count in released.items():
        params = sum(math.prod(shape) for shape in checkpoint_shapes(make_config(name)).values())
        assert abs(params - count) < 0.01 * count, name
