"""Qwen3 (dense): the Llama decoder with an RMSNorm over each q and k head before rotary."""

from __future__ import annotations

import torch

from kvserve.engine.layers.norm import RMSNorm
from kvserve.engine.layers.rotary import apply_rotary
from kvserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvserve.engine.models.registry import register_model


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, backend, parallel):
        super().__init__(config, backend, parallel)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_qkv(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


@register_model
class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
