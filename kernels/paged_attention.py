"""Triton paged attention over the KV cache: decode (one query token per sequence) and
prefill of packed, variable-length query chunks.

Both read every key and value from the paged cache ``[num_blocks, block_size, kv_heads,
head_dim]`` through ``block_tables``, so the new tokens' K/V must be stored first
(``store_kv_cache``). That makes prefix-cache hits and chunk continuations the ordinary case:
query token ``j`` of sequence ``i`` sits at position ``seq_lens[i] - q_len_i + j`` and attends
to keys ``0..position``.

One kernel serves both. A program owns one KV head of one sequence and a tile of query
tokens; its rows are (query token, query head of that KV head's group) pairs, so grouped-query
heads share each K/V load. Keys are gathered ``BLOCK_N`` tokens at a time through the block
table (tile size independent of the cache block size) and folded in with an online softmax
accumulated in float32. A sequence with no keys (seq_lens 0, a padded CUDA-graph row)
yields zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.kv_store import check_paged_cache


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    scale,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    bt_stride,
    c_stride_block,
    c_stride_slot,
    c_stride_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    IS_DECODE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    if IS_DECODE:
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first = tile * TOKENS_PER_TILE
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    q_offset = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // GROUP_PAD
    g = rows % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    q_pos = q_offset + tok
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q_offs = q_row[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, q_offset + first + TOKENS_PER_TILE)
    for start in range(0, kv_end, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)
        key_ok = key < kv_end
        block = tl.load(block_tables_ptr + seq * bt_stride + key // BLOCK_SIZE, mask=key_ok, other=0)
        slot = block.to(tl.int64) * c_stride_block + (key % BLOCK_SIZE) * c_stride_slot
        kv_offs = (slot + kv_head * c_stride_head)[:, None] + d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(key_ok[None, :] & (key[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_offs = q_row[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached keys.

    q ``[B, num_heads, head_dim]``; block_tables int32 ``[B, max_blocks]``; seq_lens int32
    ``[B]`` (keys per sequence, including the current token). Returns ``[B, num_heads,
    head_dim]``. Needs no host synchronisation, so it can be captured in a CUDA graph.
    """
    num_seqs = q.shape[0]
    cu_seqlens_q = seq_lens  # unused when IS_DECODE; any int32 tensor on the device will do
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, num_seqs, 1, True)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query chunks over the paged cache.

    q ``[T, num_heads, head_dim]`` holds sequence ``i``'s new tokens at rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` (int32 ``[B+1]``); seq_lens int32 ``[B]`` is each
    sequence's context length after this step, this chunk included. ``max_seqlen_q`` sizes the
    launch grid; pass it when known on the host to avoid reading ``cu_seqlens_q`` back.
    Returns ``[T, num_heads, head_dim]``.
    """
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens_q must have shape ({num_seqs + 1},), got {tuple(cu_seqlens_q.shape)}")
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if num_seqs else 0
    return _launch(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, num_seqs, max_seqlen_q, False
    )


def _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, num_seqs, max_seqlen_q,
            is_decode: bool) -> torch.Tensor:
    _, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    check_paged_cache(k_cache, v_cache, kv_heads, head_dim)
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] and seq_lens [{num_seqs}]")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0 or max_seqlen_q == 0:
        return out
    group = num_heads // kv_heads
    tile = _tile_shape(q.device, group, is_decode)
    grid = (triton.cdiv(max_seqlen_q, tile["TOKENS_PER_TILE"]), kv_heads, num_seqs)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), IS_DECODE=is_decode,
        # Triton's interpreter multiplies bfloat16 operands of tl.dot as raw 16-bit integers
        # (triton 3.9); on the CPU, where only the interpreter runs, dot in float32 instead.
        UPCAST_DOT=q.device.type != "cuda", **tile,
    )  # fmt: skip
    return out


def _tile_shape(device: torch.device, group: int, is_decode: bool) -> dict[str, int]:
    """Rows and key-tile width. tl.dot wants every dimension >= 16; bigger tiles pay on a GPU,
    smaller ones keep the CPU interpreter fast at test shapes."""
    group_pad = triton.next_power_of_2(group)
    rows = 16 if is_decode or device.type != "cuda" else 64
    block_m = max(rows, group_pad)
    return {
        "GROUP_PAD": group_pad,
        "TOKENS_PER_TILE": 1 if is_decode else block_m // group_pad,
        "BLOCK_M": block_m,
        "BLOCK_N": 64 if device.type == "cuda" else 16,
    }
