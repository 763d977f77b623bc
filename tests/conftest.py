"""Shared test set-up: the default model's source and a tiny local Hugging Face model directory.

Without a GPU, Triton kernels run under its interpreter; triton reads TRITON_INTERPRET when a
kernel is decorated, so it is set here, before any test module imports kvserve.kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def child_logs(tmp_path_factory):
    """The servers' and gateways' logs go under this session's temporary directory (pytest keeps
    the last three sessions'), not one file a server loose in /tmp."""
    os.environ["KVSERVE_CHILD_LOG_DIR"] = str(tmp_path_factory.mktemp("child-logs"))


@pytest.fixture(scope="session")
def default_source():
    """Where the bundled default model (SmolLM2-135M-Instruct GGUF) lives."""
    from kvserve.engine.model_loader.source import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def hf_default_model(default_source):
    """transformers' Llama on the default model's weights, float32, with its own dequantization."""
    from kvserve.benchmarks.peers import load_transformers_model

    return load_transformers_model(default_source, torch.float32)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, default_source):
    """A local HF directory (config.json, model.safetensors, generation_config.json, tokenizer)
    holding a 2-layer Qwen2 with random weights, random biases and random norm weights."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from kvserve.engine.tokenizer.load import load_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=[3, 7]).save_pretrained(path)
    load_tokenizer(default_source).save_pretrained(path)
    return path
