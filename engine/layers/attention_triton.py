"""The Triton attention backend: paged attention with kvserve's own kernels (``kvserve.kernels``).

The GPU path when flash-attn is not installed; on the CPU it runs only under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the tests compare it with the torch backend.
Each layer stores the step's new K/V into the paged cache, then attends over the cache: a
decode-only step (every query length 1) takes the decode kernel, which needs no host values
and so can be captured in a CUDA graph; any other step takes the varlen prefill kernel, which
handles decode rows, fresh prompts, prefix hits and chunk continuations in one launch.
"""

from __future__ import annotations

import torch

from kvserve.engine.layers.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    common_metadata_fields,
)
from kvserve.engine.model_input import ModelInput
from kvserve.kernels import paged_decode_attention, paged_prefill_attention, store_kv_cache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def build_metadata(self, inp: ModelInput, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(**common_metadata_fields(inp, self.block_size, device))

    def create_impl(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> AttentionImpl:
        return TritonAttentionImpl(num_heads, num_kv_heads, head_dim, scale)


class TritonAttentionImpl(AttentionImpl):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.max_query_len == 1:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale)
        return paged_prefill_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
            max_seqlen_q=meta.max_query_len,
        )
