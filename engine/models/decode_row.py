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
say with ``use_rope`` whether q and k turn; Mistral and Ministral, windows on some or all layers)
or Gemma's (Gemma 2: four norms a layer, GELU-tanh, the attention logit soft cap; Gemma 3: QK-norm
and a rotary table per layer type), not mixtures of experts (gpt-oss, Mixtral, Qwen MoE) nor
attention sinks, over attention that csrc/attention.c computes (``AttentionImpl.attends_in_c``),
each layer reading its own KV cache group's block tables (``refusal`` names what does not fit);
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

from kvserve.engine.layers.activation import GeluTanhAndMul, SiluAndMul
from kvserve.engine.layers.attention.backend import AttentionMetadata
from kvserve.engine.layers.norm import GemmaRMSNorm, RMSNorm
from kvserve.kernels.cpu.abi import (
    ACT_GELU_TANH,
    ACT_SILU,
    DTYPES,
    MAX_FUSED_ROWS,
    PackedWeight,
    RowLayer,
    RowStep,
)
from kvserve.kernels.cpu.bindings import CpuKernels, kernels_for, load_kernels

NORMS = (RMSNorm, GemmaRMSNorm)  # both run csrc/elementwise.c's rms_norm (Gemma's weight holds 1 + w)
ACTS = {SiluAndMul: ACT_SILU, GeluTanhAndMul: ACT_GELU_TANH}


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


def norms(layer) -> tuple:
    """The layer's input and post-attention norms, Gemma's pre- and post-MLP norms, the attention's
    q and k norms (None where the layer has none)."""
    attn = layer.self_attn
    return (layer.input_layernorm, layer.post_attention_layernorm,
            getattr(layer, "pre_feedforward_layernorm", None),
            getattr(layer, "post_feedforward_layernorm", None),
            getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))


def _layer_refusal(layer, eps: float, scale: float) -> str | None:
    attn, mlp = layer.self_attn, layer.mlp
    if lacking := [type(m).__name__ for m in (layer, attn, mlp) if not computes(m)]:
        # (mixtures of experts: their layer and MLP; other attentions and layers)
        return f"decode_row.c does not compute {', '.join(lacking)}"
    if type(attn) is not layer.attention_class:
        return f"{type(layer).__name__} with attention {type(attn).__name__}"
    parts = norms(layer)
    if (parts[2] is None) != (parts[3] is None):
        return f"{type(layer).__name__} with one MLP norm of two"
    for norm in parts:
        if norm is not None and (type(norm) not in NORMS or norm.eps != eps):
            return f"{type(layer).__name__} with norm {type(norm).__name__} (eps {norm.eps})"
    if type(getattr(mlp, "act", None)) not in ACTS:
        return f"{type(mlp).__name__} with activation {type(getattr(mlp, 'act', None)).__name__}"
    impl = attn.attn.impl
    if impl.has_sinks:
        return f"{type(attn).__name__} with attention sinks"
    if not impl.attends_in_c:
        return f"{type(impl).__name__} does not attend in csrc/attention.c at these shapes"
    if impl.scale != scale:
        return f"{type(attn).__name__} with a scale per layer"
    if attn.qkv_proj.parallel.size != 1 or attn.qkv_proj.weight.device.type != "cpu":
        return "tensor parallelism or a device other than the CPU"
    return None


def refusal(model) -> str | None:
    """Why the fused step does not compute ``model``'s layers (naming the module or variant it
    lacks), or None when it does: built here (x86), every layer of a shape it computes, on the CPU."""
    if not len(model.layers):
        return "a model without layers"
    first = model.layers[0].self_attn.qkv_proj
    if first.weight.device.type != "cpu" or first.parallel.size != 1:
        return "tensor parallelism or a device other than the CPU"  # (a GPU model never builds the kernels)
    kernels = load_kernels()
    if kernels is None or not kernels.fused_rows:
        return "the fused decode step is built for x86 CPUs only"
    eps, scale = model.layers[0].input_layernorm.eps, model.layers[0].self_attn.attn.impl.scale
    for layer in model.layers:
        if (why := _layer_refusal(layer, eps, scale)) is not None:
            return why
    return None


class DecodeRow:
    """The fused one-token step over ``model``'s layers (a ``LlamaModel`` or a ``Gemma2Model``: a
    ``rotary`` table per ``rope_kind`` of its layers)."""

    def __init__(self, model):
        self.model = model
        self._layers: ctypes.Array | None = None
        self._linears: list = []  # the Linears behind _layers (kept: see _layer_array)
        self._bound_to: list | None = None  # the first and last layers' K caches when ``_layers`` was made
        self._any_rows = False  # every projection packed for gemm.c: more than MAX_FUSED_ROWS rows taken
        self._row_kernel = False  # the row kernel takes every projection (up to MAX_FUSED_ROWS rows)
        self._norm_dtype: torch.dtype | None = None  # every norm's weight dtype (None: they differ)
        rotary = getattr(model, "rotary", None)
        self._rope_kinds = list(rotary.keys()) if rotary is not None else None

    @staticmethod
    def fits(model) -> bool:
        return refusal(model) is None

    def _rope(self, layer) -> int:
        """The layer's rotary table, counted from 1 (0: q and k unrotated)."""
        if self._rope_kinds is not None:
            return self._rope_kinds.index(layer.rope_kind) + 1
        return int(getattr(layer.self_attn, "use_rope", True))

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
        if self._rope_kinds is not None:
            return [self.model.rotary[kind].cos_sin(positions, dtype) for kind in self._rope_kinds]
        return [self.model.rotary_emb.cos_sin(positions, dtype)]

    def _layer_array(self, dtype: torch.dtype) -> ctypes.Array:
        """The layers' weights and caches for the C call, made again when the caches are rebound."""
        bound = [(layer.self_attn.attn.k_cache.data_ptr(), layer.self_attn.attn.k_cache.shape)
                 for layer in (self.model.layers[0], self.model.layers[-1])]
        if self._layers is None or self._bound_to != bound:
            rows = []
            linears = [_linear(m, dtype) for m in projections(self.model)]
            norm_dtypes = set()
            for i, layer in enumerate(self.model.layers):
                attn = layer.self_attn
                parts = norms(layer)
                norm_dtypes |= {norm.weight.dtype for norm in parts if norm is not None}
                pre_mlp, post_mlp, q_norm, k_norm = (0 if n is None else n.weight.data_ptr()
                                                     for n in parts[2:])
                rows.append(RowLayer(
                    parts[0].weight.data_ptr(), parts[1].weight.data_ptr(),
                    *linears[4 * i:4 * i + 4], attn.attn.k_cache.data_ptr(), attn.attn.v_cache.data_ptr(),
                    attn.attn.impl.sliding_window or 0, self._rope(layer), pre_mlp, post_mlp, q_norm, k_norm,
                    attn.attn.impl.logits_soft_cap or 0.0, ACTS[type(layer.mlp.act)], attn.attn.kv_group))
            self._layers = (RowLayer * len(rows))(*rows)
            self._linears = linears  # (a GGUF weight's Linear holds the parts array its copy points to)
            self._bound_to = bound
            self._norm_dtype = norm_dtypes.pop() if len(norm_dtypes) == 1 else None
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
        if not isinstance(meta, AttentionMetadata) or meta.max_query_len != 1:
            return None
        groups = meta.group_metadata or [meta]  # each KV cache group's tables and slots
        if any(g.slot_mapping.numel() != rows or g.block_tables.shape[0] != rows for g in groups):
            return None
        kernels = kernels_for(hidden)
        model, dtype = self.model, hidden.dtype
        first = model.layers[0]
        attn = first.self_attn
        k_cache = attn.attn.k_cache
        if (kernels is None or k_cache.dim() != 4
                or not CpuKernels.takes_caches(dtype, k_cache, attn.attn.v_cache)):
            return None
        layers = self._layer_array(dtype)
        if self._norm_dtype not in DTYPES:
            return None
        if not self._any_rows and (rows > MAX_FUSED_ROWS or not self._row_kernel):
            return None  # more rows, or weights the row kernel does not take, need gemm.c's packed copies
        tables = self._cos_sin(positions, dtype)
        ctx = (positions + 1).to(torch.int32)
        slots = [g.slot_mapping.contiguous() for g in groups]
        n = len(groups)
        table_ptrs = (ctypes.c_void_p * n)(*(g.block_tables.data_ptr() for g in groups))
        strides = (ctypes.c_int64 * n)(*(g.block_tables.stride(0) for g in groups))
        slot_ptrs = (ctypes.c_void_p * n)(*(s.data_ptr() for s in slots))
        cos = (ctypes.c_void_p * len(tables))(*(c.data_ptr() for c, _ in tables))
        sin = (ctypes.c_void_p * len(tables))(*(s.data_ptr() for _, s in tables))
        step = RowStep(
            rows, hidden.shape[1], attn.num_heads, attn.num_kv_heads, attn.head_dim,
            first.mlp.down_proj.input_size, DTYPES[dtype], DTYPES[self._norm_dtype],
            CpuKernels.cache_code(dtype, k_cache), first.input_layernorm.eps,
            attn.attn.impl.scale, k_cache.shape[1], k_cache.shape[2], n, ctypes.addressof(table_ptrs),
            ctypes.addressof(strides), ctx.data_ptr(), ctypes.addressof(slot_ptrs), len(tables),
            ctypes.addressof(cos), ctypes.addressof(sin))
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        if not kernels.decode_row(layers, step, hidden, residual):
            return None
        return hidden, residual
