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


def test_a_window_model_stays_off_the_fused_decode_step(model_dirs):
    from kvserve.engine.models.decode_row import DecodeRow

    llm = LLM(model_dirs["mistral-tiny"], dtype="float32", device="cpu", block_size=BLOCK)
    try:
        model = llm.engine.executor.model.model
        assert not any(layer.self_attn.attn.impl.attends_in_c for layer in model.layers)
        assert not DecodeRow.fits(model) and model.decode_row() is None
    finally:
        llm.shutdown()


def test_a_family_without_window_support_is_still_refused():
    from kvserve.engine.models import model_class_for

    config = make_config("mixtral-tiny", sliding_window=8)
    with pytest.raises(ValueError, match="MixtralForCausalLM with sliding_window=8"):
        model_class_for(config)
