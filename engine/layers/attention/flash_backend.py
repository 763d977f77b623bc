"""The flash-attn backend (GPU, when the ``flash_attn`` package imports).

New K/V go into the paged cache with kvserve's Triton store kernel; attention then reads the
cache through block tables: ``flash_attn_with_kvcache`` for a decode-only step (no host values,
so it can be captured in a CUDA graph) and ``flash_attn_varlen_func`` with ``block_table`` for
any step with a longer chunk (its causal mask is aligned bottom-right, which is kvserve's
position rule: a chunk of q tokens in a context of L attends to keys 0..L-q+j).

flash-attn's paged KV requires a cache block size that is a multiple of 256, and flash-attn
computes in float16 / bfloat16 only (``attention.flash_attn_refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from kvserve.engine.layers.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    common_metadata_fields,
    to_device,
)
from kvserve.engine.model_input import ModelInput
from kvserve.kernels import store_kv_cache


@dataclass
class FlashAttentionMetadata(AttentionMetadata):
    cu_seqlens_k: torch.Tensor | None = None  # int32 [num_seqs + 1]: cumulative context lengths


class FlashAttentionBackend(AttentionBackend):
    name = "flash-attn"
    # flash-attn's local attention, window_size=(W - 1, 0), and its softcap=; flash-attn 2 has no
    # attention sinks: a model with sinks takes the Triton backend (resolve_backend_name)
    variants = frozenset({"sliding_window", "logits_soft_cap"})

    def build_metadata(self, inp: ModelInput, device: torch.device) -> FlashAttentionMetadata:
        cu_seqlens_k = [0]
        for length in inp.context_lens:
            cu_seqlens_k.append(cu_seqlens_k[-1] + length)
        return FlashAttentionMetadata(
            **common_metadata_fields(inp, self.block_size, device),
            cu_seqlens_k=to_device(cu_seqlens_k, device, torch.int32),
        )

    def create_impl(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: bool = False) -> AttentionImpl:
        self.check_variants(sliding_window, logits_soft_cap, sinks)
        variant = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
        return FlashAttentionImpl(num_heads, num_kv_heads, head_dim, scale, **variant)


class FlashAttentionImpl(AttentionImpl):
    @property
    def window_size(self) -> tuple[int, int]:
        """flash-attn's (left, right) keys beside the diagonal: (W - 1, 0) is transformers' window."""
        return (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: FlashAttentionMetadata) -> torch.Tensor:
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.max_query_len == 1:
            out = flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens, block_table=meta.block_tables,
                softmax_scale=self.scale, causal=True, window_size=self.window_size,
                softcap=self.logits_soft_cap or 0.0,
            )
            return out.squeeze(1)
        return flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len, softmax_scale=self.scale,
            causal=True, block_table=meta.block_tables, window_size=self.window_size,
            softcap=self.logits_soft_cap or 0.0,
        )
