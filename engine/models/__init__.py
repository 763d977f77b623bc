"""The models (one module per architecture family) and ``build_model``, which makes the config's
model in the serving dtype on the device, its weights not yet loaded.

Importing this package imports every model module, and each registers its architectures
(``registry.register_model``); the loader asks the registry (``model_class_for``). Models import
layers, never the loader: weights come in through ``kvserve.engine.model_loader``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.attention.backend import AttentionBackend, create_attention_backend
from kvserve.engine.models import (  # noqa: F401 - they register
    gemma2,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_5_vl,
    qwen3_moe,
    qwen3_next,
    smollm3,
)
from kvserve.engine.models.registry import model_class_for


def build_model(hf_config, dtype: torch.dtype, device: torch.device | str,
                parallel: ParallelContext | None = None,
                backend: AttentionBackend | None = None) -> nn.Module:
    """An uninitialised model of the config's architecture, in ``dtype`` on ``device``."""
    device = torch.device(device)
    backend = backend or create_attention_backend("torch", device, block_size=16)
    cls = model_class_for(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, backend, parallel or ParallelContext())
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
