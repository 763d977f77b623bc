"""The CPU attention backend (``--attention-backend torch``): torch ops and csrc/attention.c, and the
reference the kernels are tested against.

Its KV cache is head-major, per layer [kv_heads, num_blocks, block_size, head_dim] (the other
backends keep the shared [num_blocks, block_size, kv_heads, head_dim]): gathering a sequence's
blocks along dim 1 then yields, for each KV head, its keys as one contiguous [tokens, head_dim]
matrix, so a decode multiplies every query head only by its own KV head's keys, in plain
batched matmuls, with no copy besides the one gather.

Per step, ``build_metadata`` plans the work on the host (no device sync later):
- every sequence with query length 1 (decodes, and one-token prefill chunks) is a decode. The
  decodes are sorted by context length and cut into a few groups of similar length, so that
  padding stays small; each group gathers its K/V blocks with one ``index_select`` per cache
  into [kv_heads, n, L, head_dim] and attends with two batched matmuls (see ``_decode``);
- every longer chunk is a prefill: with nothing cached before it, it attends causally to its
  own new K/V; otherwise it reads its context from the cache under an offset causal mask, as a
  view when the context's blocks are consecutive (the common case), else through one gather.

Where the CPU kernels take the tensors (kernels/cpu/bindings.py), they serve the decodes instead,
and on CPUs without AMX the prefills too: every token of a chunk as one query over the cached
keys up to its own position (``query_*`` fields; the step's K/V are stored first; the kernel
takes a long run of one prompt's tokens as tiles of 16 tokens, 8 with AVX2, see
kernels/cpu/csrc/attention.c). With AMX tiles
torch's SDPA multiplies the prefill's bfloat16 blocks in them and beats the kernel's one query
row at a time (``benchmarks/attention_cpu.py``: 1.2x at 6 prompts of 300 tokens, 4x at one of
2,048), so prefills keep the SDPA plans there. With AVX2 only the kernel's float tiles win up to
about a thousand tokens of context and SDPA beyond, so chunks reaching further go to SDPA; without
either the kernel's portable loop is slower throughout (``kernel_prefill_context``). The
torch-ops plans are made only when a layer reads them.

With ``kv_cache_dtype="int8"`` each cache row is head_dim int8 values and their float32 scale
(engine/layers/attention/kv_quant.py): the kernels store rows quantized and read them scaled as they go;
the torch-ops paths quantize with the same arithmetic and dequantize what they gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.engine.layers.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    common_metadata_fields,
    to_device,
)
from kvserve.engine.layers.attention.cpu_plans import (
    DecodeGroup,
    DecodePlan,
    PrefillPlan,
    host_step,
    plan_decode,
    plan_prefill,
)
from kvserve.engine.layers.attention.kv_quant import dequantize_rows, quantize_rows
from kvserve.engine.layers.attention.variants import eager_attention, soft_cap, softmax_with_sinks
from kvserve.engine.model_input import ModelInput
from kvserve.kernels.cpu.abi import cache_row_width
from kvserve.kernels.cpu.bindings import CpuKernels, kernels_for, load_kernels


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    store_tokens: torch.Tensor | None = None  # tokens whose slot is not -1; None = every token
    store_slots: torch.Tensor | None = None  # their slots (``slot_mapping`` when None above)
    # the torch-ops plans, made on first use and kept per sliding window (None: full attention):
    # the decodes' (``plan_decode(window)``), and the SDPA plans of every prefill chunk or (True)
    # of those the kernel's queries leave (``plan_prefills(after_kernel, window)``)
    plan_decode: Callable[[int | None], DecodePlan] | None = None
    decodes: dict[int | None, DecodePlan] = field(default_factory=dict)
    plan_prefills: Callable[[bool, int | None], list[PrefillPlan]] | None = None
    prefills: dict[tuple[bool, int | None], list[PrefillPlan]] = field(default_factory=dict)
    # the CPU kernel's queries: the decodes, and every token of the prefill chunks the backend
    # sends to the kernel when each token's K/V is stored (the kernel reads keys from the cache);
    # int32 rows, their sequences, and how many keys each sees (its position + 1). None: no query
    # for the kernel.
    query_tokens: torch.Tensor | None = None
    query_seqs: torch.Tensor | None = None
    query_ctx: torch.Tensor | None = None
    every_token_queried: bool = False  # the kernel's queries cover the whole step

    def decode_plan(self, window: int | None = None) -> DecodePlan:
        """The grouped, padded plan of the torch-ops decode, made once per step and window by
        the first layer that needs it (none does when the CPU kernel runs every layer)."""
        if window not in self.decodes:
            self.decodes[window] = self.plan_decode(window)
        return self.decodes[window]

    def prefill_plans(self, after_kernel: bool, window: int | None = None) -> list[PrefillPlan]:
        """The SDPA plans of the step's prefill chunks (``after_kernel``: only of those the CPU
        kernel's queries did not cover), made once per step and window by the first layer that
        needs them (none does when the CPU kernel takes every token)."""
        key = (after_kernel, window)
        if key not in self.prefills:
            planned = self.plan_prefills is not None
            self.prefills[key] = self.plan_prefills(after_kernel, window) if planned else []
        return self.prefills[key]


# With the kernel's AVX2 path (tiles of 8 prompt tokens in floats), prefill chunks whose context
# reaches past this many tokens go to torch's SDPA: a tile widens its whole context's keys to
# floats, which leave the core's cache at a few thousand keys, and SDPA is faster from there
# (``benchmarks/attention_cpu.py``; figures in docs/performance/step_profile.md).
AVX2_KERNEL_PREFILL_CONTEXT = 1024
EVERY_CONTEXT = 1 << 62


def kernel_prefill_context(kv_cache_dtype: str = "auto") -> int:
    """The longest context (the chunk's own tokens included) at which a prefill chunk's tokens go
    through the CPU kernel rather than torch's SDPA: none with AMX tiles for SDPA to multiply in;
    every one with the kernel's AVX-512 path, or over an int8 cache (which the kernel reads as its
    rows are; SDPA would take a dequantized copy of the context, summed in another order than the
    decodes that read it); AVX2_KERNEL_PREFILL_CONTEXT with its AVX2 path; none with its portable
    loop only (3-7x slower than SDPA)."""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return 0
    kernels = load_kernels()
    if kernels is None or kernels.attention_vector_bits >= 512 or kv_cache_dtype == "int8":
        return EVERY_CONTEXT
    return AVX2_KERNEL_PREFILL_CONTEXT if kernels.attention_vector_bits == 256 else 0


class CpuAttentionBackend(AttentionBackend):
    name = "torch"
    kv_cache_dtypes = ("auto", "int8")
    # the window in the torch ops, the C kernel and the fused decode step; the soft cap and sinks in
    # the torch ops (layers/attention/variants.py) and the C kernel's portable loop (one query per
    # item: no AVX fast path, no prefill tiles), not in the fused decode step
    variants = frozenset({"sliding_window", "logits_soft_cap", "sinks"})

    def __init__(self, block_size: int, prefill_in_kernel: bool | None = None, kv_cache_dtype: str = "auto"):
        super().__init__(block_size, kv_cache_dtype)
        # prefill chunks of up to this context as the CPU kernel's queries (see the module
        # docstring); ``prefill_in_kernel`` True: every chunk, False: none; the default follows the CPU
        self.kernel_prefill_context = (kernel_prefill_context(kv_cache_dtype) if prefill_in_kernel is None
                                       else EVERY_CONTEXT if prefill_in_kernel else 0)

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        width = cache_row_width(head_dim, self.kv_cache_dtype == "int8")
        return (num_kv_heads, num_blocks, self.block_size, width)

    def build_metadata(self, inp: ModelInput, device: torch.device) -> CpuAttentionMetadata:
        meta = CpuAttentionMetadata(**common_metadata_fields(inp, self.block_size, device))
        slots = np.asarray(inp.slot_mapping, dtype=np.int64)
        if (slots < 0).any():
            meta.store_tokens = to_device(np.flatnonzero(slots >= 0), device)
            meta.store_slots = meta.slot_mapping.index_select(0, meta.store_tokens)
        step = host_step(inp, self.block_size)  # host-side numpy: no device sync
        decode_seqs = np.flatnonzero(step.query_lens == 1)
        if decode_seqs.size:
            meta.plan_decode = lambda window: plan_decode(step, decode_seqs, self.block_size, window, device)
        prefill_seqs = np.flatnonzero(step.query_lens > 1)
        in_kernel = step.context_lens[prefill_seqs] <= self.kernel_prefill_context
        if meta.store_tokens is not None:  # the kernel reads a token's keys from the cache
            in_kernel[:] = False
        if prefill_seqs.size:
            left = prefill_seqs[~in_kernel]
            meta.plan_prefills = lambda after_kernel, window: [
                plan_prefill(step, i, self.block_size, window, device)
                for i in (left if after_kernel else prefill_seqs)
            ]
        meta.every_token_queried = meta.store_tokens is None and bool(in_kernel.all())
        if meta.every_token_queried:
            queried = np.arange(step.starts[-1])
            seq_of = np.repeat(np.arange(len(step.query_lens)), step.query_lens)
        elif in_kernel.any():  # the decodes and the chunks the kernel takes, each token once
            seqs = np.sort(np.concatenate([decode_seqs, prefill_seqs[in_kernel]]))
            lens = step.query_lens[seqs]
            seq_of = np.repeat(seqs, lens)
            queried = step.starts[seq_of] + np.arange(len(seq_of)) - np.repeat(np.cumsum(lens) - lens, lens)
        else:
            queried, seq_of = step.starts[decode_seqs], decode_seqs
        if queried.size:
            meta.query_tokens = to_device(queried, device, torch.int32)
            meta.query_seqs = to_device(seq_of, device, torch.int32)
            meta.query_ctx = to_device(np.asarray(inp.positions)[queried] + 1, device, torch.int32)
        return meta

    def create_impl(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: bool = False) -> AttentionImpl:
        self.check_variants(sliding_window, logits_soft_cap, sinks)
        variant = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
        return CpuAttentionImpl(num_heads, num_kv_heads, head_dim, scale, **variant)


class CpuAttentionImpl(AttentionImpl):
    """Over caches of ``CpuAttentionBackend.kv_cache_shape``: [kv_heads, blocks, block_size, D]
    (D + 4 int8 elements per row in an int8 cache)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, **variant):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, **variant)
        # whether the CPU decode kernel takes this layer's shapes (the dtype is known per call)
        self._kernel_shapes = CpuKernels.supports_attention(num_heads, num_kv_heads, head_dim)

    @property
    def attends_in_c(self) -> bool:
        return self._kernel_shapes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: CpuAttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        kernels = kernels_for(q, k, v, out)  # CPU, one supported dtype: the C kernels
        if kernels is not None and not (CpuKernels.takes_caches(q.dtype, k_cache, v_cache)
                                        and (self._kernel_shapes or k_cache.dtype != torch.int8)):
            kernels = None  # (the int8 store quantizes rows of up to MAX_HEAD_DIM)
        self._store(k, v, k_cache, v_cache, meta, kernels)
        if kernels is not None and self.attends_in_c and meta.query_tokens is not None:
            # prefill and decode tokens alike: each query over the cached keys up to its position
            kernels.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_seqs,
                                 meta.query_tokens, out, self.scale, ctx_lens=meta.query_ctx,
                                 window=self.sliding_window, soft_cap=self.logits_soft_cap,
                                 sinks=None if sinks is None else sinks.float())
            if meta.every_token_queried:
                return out
            plans = meta.prefill_plans(True, self.sliding_window)
        else:
            if meta.plan_decode is not None:
                decode = meta.decode_plan(self.sliding_window)
                parts = [self._decode(q.index_select(0, g.tokens), k_cache, v_cache, g, sinks)
                         for g in decode.groups]
                out.index_copy_(0, decode.tokens, parts[0] if len(parts) == 1 else torch.cat(parts))
            plans = meta.prefill_plans(False, self.sliding_window)
        for plan in plans:
            out[plan.start : plan.end] = self._prefill(q, k, v, k_cache, v_cache, plan, sinks)
        return out

    def _store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: CpuAttentionMetadata, kernels: CpuKernels | None) -> None:
        """Writes the step's K/V into the caches. Into an int8 cache, rows quantized, and ``k`` and
        ``v`` are overwritten with the values those rows hold (the stored tokens'; slot -1, CUDA
        graph padding, may keep its own): the step's attention over its own fresh tokens then sees
        what later steps (chunks, prefix hits) read from the cache, so a prompt's tokens do not
        depend on where its prefix came from."""
        if kernels is not None:  # one pass over the tokens; slot -1 skipped there
            kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            return
        if k_cache.dtype == torch.int8:
            k_rows, v_rows = quantize_rows(k), quantize_rows(v)
            k.copy_(dequantize_rows(k_rows, k.dtype))
            v.copy_(dequantize_rows(v_rows, v.dtype))
            k, v = k_rows, v_rows
        slots = meta.slot_mapping
        if meta.store_tokens is not None:
            k, v, slots = k[meta.store_tokens], v[meta.store_tokens], meta.store_slots
        width = k_cache.shape[-1]
        k_cache.view(self.num_kv_heads, -1, width).index_copy_(1, slots, k.transpose(0, 1))
        v_cache.view(self.num_kv_heads, -1, width).index_copy_(1, slots, v.transpose(0, 1))

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                group: DecodeGroup, sinks: torch.Tensor | None) -> torch.Tensor:
        """Attention of n one-token queries over their padded contexts.

        One gather per cache gives [kv_heads * n, L, D]; the query heads that share a KV head
        form the rows of one small matrix, so each product is a batched matmul over
        (KV head, sequence) pairs that multiplies only what belongs together.
        """
        n, length, kv_heads, d = group.num_seqs, group.padded_len, self.num_kv_heads, self.head_dim
        group_size = self.num_heads // kv_heads
        rows_of = group.rows_in(k_cache)
        # a gather of whole rows of a 2-D view: one memcpy per (head, block), several times
        # faster than index_select along dim 1 of the 4-D cache
        width = k_cache.shape[-1]
        row = k_cache.shape[2] * width
        keys = k_cache.view(-1, row).index_select(0, rows_of).view(kv_heads * n, length, width)
        values = v_cache.view(-1, row).index_select(0, rows_of).view(kv_heads * n, length, width)
        if k_cache.dtype == torch.int8:
            keys, values = dequantize_rows(keys, q.dtype), dequantize_rows(values, q.dtype)
        rows = (q * self.scale).view(n, kv_heads, group_size, d).transpose(0, 1)
        rows = rows.reshape(kv_heads * n, group_size, d)
        scores = torch.bmm(rows, keys.transpose(1, 2)).view(kv_heads, n, group_size, length)
        scores = soft_cap(scores, self.logits_soft_cap)
        if group.key_bias is not None:
            scores = scores + group.key_bias  # float32 from here: the softmax runs in float32
        head_sinks = None if sinks is None else sinks.view(kv_heads, 1, group_size, 1)
        probs = softmax_with_sinks(scores, head_sinks).to(q.dtype)
        out = torch.bmm(probs.view(kv_heads * n, group_size, length), values)
        return out.view(kv_heads, n, group_size, d).transpose(0, 1).reshape(n, self.num_heads, d)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, plan: PrefillPlan, sinks: torch.Tensor | None) -> torch.Tensor:
        if not plan.from_cache:
            # (over an int8 cache, k and v hold what the cache holds: see _store)
            keys = k[plan.start : plan.end].transpose(0, 1)
            values = v[plan.start : plan.end].transpose(0, 1)
        else:
            keys, values = (self._context(cache, plan, q.dtype) for cache in (k_cache, v_cache))
        queries = q[plan.start : plan.end].transpose(0, 1)
        if self.logits_soft_cap is not None or sinks is not None:  # variants SDPA lacks
            return eager_attention(queries, keys, values, plan.mask, self.scale, self.logits_soft_cap,
                                   sinks).transpose(0, 1)
        # 4-D inputs, or CPU SDPA falls back from its flash kernel to the slow math path
        out = F.scaled_dot_product_attention(
            queries[None], keys[None], values[None],
            attn_mask=plan.mask, is_causal=plan.mask is None, scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return out[0].transpose(0, 1)

    def _context(self, cache: torch.Tensor, plan: PrefillPlan, dtype: torch.dtype) -> torch.Tensor:
        """[kv_heads, context_len, D] in ``dtype``: a view of the cache when the blocks are
        consecutive (an int8 cache is read back into a new tensor)."""
        if plan.block_range is not None:
            blocks = cache[:, plan.block_range[0] : plan.block_range[1]]
        else:
            blocks = cache.index_select(1, plan.blocks)
        rows = blocks.flatten(1, 2)[:, : plan.context_len]
        return dequantize_rows(rows, dtype) if cache.dtype == torch.int8 else rows
