"""The Triton attention backend: paged attention with kvserve's own kernels (``kvserve.kernels``).

The GPU path when flash-attn is not installed; on the CPU it runs only under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the tests compare it with the torch backend.
Each layer stores the step's new K/V into the paged cache, then attends over the cache:

- a decode-only step (every query length 1) takes the decode kernel, which needs no host values
  and so can be captured in a CUDA graph. When the batch leaves most SMs idle, each context is
  split (flash-decoding) and the splits are combined through one float32 workspace that the
  backend allocates at the first decode (before any graph is captured) for every batch size;
- any other step takes the varlen prefill kernel over a flat list of the step's real
  (sequence, query tile) pairs, built on the host once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.engine.layers.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    common_metadata_fields,
)
from kvserve.engine.model_input import ModelInput
from kvserve.kernels import (
    DecodeWorkspace,
    decode_num_splits,
    device_sm_count,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tile_shape,
    prefill_work,
    store_kv_cache,
)


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    # prefill work lists by tokens per tile, built at the first layer and reused by the others
    prefill_work: dict[int, torch.Tensor] = field(default_factory=dict)

    def work_for(self, tokens_per_tile: int) -> torch.Tensor:
        if tokens_per_tile not in self.prefill_work:
            self.prefill_work[tokens_per_tile] = prefill_work(
                self.query_lens_host, self.seq_lens_host, tokens_per_tile, self.seq_lens.device
            )
        return self.prefill_work[tokens_per_tile]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    # each a constexpr of the kernels (kernels/triton/paged_attention.py); flash-attn 2 has no sinks,
    # so on a GPU a model with sinks runs on this backend (attention.select)
    variants = frozenset({"sliding_window", "logits_soft_cap", "sinks"})

    def __init__(self, block_size: int, kv_cache_dtype: str = "auto"):
        super().__init__(block_size, kv_cache_dtype)
        self.num_sms: int | None = None  # None: the device's; tests set it to split on the CPU
        self.workspace: DecodeWorkspace | None = None

    def build_metadata(self, inp: ModelInput, device: torch.device) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(**common_metadata_fields(inp, self.block_size, device))

    def create_impl(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: bool = False) -> AttentionImpl:
        self.check_variants(sliding_window, logits_soft_cap, sinks)
        variant = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
        return TritonAttentionImpl(num_heads, num_kv_heads, head_dim, scale, self, **variant)

    def decode_plan(self, q: torch.Tensor, kv_heads: int) -> tuple[int, DecodeWorkspace | None]:
        """(splits, workspace) for a decode of ``q.shape[0]`` sequences."""
        num_sms = self.num_sms or device_sm_count(q.device)
        splits = decode_num_splits(q.shape[0], kv_heads, num_sms)
        if splits == 1:
            return 1, None
        if self.workspace is None:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the decode workspace must be allocated by an eager decode before "
                                   "CUDA-graph capture (its address is baked into the graphs)")
            _, heads, head_dim = q.shape
            self.workspace = DecodeWorkspace.for_every_batch(heads, kv_heads, head_dim, num_sms, q.device)
        return splits, self.workspace


class TritonAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: TritonAttentionBackend, **variant):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, **variant)
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TritonAttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        variant = dict(window=self.sliding_window, soft_cap=self.logits_soft_cap, sinks=sinks)
        if meta.max_query_len == 1:
            splits, workspace = self.backend.decode_plan(q, self.num_kv_heads)
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                          num_splits=splits, workspace=workspace, **variant)  # fmt: skip
        tile = prefill_tile_shape(q.device, self.num_heads // self.num_kv_heads)
        return paged_prefill_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
            work=meta.work_for(tile["TOKENS_PER_TILE"]), **variant,
        )
