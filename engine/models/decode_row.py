"""A decode step of up to 8 sequences in one kernel call (kernels/cpu/csrc/decode_row.c).

At one token per step (a single stream), a step on the CPU is ~120 projections of one row, of a few hundred
microseconds each; the per-op path wakes the second thread for each of them and runs Python
between them, which cost about a third of the step. ``DecodeRow`` hands the whole stack of
decoder layers to one C call instead, which keeps one OpenMP team for the step and runs the same
kernels with the same roundings (tests/engine/models/test_decode_row.py pins its tokens and logits to the
per-op path's).

It runs when every condition holds, else the step takes the per-op path unchanged: the CPU kernels
take the model's dtype (float32 or bfloat16) and were built for AVX-512 (on x86 CPUs with AVX2 only:
bfloat16 with every projection packed for csrc/gemm.c, below); one rank (no tensor parallelism);
every layer is the plain Llama layer (Llama, Qwen2: optional biases; Phi-3; SmolLM3, whose layers
say with ``use_rope`` whether q and k turn; not Qwen3's q/k norms, not mixtures of experts) over
attention that csrc/attention.c computes (``AttentionImpl.attends_in_c``);
the step is one token per sequence (a decode step), each with a cache slot; at most
``MAX_FUSED_ROWS`` of them, unless every projection has csrc/gemm.c's packed copy (bfloat16,
``layers/cpu_matmul.pack_weight``): then any number, the projections in gemm.c's tiles as the per-op
path multiplies them. At 32 rows the per-op path spent ~8 ms of a ~50 ms step outside the
projections and the attention (torch's dispatch of ~10 small ops a layer, Python between them); the
fused step leaves the elementwise work on one thread of the team (docs/performance/step_profile.md).
Larger batches of other weights (oneDNN's blocked copies, int8, int4) take the per-op path.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.engine.layers.attention.backend import AttentionMetadata
from kvserve.engine.layers.norm import RMSNorm
from kvserve.kernels.cpu.abi import DTYPES, MAX_FUSED_ROWS, PackedWeight, RowLayer, RowStep
from kvserve.kernels.cpu.bindings import CpuKernels, kernels_for, load_kernels


def computes(module) -> bool:
    """Whether decode_row.c computes ``module``'s forward: its class itself says so with
    ``in_decode_row = True`` in its own body (not inherited: a subclass may change the forward).
    The models mark their plain decoder layers, attentions and MLPs; this module imports none."""
    return vars(type(module)).get("in_decode_row", False) is True


def _linear(layer, dtype: torch.dtype):
    if layer.quantized is not None:
        return layer.quantized.kernel_linear(layer.bias, dtype)
    linear = CpuKernels.linear_of(layer.weight, layer.bias, None, dtype)
    if isinstance(layer.packed, PackedWeight):
        linear.packed = layer.packed.data.data_ptr()
    return linear


def projections(model):
    """Each layer's q|k|v, output, gate|up and down projections, in that order."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield from (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


class DecodeRow:
    """The fused one-token step over ``model``'s layers (a ``LlamaModel``)."""

    def __init__(self, model):
        self.model = model
        self._layers: ctypes.Array | None = None
        self._linears: list = []  # the Linears behind _layers (kept: see _layer_array)
        self._bound_to: list | None = None  # the first and last layers' K caches when ``_layers`` was made
        self._any_rows = False  # every projection packed for gemm.c: more than MAX_FUSED_ROWS rows taken
        self._row_kernel = False  # the row kernel takes every projection (up to MAX_FUSED_ROWS rows)

    @staticmethod
    def fits(model) -> bool:
        """Whether the fused step was built here (x86) and ``model``'s layers are all of the shape it
        computes, on the CPU."""
        if not len(model.layers):
            return False
        first = model.layers[0].self_attn.qkv_proj
        if first.weight.device.type != "cpu" or first.parallel.size != 1:
            return False  # settled before the CPU kernels are looked for (a GPU model never builds them)
        kernels = load_kernels()
        if kernels is None or not kernels.fused_rows:
            return False
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (not computes(layer) or type(attn) is not layer.attention_class or not computes(attn)
                    or not computes(mlp)
                    or any(type(norm) is not RMSNorm for norm in norms)
                    or not attn.attn.impl.attends_in_c
                    or attn.attn.impl.logits_soft_cap is not None or attn.attn.impl.has_sinks
                    or attn.attn.kv_group != model.layers[0].self_attn.attn.kv_group  # one block table a row
                    or attn.qkv_proj.parallel.size != 1 or attn.qkv_proj.weight.device.type != "cpu"):
                return False
        return True

    def _layer_array(self, dtype: torch.dtype) -> ctypes.Array:
        """The layers' weights and caches for the C call, made again when the caches are rebound."""
        bound = [(layer.self_attn.attn.k_cache.data_ptr(), layer.self_attn.attn.k_cache.shape)
                 for layer in (self.model.layers[0], self.model.layers[-1])]
        if self._layers is None or self._bound_to != bound:
            rows = []
            linears = [_linear(m, dtype) for m in projections(self.model)]
            for i, layer in enumerate(self.model.layers):
                attn = layer.self_attn
                rows.append(RowLayer(
                    layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                    *linears[4 * i:4 * i + 4], attn.attn.k_cache.data_ptr(), attn.attn.v_cache.data_ptr(),
                    attn.attn.impl.sliding_window or 0,
                    int(getattr(attn, "use_rope", True))))
            self._layers = (RowLayer * len(rows))(*rows)
            self._linears = linears  # (a GGUF weight's Linear holds the parts array its copy points to)
            self._bound_to = bound
            self._any_rows = all(linear.packed for linear in linears)
            kernels = load_kernels()  # (AVX-512: any weights; AVX2: int8 and int4, linear_avx2.c)
            self._row_kernel = all(kernels.row_kernel_takes(linear) for linear in linears)
        return self._layers

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual) for ``hidden`` [rows, H], one token of each of
        ``rows`` sequences, or None where the fused step does not apply (the caller then runs the
        layers)."""
        rows = hidden.shape[0]
        if (not isinstance(meta, AttentionMetadata) or meta.max_query_len != 1
                or meta.slot_mapping.numel() != rows or meta.block_tables.shape[0] != rows):
            return None
        kernels = kernels_for(hidden)
        model, dtype = self.model, hidden.dtype
        first = model.layers[0]
        attn, norm = first.self_attn, first.input_layernorm
        k_cache = attn.attn.k_cache
        if (kernels is None or norm.weight.dtype not in DTYPES or k_cache.dim() != 4
                or not CpuKernels.takes_caches(dtype, k_cache, attn.attn.v_cache)):
            return None
        layers = self._layer_array(dtype)
        if not self._any_rows and (rows > MAX_FUSED_ROWS or not self._row_kernel):
            return None  # more rows, or weights the row kernel does not take, need gemm.c's packed copies
        cos, sin = model.rotary_emb.cos_sin(positions, dtype)
        ctx = (positions + 1).to(torch.int32)
        slots = meta.slot_mapping.contiguous()
        tables = meta.block_tables
        step = RowStep(
            rows, hidden.shape[1], attn.num_heads, attn.num_kv_heads, attn.head_dim,
            first.mlp.down_proj.input_size, DTYPES[dtype], DTYPES[norm.weight.dtype],
            CpuKernels.cache_code(dtype, k_cache), norm.eps,
            attn.attn.impl.scale, k_cache.shape[1], k_cache.shape[2], tables.data_ptr(), tables.stride(0),
            ctx.data_ptr(), slots.data_ptr(), cos.data_ptr(), sin.data_ptr())
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        if not kernels.decode_row(layers, step, hidden, residual):
            return None
        return hidden, residual
