"""The peers kvserve is measured and checked against, on the very same weights.

``load_transformers_model`` (here) builds Hugging Face transformers' own model for a kvserve model
source: from a Hugging Face directory as usual, and from a GGUF file with transformers' own
dequantization (``load_gguf_checkpoint``) into a model built from the GGUF's config — the
``from_pretrained(gguf_file=...)`` route would also need the ``accelerate`` package.

The serving peers, vLLM's CPU build and llama.cpp's ``llama-server``, served side by side with
kvserve on the same requests (``python -m kvserve.benchmarks.peers``, docs/performance/peers.md):
where they are installed and how (``setup``, ``make bench-peers``), starting and stopping them
(``servers``), the HTTP/1.1 client and Server-Sent Events reader of their streams (``sse``), one
request in each system's dialect (``dialects``), the command (``compare``) and its table, ratios
and goodput figure (``table``).
"""

from __future__ import annotations

import torch

from kvserve.engine.model_loader.source import ModelSource


def load_transformers_model(src: ModelSource, dtype: torch.dtype = torch.float32, device="cpu"):
    from transformers import AutoConfig, AutoModelForCausalLM

    if not src.gguf_file:
        return AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype).to(device).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(src.gguf_path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    return model.to(device).eval()
