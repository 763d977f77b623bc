"""Qwen3.5's and Qwen3-Next's full-attention layers (every fourth layer of the hybrids,
engine/models/qwen3_5.py): q and k normed per head, a partial rotary (the first quarter of each head
at Qwen3.5's shapes), and the output gated per head by a sigmoid of the second half of ``q_proj``."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.attention.backend import Attention, AttentionBackend, AttentionMetadata
from kvserve.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from kvserve.engine.layers.norm import GemmaRMSNorm
from kvserve.engine.layers.rotary import apply_rotary
from kvserve.engine.models.llama import head_dim_of
from kvserve.engine.models.phi3 import rotary_dim_of
from kvserve.kernels.cpu.abi import DTYPES
from kvserve.kernels.cpu.gated_delta import gated_delta_kernels


class GatedAttention(nn.Module):
    """Full attention with an output gate per head (the second half of each head of ``q_proj``)."""

    in_decode_row = True  # its decode: csrc/decode_row.c decode_row_hybrid (models/decode_row_hybrid.py)

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext):
        super().__init__()
        self.head_dim = head_dim = head_dim_of(config)
        # q_proj holds [q | gate] per head: as 2 x heads "heads" of head_dim its rows load unchanged
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, parallel)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=config.attention_bias, parallel=parallel)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_dim = rotary_dim_of(config)
        impl = backend.create_impl(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)
        self.attn = Attention(impl)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        tokens, d = hidden.shape[0], self.head_dim
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        q_gate, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q_gate = q_gate.reshape(tokens, self.num_heads, 2 * d)
        q, gate = self.q_norm(q_gate[..., :d].contiguous()), q_gate[..., d:]
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, d))
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        out = self.attn(q, k, v.reshape(tokens, self.num_kv_heads, d), meta)
        return self.o_proj(self._gated(out.reshape(tokens, self.num_heads, d), gate))

    @staticmethod
    def _gated(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """out * sigmoid(gate) as [T, heads D]: on the CPU in C, in place in the attention's fresh
        output (csrc/gated_delta.c ``sigmoid_gate_row``, which the fused decode step runs too)."""
        tokens = out.shape[0]
        if (out.is_cpu and out.dtype in DTYPES and out.is_contiguous() and gate.stride(-1) == 1
                and (kernels := gated_delta_kernels()) is not None):
            return kernels.sigmoid_gate(out, gate).reshape(tokens, -1)
        return out.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The first ``rotary_dim`` of each head of ``x`` (the norm's fresh output) rotated in place:
        the CPU kernel rotates the strided view itself, the torch form's result is copied back."""
        part = x[..., : self.rotary_dim]
        turned = apply_rotary(part, cos, sin)
        if turned is not part:
            part.copy_(turned)
        return x
