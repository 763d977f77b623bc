"""Phi-3 and Phi-4-mini: the Llama decoder whose checkpoints store the projections fused.

A checkpoint holds ``self_attn.qkv_proj`` (q rows, then k, then v) and ``mlp.gate_up_proj`` (gate
rows, then up) as single tensors; ``fused_checkpoint_parts`` tells the loader how to cut them into
the parts our tensor-parallel layers load. Phi-4-mini rotates only the first
``partial_rotary_factor`` of each head. A ``sliding_window`` in the config windows every layer, as
transformers does. LongRoPE (the 128k variants: Phi-3.5-mini, Phi-4-mini) turns positions within
the original context by the short factors, later ones by the long (``layers/rotary.py``).
"""

from __future__ import annotations

import torch

from kvserve.engine.layers.rotary import apply_rotary, rope_parameters
from kvserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    head_dim_of,
)
from kvserve.engine.models.registry import register_model


def rotary_dim_of(config) -> int:
    factor = rope_parameters(config).get("partial_rotary_factor", 1.0) or 1.0
    return int(head_dim_of(config) * factor)


def window_of(config) -> dict:
    window = getattr(config, "sliding_window", None)
    return {"sliding_window": window} if window else {}


class Phi3PartialRotaryAttention(LlamaAttention):
    """Llama's attention rotating only the first ``rotary_dim`` features of each q and k head."""

    def __init__(self, config, backend, parallel, **variant):
        super().__init__(config, backend, parallel, **variant)
        self.rotary_dim = rotary_dim_of(config)

    def project_qkv(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        qkv = self.qkv_proj(hidden)
        qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = qkv[:, :qk_size].view(qkv.shape[0], -1, self.head_dim)
        # a copy of the turning part: the CPU kernel rotates it in place
        turned = apply_rotary(qk[..., : self.rotary_dim].contiguous(), cos, sin)
        qk = torch.cat((turned, qk[..., self.rotary_dim :]), dim=-1)
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


class Phi3DecoderLayer(LlamaDecoderLayer):
    in_decode_row = True  # Llama's layer; decode_row.c takes it where its attention is plain Llama's

    def make_attention(self, config, backend, parallel, layer_idx):
        if rotary_dim_of(config) == head_dim_of(config):
            return LlamaAttention(config, backend, parallel, **window_of(config))
        return Phi3PartialRotaryAttention(config, backend, parallel, **window_of(config))


class Phi3Model(LlamaModel):
    layer_class = Phi3DecoderLayer
    rotary_dim = staticmethod(rotary_dim_of)


@register_model
class Phi3ForCausalLM(LlamaForCausalLM):
    model_class = Phi3Model
    supports_sliding_window = True
    packed_modules_mapping = {}  # the checkpoint's names are ours: see fused_checkpoint_parts

    def fused_checkpoint_parts(self) -> dict[str, list[tuple[object, int]]]:
        """Each fused checkpoint module's parts: (shard id, full rows), in the checkpoint's order."""
        config, head_dim = self.config, head_dim_of(self.config)
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        return {"qkv_proj": [("q", q), ("k", kv), ("v", kv)],
                "gate_up_proj": [(0, config.intermediate_size), (1, config.intermediate_size)]}
