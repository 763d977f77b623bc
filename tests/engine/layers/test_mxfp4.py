"""MXFP4 experts (gpt-oss as OpenAI ships it) dequantized at load: the values transformers' own
conversion gives, and a gpt-oss checkpoint of blocks and scales served with transformers' logits."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from kvserve.engine.config import EngineConfig
from kvserve.engine.layers.mxfp4 import dequantize_mxfp4
from kvserve.engine.model_input import ModelInput
from kvserve.engine.model_loader.checkpoint import random_weights
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.testing.random_model import make_config, write_model_dir

IDS = [5, 17, 250, 3, 99, 42, 7, 7, 1, 0, 123, 64, 31, 400, 2, 8, 8, 9, 1000, 77]


def random_mxfp4(generator: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of every 4-bit code and exponents around 2^-6 (weights of a trained model's scale)."""
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(127 - 9, 127 - 4, shape, dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_dequantized_values_are_transformers_conversion():
    blocks, scales = random_mxfp4(torch.Generator().manual_seed(0), 3, 8, 4)  # 3 experts, 8 rows, 128 cols
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 8, 128) and ours.dtype == torch.bfloat16
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_gives_transformers_logits(tmp_path):
    config = make_config("gpt-oss-tiny")
    path = write_model_dir(config, tmp_path, dtype=torch.float32)
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1)
    weights = {}
    for name, tensor in random_weights(config, seed=0):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = tensor.shape  # the bf16 layout [E, cols, rows]: rows carry the blocks
            blocks, scales = random_mxfp4(generator, experts, rows, cols // 32)
            weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
        else:
            weights[name] = tensor
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(saved))

    runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=8,
                                      block_size=16))
    prompt = ModelInput(input_ids=IDS, positions=list(range(len(IDS))), query_lens=[len(IDS)],
                        context_lens=[len(IDS)], block_tables=[[3, 1]], logits_indices=list(range(len(IDS))),
                        slot_mapping=[[3, 1][p // 16] * 16 + p % 16 for p in range(len(IDS))])
    try:
        ours = runner.execute_model(prompt)
    finally:
        runner.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
