"""Triton paged attention over the KV cache: decode (one query token per sequence, optionally
split over the context) and prefill of packed, variable-length query chunks.

Both read every key and value from the paged cache ``[num_blocks, block_size, kv_heads,
head_dim]`` through ``block_tables``, so the new tokens' K/V must be stored first
(``store_kv_cache``). That makes prefix-cache hits and chunk continuations the ordinary case:
query token ``j`` of sequence ``i`` sits at position ``seq_lens[i] - q_len_i + j`` and attends
to keys ``0..position``; with a sliding window of W tokens (``window``), to keys
``max(0, position - W + 1)..position`` only, and no program reads a key below the first one its
rows see (the blocks behind a window may have been freed and reused). Two more variants, each a
constexpr of its own: ``SOFTCAP`` (Gemma 2: each scaled score s becomes cap * tanh(s / cap)) and
``SINKS`` (gpt-oss: one learned logit per query head in the softmax's denominator, weighing no
value; it starts each row's online softmax, in the first split only, so the reduce is unchanged).

A program owns one KV head and a tile of query rows: (query token, query head of that KV head's
group) pairs, so grouped-query heads share each K/V load. Keys are gathered ``BLOCK_N`` tokens at
a time through the block table (tile size independent of the cache block size) and folded in
with an online softmax accumulated in float32 (``_attend_keys``, shared by both kernels).

- Prefill runs over a flat grid of the step's real (sequence, query tile) pairs, listed on the
  host (``prefill_work``), longest key range first; a step with one long chunk among many decodes
  launches no empty programs.
- Decode runs one program per (split, KV head, sequence). With few sequences the context is split
  (flash-decoding): each split writes its partial max, sum and unnormalised output to a float32
  workspace, and ``_reduce_splits_kernel`` combines them. The split count depends on the batch
  only, never on host values of the step, so a decode can be captured in a CUDA graph.

Integer arguments that change from step to step (the block table's row stride, the split count)
are ``do_not_specialize``: Triton would otherwise compile a new variant whenever one becomes 1
or a multiple of 16. A sequence with no keys (seq_lens 0, a padded CUDA-graph row) yields zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton.decode_splits import (  # noqa: F401 - the split sizes, importable from here
    DecodeWorkspace,
    decode_num_splits,
    device_sm_count,
)
from kvserve.kernels.triton.kv_store import check_paged_cache
from kvserve.kernels.triton.launch import (
    MAX_SPLITS,
    decode_launch,
    prefill_launch,
    prefill_tile,
    reduce_launch,
)

NO_WINDOW = 1 << 30  # the window argument of full attention: every key is inside it
NO_KEY_MAX = tl.constexpr(-1.0e30)  # the running max before any key (see _query_tile)


@triton.jit
def _query_tile(q_ptr, row_offs, d, io_mask,
                BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Both kernels' start: the tile's query rows (``row_offs``: each row's offset in q; masked rows
    read as zero) and the online softmax's empty state (running max, running sum, accumulator)."""
    q = tl.load(q_ptr + row_offs[:, None] + d[None, :], mask=io_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    # a finite floor: a row that has seen no key yet (a window starting past a tile's first keys)
    # keeps exp(m - m_new) = 1 and adds exp(-inf - m) = 0, where -inf would make NaN
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NO_KEY_MAX
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    return q, m_i, l_i, acc


@triton.jit
def _attend_keys(q, m_i, l_i, acc, q_pos, key_lo, key_hi, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, scale,
                 window, c_stride_block, c_stride_slot, c_stride_head, d, d_ok,
                 soft_cap, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold keys [key_lo, key_hi) of one sequence (block table row at ``table_ptr``) into the
    running (max, sum, output) of each query row; row r sees keys <= q_pos[r], and with
    ``WINDOWED`` (a variant of its own: the bound costs registers) only those > q_pos[r] - window
    (a row may see none of a tile's keys: its max stays at NO_KEY_MAX and it adds nothing)."""
    for start in range(key_lo, key_hi, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)
        key_ok = key < key_hi
        block = tl.load(table_ptr + key // BLOCK_SIZE, mask=key_ok, other=0)
        slot = block.to(tl.int64) * c_stride_block + (key % BLOCK_SIZE) * c_stride_slot
        kv_offs = (slot + kv_head * c_stride_head)[:, None] + d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1) (inf-safe both ways)
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        seen = key_ok[None, :] & (key[None, :] <= q_pos[:, None])
        if WINDOWED:
            seen = seen & (key[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _sink_start(m_i, l_i, sinks_ptr, head, row_ok, first):
    """The online softmax's state after the sink's logit (rows where ``first``): max = the sink,
    sum = exp(0) = 1, the accumulator untouched."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    return tl.where(first, sink, m_i), tl.where(first, l_i + 1.0, l_i)


@triton.jit(do_not_specialize=["bt_stride", "window"])
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, work_ptr,
    scale, window, soft_cap, sinks_ptr, q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride,
    c_stride_block, c_stride_slot, c_stride_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    UPCAST_DOT: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(work_ptr + 2 * item)
    first = tl.load(work_ptr + 2 * item + 1) * TOKENS_PER_TILE
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    q_offset = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // GROUP_PAD
    g = rows % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q, m_i, l_i, acc = _query_tile(q_ptr, q_row * q_stride_t + head * q_stride_h, d, io_mask,
                                   BLOCK_M, D_PAD, UPCAST_DOT)
    if SINKS:
        m_i, l_i = _sink_start(m_i, l_i, sinks_ptr, head, row_ok, row_ok)
    kv_end = tl.minimum(seq_len, q_offset + first + TOKENS_PER_TILE)
    kv_start = 0
    if WINDOWED:
        kv_start = tl.maximum(q_offset + first - window + 1, 0)  # the tile's first row's first key
    m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, q_offset + tok, kv_start, kv_end, k_cache_ptr, v_cache_ptr,
                                 block_tables_ptr + seq.to(tl.int64) * bt_stride, kv_head, scale, window,
                                 c_stride_block, c_stride_slot, c_stride_head, d, d_ok,
                                 soft_cap, BLOCK_N, BLOCK_SIZE, UPCAST_DOT, WINDOWED, SOFTCAP)  # fmt: skip
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_offs = q_row[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["bt_stride", "num_splits", "window"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, seq_lens_ptr, scale, window, soft_cap, sinks_ptr, num_splits, q_stride_t, q_stride_h,
    o_stride_t, o_stride_h, bt_stride, c_stride_block, c_stride_slot, c_stride_head,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = 0
    if WINDOWED:
        first_key = tl.maximum(seq_len - window, 0)  # the window's first key
    # each split takes an equal, BLOCK_N-aligned share of the keys seen; trailing splits may be empty
    share = tl.cdiv(tl.cdiv(seq_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    key_lo = first_key + split * share
    key_hi = tl.minimum(seq_len, key_lo + share)

    g = tl.arange(0, BLOCK_M)  # rows are the group's query heads; rows >= GROUP are padding
    head = kv_head * GROUP + g
    row_ok = g < GROUP
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q, m_i, l_i, acc = _query_tile(q_ptr, seq.to(tl.int64) * q_stride_t + head * q_stride_h, d, io_mask,
                                   BLOCK_M, D_PAD, UPCAST_DOT)
    if SINKS:  # in the first split only (the reduce sums the splits' denominators)
        m_i, l_i = _sink_start(m_i, l_i, sinks_ptr, head, row_ok, row_ok & (split == 0))
    m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1,
                                 key_lo, key_hi, k_cache_ptr, v_cache_ptr,
                                 block_tables_ptr + seq.to(tl.int64) * bt_stride, kv_head, scale, window,
                                 c_stride_block, c_stride_slot, c_stride_head, d, d_ok,
                                 soft_cap, BLOCK_N, BLOCK_SIZE, UPCAST_DOT, WINDOWED, SOFTCAP)  # fmt: skip
    if SPLIT:
        part = (seq.to(tl.int64) * num_splits + split) * (GROUP * tl.num_programs(1)) + head
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        o_offs = seq.to(tl.int64) * o_stride_t + head[:, None] * o_stride_h + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_splits, o_stride_t, o_stride_h,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    part = (seq * num_splits + s) * tl.num_programs(1) + head
    m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    total_max = tl.max(m, 0)
    total_max = tl.where(total_max == float("-inf"), 0.0, total_max)  # no keys at all: zeros
    weight = tl.where(m > float("-inf"), tl.exp(m - total_max), 0.0)
    denom = tl.sum(weight * tl.load(part_sum_ptr + part, mask=s_ok, other=0.0), 0)
    d = tl.arange(0, D_PAD)
    acc = tl.load(part_out_ptr + part[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.maximum(denom, 1e-30)
    tl.store(out_ptr + seq * o_stride_t + head * o_stride_h + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


# ---------------------------------------------------------------- entry points


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int = 1,
    workspace: DecodeWorkspace | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached keys (its last ``window`` keys
    with a sliding window; scores capped at ``soft_cap``; ``sinks`` [num_heads] in each head's
    softmax denominator).

    q ``[B, num_heads, head_dim]``; block_tables int32 ``[B, max_blocks]``; seq_lens int32
    ``[B]`` (keys per sequence, including the current token). With ``num_splits`` > 1 each
    sequence's context is cut into that many parts, combined by a second kernel through
    ``workspace`` (a temporary one when None). Returns ``[B, num_heads, head_dim]``. Needs no host
    synchronisation, so it can be captured in a CUDA graph.
    """
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    q, out = _check(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, out)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if num_seqs == 0:
        return out
    split = num_splits > 1
    if split and workspace is None:
        workspace = DecodeWorkspace.allocate(num_seqs * num_splits, num_heads, head_dim, q.device)
    if split and workspace.rows() < num_seqs * num_splits:
        raise ValueError(f"the decode workspace holds {workspace.rows()} rows, "
                         f"{num_seqs} sequences x {num_splits} splits need {num_seqs * num_splits}")
    parts = (workspace.out, workspace.max, workspace.sum) if split else (out, out, out)
    launch = decode_launch(head_dim, num_heads // kv_heads, k_cache.shape[1], split, q.device.type == "cuda",
                           windowed=window is not None, soft_cap=soft_cap is not None,
                           sinks=sinks is not None)
    _paged_decode_kernel[(num_splits, kv_heads, num_seqs)](
        q, k_cache, v_cache, out, *parts, block_tables, seq_lens, scale, window or NO_WINDOW, soft_cap or 1.0,
        _sinks(sinks, num_heads, q), num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), **launch.kwargs(),
    )  # fmt: skip
    if split:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            *parts, out, num_splits, out.stride(0), out.stride(1), **reduce_launch(head_dim).kwargs(),
        )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    work: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query chunks over the paged cache (each token over its last
    ``window`` keys with a sliding window; ``soft_cap`` and ``sinks`` as in the decode).

    q ``[T, num_heads, head_dim]`` holds sequence ``i``'s new tokens at rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` (int32 ``[B+1]``); seq_lens int32 ``[B]`` is each
    sequence's context length after this step, this chunk included. ``work`` is the launch's list
    of (sequence, query tile) pairs from ``prefill_work``; pass it when the query lengths are known
    on the host, else it is built from ``cu_seqlens_q`` read back. Returns ``[T, num_heads, head_dim]``.
    """
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens_q must have shape ({num_seqs + 1},), got {tuple(cu_seqlens_q.shape)}")
    q, out = _check(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, out)
    head_dim = q.shape[2]
    group = q.shape[1] // k_cache.shape[2]
    launch = prefill_launch(head_dim, group, k_cache.shape[1], q.device.type == "cuda", q.element_size(),
                            windowed=window is not None, soft_cap=soft_cap is not None,
                            sinks=sinks is not None)
    if work is None:
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        work = prefill_work(q_lens, seq_lens.tolist(), launch.constexprs["TOKENS_PER_TILE"], q.device)
    if work.shape[0] == 0:
        return out
    _paged_prefill_kernel[(work.shape[0], k_cache.shape[2])](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, work, scale, window or NO_WINDOW,
        soft_cap or 1.0, _sinks(sinks, q.shape[1], q), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), **launch.kwargs(),
    )  # fmt: skip
    return out


def prefill_work(query_lens: list[int], seq_lens: list[int], tokens_per_tile: int,
                 device: torch.device) -> torch.Tensor:
    """int32 ``[W, 2]``: one (sequence, query tile) row per tile that holds real query tokens,
    the tiles with the most keys to read first (they take longest, so they start first)."""
    items = []
    for seq, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for tile in range(-(-q_len // tokens_per_tile)):
            keys = min(seq_len, seq_len - q_len + (tile + 1) * tokens_per_tile)
            items.append((-keys, seq, tile))
    items.sort()
    pairs = torch.tensor([(seq, tile) for _, seq, tile in items], dtype=torch.int32).reshape(len(items), 2)
    if device.type == "cuda":
        return pairs.pin_memory().to(device, non_blocking=True)
    return pairs.to(device)


def prefill_tile_shape(device: torch.device, group: int) -> dict[str, int]:
    """A prefill tile's rows and the query tokens it covers on ``device`` (``launch.prefill_tile``)."""
    return prefill_tile(device.type == "cuda", group)


def _check(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, out):
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
    return q, torch.empty_like(q) if out is None else out


def _sinks(sinks: torch.Tensor | None, num_heads: int, q: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them (float32, one per query head); ``q`` where there are none
    (a pointer the kernel never reads)."""
    if sinks is None:
        return q
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [{num_heads}] (one per query head), got {tuple(sinks.shape)}")
    return sinks.to(device=q.device, dtype=torch.float32).contiguous()


def upcast_dot(device: torch.device) -> bool:
    # Triton's interpreter multiplies bfloat16 operands of tl.dot as raw 16-bit integers
    # (triton 3.9); on the CPU, where only the interpreter runs, dot in float32 instead.
    return device.type != "cuda"
