"""The int8 KV cache (``kv_cache_dtype="int8"``, the torch backend): each cache row, one token of
one KV head, holds ``head_dim`` int8 values followed by the 4 bytes of their float32 scale, so a
row is ``head_dim + 4`` bytes instead of ``2 * head_dim`` (bfloat16) or ``4 * head_dim``
(``kernels.cpu.abi.cache_row_width``; the layout is written once, in kernels/cpu/csrc/common.h).

A row is quantized symmetrically on its own: ``scale = max|x| / 127``, ``q = round(x / scale)``
(half to even; an all-zero row stores zeros and scale 0), and read back as ``q * scale``. A
token's rows never change once written and do not depend on what else is in the step, so
chunking, prefix hits and preemption leave the cache, and the tokens, as they were.

These are the torch-ops twins of the C kernels' ``store_kv`` / attention reads
(kernels/cpu/csrc/elementwise.c ``quantize_row``): the same arithmetic, the same bytes.
"""

from __future__ import annotations

import torch

from kvserve.kernels.cpu.abi import KV_SCALE_BYTES as SCALE_BYTES  # a row's float32 scale (common.h)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """int8 [..., D + 4]: each row of ``x`` [..., D] as its int8 values and float32 scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(xf / scale), 0.0).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] in ``dtype``: int8 cache rows [..., D + 4] read back as values times scale."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)
