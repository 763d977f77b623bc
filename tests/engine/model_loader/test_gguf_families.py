"""GGUF files of the 2026 families load as their Hugging Face checkpoints do: each tiny random
checkpoint is written to GGUF here the way llama.cpp's convert_hf_to_gguf.py writes it (the
``gguf`` package's own tensor-name map and writer; q/k rows interleaved for ``llama`` and
``smollm3``; Gemma's norms stored as 1 + w; Phi-3's fused tensors and LongRoPE factor tensors),
in float32, and kvserve's logits and greedy tokens from the GGUF equal those from the safetensors
directory (float32, prompts several windows long, through the paged cache, KV cache groups
included). Architectures not read are refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from kvserve.engine.config import EngineConfig
from kvserve.engine.executor.executor import create_executor
from kvserve.engine.model_input import ModelInput
from kvserve.engine.model_loader import gguf_file
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.testing.engine import sequence_step
from kvserve.testing.random_model import make_config, write_model_dir

BLOCK = 4
IDS = [5, 17, 250, 3, 99, 42, 7, 7, 1, 0, 123, 64, 31, 400, 2, 8, 8, 9, 1000, 77, 6, 13, 500, 21, 4]
TABLES = [[9 * group + b for b in (5, 2, 6, 0, 3, 1, 4, 8, 7)] for group in range(6)]  # out of order
# (random model, overrides, GGUF architecture). Gemma 2 at query_pre_attn_scalar = head_dim: GGUF
# has no key for it and llama.cpp takes the head dim (hidden / heads for the 27B shape)
CASES = {
    "gemma2": ("gemma2-tiny", {"query_pre_attn_scalar": 16}, gguf.MODEL_ARCH.GEMMA2),
    "gemma3": ("gemma3-tiny", {}, gguf.MODEL_ARCH.GEMMA3),
    "phi3": ("phi3-tiny", {}, gguf.MODEL_ARCH.PHI3),
    "phi4-mini": ("phi4-mini-tiny", {}, gguf.MODEL_ARCH.PHI3),  # partial rotary, LongRoPE
    "smollm3": ("smollm3-tiny", {}, gguf.MODEL_ARCH.SMOLLM3),
    "mistral": ("mistral-tiny", {}, gguf.MODEL_ARCH.LLAMA),  # a window on every layer
    "gpt-oss": ("gpt-oss-tiny", {}, gguf.MODEL_ARCH.GPT_OSS),  # experts split gate/up, sinks, YaRN
}
MXFP4 = gguf.GGMLQuantizationType.MXFP4


def interleave_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's permute of q/k rows (rotate-half -> per-head interleaved pairs)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_metadata(writer: gguf.GGUFWriter, config, arch: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    rope = config.rope_parameters
    if arch == "gpt-oss":
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "gemma3":
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch in ("gemma2", "gemma3", "llama", "gpt-oss") and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "qwen35":  # as convert_hf_to_gguf.py's Qwen3NextModel writes them
        writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
        writer.add_full_attention_interval(4)  # the converter's default: Qwen3.5's configs hold none
        # (the installed gguf package has no add_recurrent_layers; the converter's own writes this key)
        recurrent = [t == "linear_attention" for t in config.layer_types]
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    if arch == "phi3":
        rotated = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size)
        writer.add_rope_dimension_count(rotated // config.num_attention_heads)
        writer.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for kind in ("long", "short"):
                factors = np.asarray(rope[f"{kind}_factor"], np.float32)
                writer.add_tensor(f"rope_factors_{kind}.weight", factors)


def gpt_oss_tensors(tensors: dict[str, torch.Tensor]):
    """As llama.cpp's converter splits gpt-oss's experts: gate and up de-interleaved, every expert
    weight [E, out, in]; sinks as ``.weight``."""
    for name, tensor in tensors.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith("gate_up_proj"):
            rows = tensor.transpose(1, 2)
            yield f"{base}.gate_proj.weight", rows[:, ::2]
            yield f"{base}.up_proj.weight", rows[:, 1::2]
        elif name.endswith("gate_up_proj_bias"):
            yield f"{base}.gate_proj.bias", tensor[:, ::2]
            yield f"{base}.up_proj.bias", tensor[:, 1::2]
        elif name.endswith("down_proj"):
            yield f"{base}.down_proj.weight", tensor.transpose(1, 2)
        elif name.endswith("down_proj_bias"):
            yield f"{base}.down_proj.bias", tensor
        else:
            yield name + (".weight" if name.endswith("sinks") else ""), tensor


def tiled_value_heads(tensor: torch.Tensor, dim: int, config, head_dim: int) -> torch.Tensor:
    """llama.cpp's reorder of Qwen3.5's value heads from grouped by key head to tiled."""
    shape, keys = list(tensor.shape), config.linear_num_key_heads
    per_key = config.linear_num_value_heads // keys
    tensor = tensor.reshape(*shape[:dim], keys, per_key, head_dim, *shape[dim + 1:])
    return tensor.transpose(dim, dim + 1).reshape(shape)


def qwen35_tensors(tensors: dict[str, torch.Tensor], config):
    """As llama.cpp's converter stores Qwen3.5: value heads tiled, A_log as -exp(A_log), dt_bias as
    dt_proj.bias, the conv kernel squeezed, the zero-centred norms as 1 + w."""
    qk, dv = 2 * config.linear_num_key_heads * config.linear_key_head_dim, config.linear_value_head_dim
    for name, tensor in tensors.items():
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            tensor = torch.cat((tensor[:qk], tiled_value_heads(tensor[qk:], 0, config, dv)))
        elif name.endswith("in_proj_z.weight"):
            tensor = tiled_value_heads(tensor, 0, config, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            tensor = tiled_value_heads(tensor, 0, config, 1)
        elif name.endswith("out_proj.weight"):
            tensor = tiled_value_heads(tensor, 1, config, dv)
        if name.endswith("A_log"):
            tensor = -torch.exp(tensor)
        elif name.endswith("dt_bias"):
            name = name.replace("dt_bias", "dt_proj.bias")
        elif "conv1d" in name:
            tensor = tensor.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor + 1
        yield name, tensor


def write_gguf(model_dir, config, model_arch: gguf.MODEL_ARCH, path, experts: str = "F32") -> None:
    """``experts``: F32; MXFP4 (expert weights quantized); MXFP4-values (their MXFP4 values in F32)."""
    arch = gguf.MODEL_ARCH_NAMES[model_arch]
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, config, arch)
    tensors = load_file(str(model_dir / "model.safetensors"))
    named = (gpt_oss_tensors(tensors) if arch == "gpt-oss" else
             qwen35_tensors(tensors, config) if arch == "qwen35" else tensors.items())
    for hf_name, tensor in named:
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensor = tensor.float()
        if arch in ("llama", "smollm3") and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            tensor = interleave_rotary(tensor, heads)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            tensor = tensor + 1  # as the converter stores Gemma's (1 + w) norms
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        values = np.ascontiguousarray(tensor.numpy())
        if experts != "F32" and "_exps.weight" in gguf_name:
            blocks = quantize(values, MXFP4)
            if experts == "MXFP4":
                writer.add_tensor(gguf_name, blocks, raw_dtype=MXFP4)
                continue
            values = dequantize(blocks, MXFP4).reshape(values.shape)
        writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def step(ids: list[int], start: int) -> ModelInput:
    return sequence_step(ids, start, TABLES, BLOCK)


def logits_and_greedy(path: str, steps: int = 6) -> tuple[torch.Tensor, list[int], object]:
    runner = ModelRunner(EngineConfig(model=path, dtype="float32", device="cpu", num_kv_blocks=56,
                                      block_size=BLOCK, enforce_eager=True))
    try:
        logits = runner.execute_model(step(IDS, 0))
        tokens = [int(logits[-1].argmax())]
        for _ in range(steps - 1):
            last = runner.execute_model(step(tokens[-1:], len(IDS) + len(tokens) - 1))
            tokens.append(int(last[0].argmax()))
        return logits, tokens, runner.hf_config
    finally:
        runner.shutdown()


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_of_each_family_gives_the_checkpoints_logits_and_tokens(tmp_path, case):
    name, overrides, model_arch = CASES[case]
    config = make_config(name, **overrides)
    model_dir = write_model_dir(config, tmp_path / "hf", dtype=torch.float32)
    write_gguf(model_dir, config, model_arch, tmp_path / f"{case}.gguf")
    want_logits, want_tokens, want_config = logits_and_greedy(str(model_dir))
    got_logits, got_tokens, got_config = logits_and_greedy(str(tmp_path / f"{case}.gguf"))
    assert got_config.architectures == want_config.architectures
    for field in ("sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_parameters"):
        assert getattr(got_config, field, None) == getattr(want_config, field, None), field
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens


def test_gpt_oss_mxfp4_experts_load_as_their_values(tmp_path):
    """Expert weights stored in MXFP4 (gguf's own quantizer, as llama.cpp's converter repacks
    OpenAI's blocks) give the logits of the same values stored in float32."""
    config = make_config("gpt-oss-tiny")
    model_dir = write_model_dir(config, tmp_path / "hf", dtype=torch.float32)
    for experts in ("MXFP4", "MXFP4-values"):
        write_gguf(model_dir, config, gguf.MODEL_ARCH.GPT_OSS, tmp_path / f"{experts}.gguf", experts)
    blocks = gguf_file.GGUFFile(str(tmp_path / "MXFP4.gguf"))
    assert blocks.tensors["blk.0.ffn_gate_exps.weight"].ggml_type == int(MXFP4)
    got, got_tokens, _ = logits_and_greedy(str(tmp_path / "MXFP4.gguf"))
    want, want_tokens, _ = logits_and_greedy(str(tmp_path / "MXFP4-values.gguf"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_tokens == want_tokens


@pytest.mark.parametrize(("arch", "reason"), [("clip", "mmproj"), ("gemma3n", "supported: "),
                                              ("llama", "Ministral")])
def test_an_architecture_not_read_is_refused_by_name(tmp_path, arch, reason):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    writer.add_block_count(1)
    if arch == "llama":  # Ministral's windows on some layers
        for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, 64),
                           (writer.add_head_count, 4), (writer.add_sliding_window, 8)):
            add(value)
        writer.add_sliding_window_pattern([True])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"GGUF architecture '{arch}'(?=.*not supported).*{reason}"):
        gguf_file.hf_config_kwargs(gguf_file.GGUFFile(str(tmp_path / "m.gguf")))


def hybrid_logits_and_greedy(path: str, steps: int = 6, tp: int = 1) -> tuple[torch.Tensor, list[int]]:
    """As ``logits_and_greedy``, for a model with a state cache (one KV group, state slot 0), on
    ``tp`` ranks."""
    runner = create_executor(EngineConfig(model=path, dtype="float32", device="cpu", num_kv_blocks=56,
                                          block_size=BLOCK, enforce_eager=True, max_num_seqs=2,
                                          tensor_parallel_size=tp))

    try:
        logits = runner.execute_model(sequence_step(IDS, 0, TABLES[:1], BLOCK, state_slots=[0]))
        tokens = [int(logits[-1].argmax())]
        for _ in range(steps - 1):
            at = len(IDS) + len(tokens) - 1
            last = runner.execute_model(sequence_step(tokens[-1:], at, TABLES[:1], BLOCK, state_slots=[0]))
            tokens.append(int(last[0].argmax()))
        return logits, tokens
    finally:
        runner.shutdown()


def test_qwen35_gguf_gives_the_checkpoints_logits_and_tokens(tmp_path):
    """llama.cpp's ``qwen35``: more value heads than key heads (so the converter's head reorder is
    exercised), the linear layers' weights scaled up so that their state steers the tokens; at TP=1
    and TP=2."""
    config = make_config("qwen3.5-tiny")
    model_dir = write_model_dir(config, tmp_path / "hf", dtype=torch.float32)
    weights = {name: t * 20.0 if ".linear_attn." in name and "norm" not in name and "A_log" not in name else t
               for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    write_gguf(model_dir, config, gguf.MODEL_ARCH.QWEN35, tmp_path / "qwen35.gguf")
    loaded = gguf_file.hf_config_kwargs(gguf_file.GGUFFile(str(tmp_path / "qwen35.gguf")))[1]
    for field in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim"):
        assert loaded[field] == getattr(config, field), field
    rotary = config.rope_parameters["partial_rotary_factor"]
    assert loaded["rope_parameters"]["partial_rotary_factor"] == rotary
    want_logits, want_tokens = hybrid_logits_and_greedy(str(model_dir))
    got_logits, got_tokens = hybrid_logits_and_greedy(str(tmp_path / "qwen35.gguf"))
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens
    # at TP=2 (one key head and its two value heads per rank; the linear layers' tensors, read as
    # floats, split by head as the safetensors ones do)
    tp_logits, tp_tokens = hybrid_logits_and_greedy(str(tmp_path / "qwen35.gguf"), tp=2)
    torch.testing.assert_close(tp_logits, want_logits, atol=1e-4, rtol=1e-4)
    assert tp_tokens == want_tokens
