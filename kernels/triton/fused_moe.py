"""Triton fused mixture-of-experts: the experts' MLPs over tokens sorted and padded by expert.

Each token picks ``top_k`` experts, so the step has ``T * top_k`` (token, expert) entries,
numbered ``t * top_k + j``. ``align_by_expert`` sorts the entries by expert and pads each
expert's run up to a multiple of ``BLOCK_M``, so that every block of ``BLOCK_M`` rows belongs
to exactly one expert. Two launches of one grouped-GEMM kernel then do the whole layer:

    gate|up   [T * top_k, 2 * I]  = x[entry // top_k] @ w13[expert]^T
    down      [T * top_k, H]      = silu(gate) * up @ w2[expert]^T * routing weight

and a sum over each token's ``top_k`` rows gives the layer's output. A program owns one block of
rows (one expert) and one tile of output columns, and reads its expert's weights once for all
the block's rows. Blocks past the padded end carry expert id ``num_experts`` and exit at once.

Every size on the device is fixed by (T, top_k, num_experts, BLOCK_M) alone and nothing is read
back to the host, so a decode step with this layer can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvserve.kernels.triton.launch import moe_launch


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    weights_ptr,
    num_entries,
    N,
    K,
    a_stride_m,
    w_stride_e,
    w_stride_n,
    c_stride_m,
    TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= NUM_EXPERTS:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = ids < num_entries
    a_rows = ids // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * a_stride_m + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision="ieee")
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + ids, mask=row_ok, other=0.0)[:, None]
    c_offs = ids[:, None] * c_stride_m + cols[None, :]
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries sorted by expert, each expert's run padded to a multiple of ``block_m``.

    Returns ``sorted_ids`` (int64 ``[rows]``: entry numbers, ``T * top_k`` in padding rows) and
    ``block_expert`` (int64 ``[rows // block_m]``: each block's expert, ``num_experts`` for
    blocks past the end). ``rows`` is the worst case for these sizes, so it needs no read-back.
    """
    flat = topk_ids.flatten().long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    by_expert = flat[order]
    rank_in_expert = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[by_expert]
    dest = (padded_end - padded)[by_expert] + rank_in_expert
    rows = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((rows,), n, dtype=torch.long, device=flat.device).scatter_(0, dest, order)
    block_starts = torch.arange(0, rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    return sorted_ids, block_expert


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' SwiGLU MLPs, weighted and summed per token: ``[T, H]`` in ``x``'s dtype.

    x ``[T, H]``; w13 ``[E, 2 * I, H]`` (gate rows, then up rows); w2 ``[E, H, I]``;
    topk_weights (float) and topk_ids (int) ``[T, top_k]``.
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    on_gpu = x.device.type == "cuda"
    gate_up_launch = moe_launch(num_tokens * top_k, top_k, num_experts, False, on_gpu)
    down_launch = moe_launch(num_tokens * top_k, 1, num_experts, True, on_gpu)
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, gate_up_launch.constexprs["BLOCK_M"])
    weights = topk_weights.flatten().float().contiguous()
    gate_up = torch.empty(num_tokens * top_k, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_expert, weights, gate_up_launch)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    down = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _grouped_gemm(act, w2, down, sorted_ids, block_expert, weights, down_launch)
    return down.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _grouped_gemm(a, w, c, sorted_ids, block_expert, weights, launch) -> None:
    """``c[entry] = a[entry // TOP_K] @ w[expert(entry)]^T`` (times the entry's weight)."""
    num_experts, n, k = w.shape
    if w.stride(2) != 1:
        w = w.contiguous()
    grid = (block_expert.shape[0], triton.cdiv(n, launch.constexprs["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a, w, c, sorted_ids, block_expert, weights, c.shape[0], n, k,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0), **launch.kwargs(),
    )  # fmt: skip


def _check_shapes(x, w13, w2, topk_weights, topk_ids) -> None:
    num_experts, two_i, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [tokens, {hidden}], got {tuple(x.shape)}")
    if two_i % 2 or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w2 must be [{num_experts}, {hidden}, {two_i // 2}], got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [{x.shape[0]}, top_k]")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"x ({x.dtype}) and the expert weights ({w13.dtype}, {w2.dtype}) must share a dtype")
