"""Loading a model's config, stop tokens and weights (from the place ``source.resolve_model``
found); choosing dtype and device. Nothing is ever downloaded.

Weights reach the model by checkpoint (Hugging Face) name through ``weights.load_named_weights``.
The model class comes from the registry the models add themselves to (``models/registry.py``).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

import torch
from torch import nn

from kvserve.engine.model_loader import gguf_file
from kvserve.engine.model_loader.source import ModelSource
from kvserve.engine.model_loader.weights import load_named_weights
from kvserve.engine.models.registry import model_class_for
from kvserve.kernels.cpu.kquant import kquant_kernels

# tokens that close a chat turn, added to the stop ids when the chat template writes them
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# gpt-oss's harmony format (a template with channels): <|end|> closes each message of a reply (its
# analysis, then its final answer), whose turn ends at <|return|>, or at <|call|> for a tool call
HARMONY_TURN_END_TOKENS = ("<|return|>", "<|call|>")


def load_hf_config(src: ModelSource):
    """The model's transformers config (the text config of a multimodal checkpoint served as text);
    an unsupported architecture is refused here."""
    from transformers import AutoConfig


    if src.gguf_file:
        gguf = gguf_file.GGUFFile(src.gguf_path)
        model_type, kwargs = gguf_file.hf_config_kwargs(gguf)
        config = AutoConfig.for_model(model_type, **kwargs)
    else:
        config = AutoConfig.from_pretrained(src.path)
    cls = model_class_for(config)
    if hasattr(cls, "served_config"):  # a multimodal checkpoint served as its text model
        config = cls.served_config(config)
    return config


def load_generation_eos(src: ModelSource, hf_config, tokenizer) -> list[int]:
    """Token ids that end generation: config and generation-config EOS, the tokenizer's EOS and
    the chat template's end-of-turn token."""
    candidates = _as_list(getattr(hf_config, "eos_token_id", None))
    generation_config = os.path.join(src.path, "generation_config.json")
    if src.gguf_file is None and os.path.isfile(generation_config):
        from transformers import GenerationConfig

        candidates += _as_list(GenerationConfig.from_pretrained(src.path).eos_token_id)
    candidates += _as_list(tokenizer.eos_token_id)
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    if "<|channel|>" in template:
        candidates += [vocab[token] for token in HARMONY_TURN_END_TOKENS if token in vocab]
    else:
        candidates += [vocab[token] for token in TURN_END_TOKENS if token in template and token in vocab]
    return list(dict.fromkeys(candidates))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def load_weights(model: nn.Module, src: ModelSource, show_progress: bool = True,
                 gguf_blocks: bool = False) -> None:
    """Fill ``model`` from the source's checkpoint. GGUF: with ``gguf_blocks`` (a CPU model, no
    ``--quantization``) and the CPU kernels built, the block formats they multiply stay as stored
    (``gguf_file.hf_tensors``); every other tensor is dequantized to the parameters' dtype.
    ``show_progress``: a progress bar on stderr, shown only when stderr is a terminal."""
    if src.gguf_file:
        gguf = gguf_file.GGUFFile(src.gguf_path)
        arch = gguf.architecture
        total = sum(1 for name in gguf.tensors if gguf_file.hf_tensor_name(name, arch) is not None)
        weights = gguf_file.hf_tensors(gguf, keep_blocks=gguf_blocks and kquant_kernels() is not None)
    else:
        files = sorted(glob.glob(os.path.join(src.path, "*.safetensors")))
        if not files:
            raise ValueError(f"{src.path} holds no *.safetensors weights")
        total, weights = _safetensors_count(files), _safetensors_weights(files)
    load_named_weights(model, loading_progress(weights, total, src.name, show_progress))


def loading_progress(items: Iterable, total: int, name: str, enabled: bool = True) -> Iterable:
    """``items`` with a tqdm bar on stderr; quiet when stderr is no terminal (logs, pipes, tests)."""
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=f"loading {name}", unit="tensor", dynamic_ncols=True,
                disable=None if enabled else True)


def _safetensors_count(files: list[str]) -> int:
    from safetensors import safe_open

    count = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            count += len(f.keys())
    return count


def _safetensors_weights(files: list[str]) -> Iterable[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(device)


def cpu_gemm_bf16() -> bool:
    """Whether the CPU kernels' bfloat16 GEMM (csrc/gemm.c) is built here: on CPUs without native
    bf16 its AVX2 build widens the weights in registers and multiplies in float FMAs, reading half
    the bytes of float32 weights (on this project's AVX2 VM bfloat16 served 1.43x float32 offline)."""
    from kvserve.engine.layers.cpu_matmul import gemm_kernel

    return gemm_kernel() is not None  # (None with AMX too, where the CPU's bf16 is native)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA (float16 where bf16 is missing), on CPUs with native bf16 and
    where the CPU kernels' bfloat16 GEMM is built (AVX2 with FMA); float32 on other CPUs, where
    torch's own bfloat16 matmul is several times slower than float32 (docs/performance/step_profile.md)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() or cpu_gemm_bf16() else torch.float32
