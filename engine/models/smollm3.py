"""SmolLM3: the Llama decoder in which some layers use no rotary embedding at all.

``no_rope_layers[i]`` is 1 where layer i rotates q and k, 0 where it leaves them as projected
(transformers' default: every fourth layer, ``no_rope_layer_interval``). A window, when
``use_sliding_window`` turns one on, sits on the layers ``layer_types`` marks.
"""

from __future__ import annotations

import torch

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.attention.backend import AttentionBackend
from kvserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvserve.engine.models.registry import register_model
from kvserve.engine.models.variants import layer_window


class SmolLM3Attention(LlamaAttention):
    """Llama's attention; ``use_rope`` False: q and k go to attention unrotated."""

    in_decode_row = True  # decode_row.c reads ``use_rope`` per layer (models/decode_row.py)

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext, layer_idx: int):
        window = layer_window(config, layer_idx)
        super().__init__(config, backend, parallel, **({"sliding_window": window} if window else {}))
        self.use_rope = bool(config.no_rope_layers[layer_idx])

    def project_qkv(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.use_rope:
            return super().project_qkv(hidden, cos, sin)
        qkv = self.qkv_proj(hidden)
        qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = qkv[:, :qk_size].view(qkv.shape[0], -1, self.head_dim)  # as Llama's, unturned
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    attention_class = SmolLM3Attention
    in_decode_row = True

    def make_attention(self, config, backend, parallel, layer_idx):
        return SmolLM3Attention(config, backend, parallel, layer_idx)


class SmolLM3Model(LlamaModel):
    layer_class = SmolLM3DecoderLayer


@register_model
class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_class = SmolLM3Model
    supports_sliding_window = True  # the registry lets its configs' windows through
