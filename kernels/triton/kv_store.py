"""Triton kernel that writes the new tokens' K and V into the paged KV cache.

The cache layout is ``[num_blocks, block_size, kv_heads, head_dim]`` (shared with the torch
backend and flash-attn). Token ``t`` goes to slot ``slot_mapping[t] = block_id * block_size +
offset``; slot -1 marks a token whose K/V must not be written (a padded CUDA-graph row, or a
token whose KV is already cached). One program copies one token: its ``kv_heads * head_dim``
values as one power-of-two block with the tail masked, so 3 x 64 = 192 works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton.launch import kv_store_launch


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_stride_t,
    v_stride_t,
    cache_stride_block,
    cache_stride_slot,
    BLOCK_SIZE: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, WIDTH_PAD)
    mask = offs < WIDTH
    dst = (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_slot + offs
    k = tl.load(k_ptr + t * k_stride_t + offs, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + offs, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[T, kv_heads, head_dim]`` into the caches at ``slot_mapping`` ``[T]``.

    ``k`` and ``v`` may be views with any token stride (slices of a fused qkv projection)
    as long as each token's heads are contiguous; slots equal to -1 are skipped.
    """
    num_tokens, kv_heads, head_dim = k.shape
    check_paged_cache(k_cache, v_cache, kv_heads, head_dim)
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must have shape ({num_tokens},), got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    k, v = _heads_contiguous(k), _heads_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1),
        **kv_store_launch(kv_heads, head_dim, k_cache.shape[1]).kwargs(),
    )  # fmt: skip


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """A view whose (kv_heads, head_dim) part is one contiguous run per token, else a copy."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    """Raise ValueError unless both caches are [num_blocks, block_size, kv_heads, head_dim] blocks."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (kv_heads, head_dim):
        raise ValueError(
            f"caches must be [num_blocks, block_size, {kv_heads}, {head_dim}], got {tuple(k_cache.shape)}"
        )
    if k_cache.stride(3) != 1 or k_cache.stride(2) != head_dim or k_cache.stride(1) != kv_heads * head_dim:
        raise ValueError("each cache block must be contiguous (slot, kv_head, head_dim)")
