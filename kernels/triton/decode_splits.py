"""Split-K (flash-decoding) sizes and scratch for ``paged_attention``'s decode kernel: how many
splits a batch gets, and the float32 workspace the splits write their partial results to."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kvserve.kernels.triton.launch import MAX_SPLITS, d_pad


def decode_num_splits(batch: int, kv_heads: int, num_sms: int) -> int:
    """Splits per sequence for a decode of ``batch`` sequences: 1 once (batch x kv_heads) programs
    fill the GPU, else enough for about two programs per SM, at most ``MAX_SPLITS``."""
    programs = max(1, batch * kv_heads)
    if programs >= num_sms:
        return 1
    return min(MAX_SPLITS, -(-2 * num_sms // programs))


@dataclass
class DecodeWorkspace:
    """Float32 scratch for split decodes: per (sequence, split, head) the partial output
    ``[rows, heads, D_PAD]``, max and sum ``[rows, heads]``. Allocated once, before any CUDA graph
    is captured (graphs bake in its addresses), and shared by every layer: layers run in order."""

    out: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, num_heads: int, head_dim: int, device: torch.device) -> DecodeWorkspace:
        return cls(
            out=torch.empty(rows, num_heads, d_pad(head_dim), dtype=torch.float32, device=device),
            max=torch.empty(rows, num_heads, dtype=torch.float32, device=device),
            sum=torch.empty(rows, num_heads, dtype=torch.float32, device=device),
        )

    @classmethod
    def for_every_batch(cls, num_heads: int, kv_heads: int, head_dim: int, num_sms: int,
                        device: torch.device) -> DecodeWorkspace:
        """Rows for the largest ``batch x splits`` that ``decode_num_splits`` gives any batch,
        so every batch fits, the largest captured one included (batches of ``num_sms`` sequences
        or more are never split)."""
        splits = [(b, decode_num_splits(b, kv_heads, num_sms)) for b in range(1, num_sms + 1)]
        rows = max((b * n for b, n in splits if n > 1), default=1)
        return cls.allocate(rows, num_heads, head_dim, device)

    def rows(self) -> int:
        return self.max.shape[0]


@cache
def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (no reason to split on a CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
