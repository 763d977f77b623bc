"""A hybrid's decode step in one kernel call (kernels/cpu/csrc/decode_row.c ``decode_row_hybrid``):
Qwen3.5's Gated DeltaNet and gated full-attention layers, as ``DecodeRow`` runs a dense model's.

One stream of Qwen3.5-2B on the per-op path runs ~25 torch ops and C calls a layer (the Gated
DeltaNet's gates alone were eight small ops), each C call a parallel region of its own, and Python
between them; the fused step keeps one OpenMP team for the step and runs the same kernels with the
same roundings: the projections through csrc/gemm.c's packed copies or linear.c's row kernel, the
gates, conv step and rule (``gdn_gate_values``, ``gdn_decode_item``) and the gated norm of
csrc/gated_delta.c, the attention's output gate (``sigmoid_gate_row``, which the per-op path runs
too). tests/kernels/cpu/test_decode_row_hybrid.py pins its tokens and logits to the per-op path's.

It runs where ``refusal`` finds nothing (x86 kernels, one rank, the CPU, every layer Qwen3.5's own
with a SiLU MLP, the Gated DeltaNet shapes csrc/gated_delta.c takes, its state and weights in the
model's dtype and float32 as the per-op path's C kernels take them, full attention that
csrc/attention.c computes without window, sinks or soft cap), and each step is one token of
sequences at distinct state slots (not a speculative verification's rows). Qwen3-Next (mixtures of
experts) takes the per-op path.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.engine.layers.activation import SiluAndMul
from kvserve.engine.layers.attention.backend import AttentionMetadata
from kvserve.engine.layers.norm import GemmaRMSNorm
from kvserve.engine.models.decode_row import _linear, computes
from kvserve.kernels.cpu.abi import DTYPES, MAX_FUSED_ROWS, HybridLayer, HybridStep, RowStep
from kvserve.kernels.cpu.bindings import CpuKernels, kernels_for, load_kernels
from kvserve.kernels.cpu.gated_delta import GatedDeltaKernels, gated_delta_kernels

LINEAR = "linear_attention"  # (engine/models/qwen3_5.py's layer type, which imports this module)


def _linear_refusal(mixer, dtype: torch.dtype) -> str | None:
    if not (mixer.conv1d.weight.dtype == mixer.norm_weight.dtype == dtype):
        return "a Gated DeltaNet conv or norm weight not of the model's dtype"
    if not (mixer.A_log.dtype == mixer.dt_bias.dtype == torch.float32):
        return "Gated DeltaNet gates' parameters not in float32"
    if mixer.recurrent_states.numel() and mixer.recurrent_states.dtype != torch.float32:
        return "Gated DeltaNet states not in float32"
    shape = (mixer.num_k_heads, mixer.num_v_heads, mixer.k_dim, mixer.v_dim)
    if not GatedDeltaKernels.takes(torch.empty(1, mixer.conv_size, dtype=dtype), *shape):
        return f"Gated DeltaNet heads {shape} that csrc/gated_delta.c does not take"
    return None


def _attention_refusal(attn, scale: float) -> str | None:
    impl = attn.attn.impl
    if impl.has_sinks or impl.sliding_window or impl.logits_soft_cap:
        return "full attention with sinks, a window or a soft cap"
    if not impl.attends_in_c:
        return f"{type(impl).__name__} does not attend in csrc/attention.c at these shapes"
    if impl.scale != scale or attn.rotary_dim % 2:
        return "full attention with a scale per layer or an odd rotary width"
    return None


def refusal(model) -> str | None:
    """Why the fused step does not compute ``model``'s layers (a ``Qwen3_5Model``), or None."""
    layers = list(model.layers)
    if not layers:
        return "a model without layers"
    embed = model.embed_tokens
    if embed.weight.device.type != "cpu" or embed.parallel.size != 1:
        return "tensor parallelism or a device other than the CPU"
    kernels = load_kernels()
    if kernels is None or not kernels.fused_rows:
        return "the fused decode step is built for x86 CPUs only"
    dtype, eps = embed.weight.dtype, layers[0].input_layernorm.eps
    full = [layer for layer in layers if layer.layer_type != LINEAR]
    if dtype not in DTYPES or not full or len(full) == len(layers):
        return "a dtype the kernels do not take, or not both kinds of layer"
    scale = full[0].self_attn.attn.impl.scale
    for layer in layers:
        mixer = layer.linear_attn if layer.layer_type == LINEAR else layer.self_attn
        if lacking := [type(m).__name__ for m in (layer, mixer, layer.mlp) if not computes(m)]:
            return f"decode_row.c does not compute {', '.join(lacking)}"  # (Qwen3-Next's mixer, experts)
        if type(layer.mlp.act) is not SiluAndMul:
            return f"an MLP with {type(layer.mlp.act).__name__}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.layer_type != LINEAR:
            norms += [mixer.q_norm, mixer.k_norm]
        if (any(type(n) is not GemmaRMSNorm or n.eps != eps for n in norms)
                or getattr(mixer, "eps", eps) != eps):
            return "norms of another kind or epsilon"
        linear = layer.layer_type == LINEAR
        why = _linear_refusal(mixer, dtype) if linear else _attention_refusal(mixer, scale)
        if why is not None:
            return why
    return None


class HybridDecodeRow:
    """The fused one-token step over a ``Qwen3_5Model``'s layers."""

    def __init__(self, model):
        self.model = model
        self._layers: ctypes.Array | None = None
        self._linears: list = []  # the Linears behind _layers (kept alive)
        self._bound_to: list | None = None  # the state and KV caches' addresses when _layers was made
        self._gemm = self._rows = False  # every projection packed for gemm.c / taken by the row kernel
        self._norm_dtype: torch.dtype | None = None

    @staticmethod
    def fits(model) -> bool:
        return refusal(model) is None

    def _bound(self) -> list:
        out = []
        for layer in self.model.layers:
            if layer.layer_type == LINEAR:
                mixer = layer.linear_attn
                out.append((mixer.conv_states.data_ptr(), mixer.recurrent_states.data_ptr()))
            else:
                out.append((layer.self_attn.attn.k_cache.data_ptr(), layer.self_attn.attn.v_cache.data_ptr()))
        return out

    def _layer_array(self, dtype: torch.dtype) -> ctypes.Array:
        bound = self._bound()
        if self._layers is not None and bound == self._bound_to:
            return self._layers
        rows, linears, norm_dtypes = [], [], set()
        for layer in self.model.layers:
            linear = layer.layer_type == LINEAR
            mixer = layer.linear_attn if linear else layer.self_attn
            mix, out = (mixer.in_proj, mixer.out_proj) if linear else (mixer.qkv_proj, mixer.o_proj)
            parts = [_linear(m, dtype) for m in (mix, out, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            linears += parts
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if linear:
                extra = (mixer.conv1d.weight.data_ptr(), mixer.conv_states.data_ptr(),
                         mixer.recurrent_states.data_ptr(), mixer.A_log.data_ptr(), mixer.dt_bias.data_ptr(),
                         mixer.norm_weight.data_ptr(), None, None, None, None, 0)
            else:
                attn = mixer.attn
                norms += [mixer.q_norm, mixer.k_norm]
                extra = (None,) * 6 + (attn.k_cache.data_ptr(), attn.v_cache.data_ptr(),
                                       mixer.q_norm.weight.data_ptr(), mixer.k_norm.weight.data_ptr(),
                                       attn.kv_group)
            norm_dtypes |= {n.weight.dtype for n in norms}
            rows.append(HybridLayer(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), *parts,
                                    int(linear), *extra))
        self._layers, self._linears, self._bound_to = (HybridLayer * len(rows))(*rows), linears, bound
        self._norm_dtype = norm_dtypes.pop() if len(norm_dtypes) == 1 else None
        self._gemm = all(linear.packed for linear in linears)
        kernels = load_kernels()
        self._rows = all(kernels.row_kernel_takes(linear) for linear in linears)
        return self._layers

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual), or None where the fused step does not take the
        step (the caller then runs the layers)."""
        rows = hidden.shape[0]
        if (not isinstance(meta, AttentionMetadata) or meta.max_query_len != 1 or meta.state_index is not None
                or meta.state_slots is None or len(meta.state_slots) != rows
                or len(set(meta.state_slots)) != rows):
            return None
        groups = meta.group_metadata or [meta]
        if any(g.slot_mapping.numel() != rows or g.block_tables.shape[0] != rows for g in groups):
            return None
        kernels, dtype = kernels_for(hidden), hidden.dtype
        layers = list(self.model.layers)
        full = next(layer for layer in layers if layer.layer_type != LINEAR).self_attn
        linear = next(layer.linear_attn for layer in layers if layer.layer_type == LINEAR)
        k_cache = full.attn.k_cache
        if (kernels is None or k_cache.dim() != 4
                or not CpuKernels.takes_caches(dtype, k_cache, full.attn.v_cache)
                or linear.conv_states.dtype != dtype or linear.recurrent_states.dtype != torch.float32):
            return None
        array = self._layer_array(dtype)
        if self._norm_dtype not in DTYPES or not (self._gemm or (self._rows and rows <= MAX_FUSED_ROWS)):
            return None
        cos, sin = self.model.rotary_emb.cos_sin(positions, dtype)
        ctx = (positions + 1).to(torch.int32)
        slots = [g.slot_mapping.contiguous() for g in groups]
        n = len(groups)
        table_ptrs = (ctypes.c_void_p * n)(*(g.block_tables.data_ptr() for g in groups))
        strides = (ctypes.c_int64 * n)(*(g.block_tables.stride(0) for g in groups))
        slot_ptrs = (ctypes.c_void_p * n)(*(s.data_ptr() for s in slots))
        cos_ptr, sin_ptr = (ctypes.c_void_p * 1)(cos.data_ptr()), (ctypes.c_void_p * 1)(sin.data_ptr())
        mlp = layers[0].mlp
        row = RowStep(rows, hidden.shape[1], full.num_heads, full.num_kv_heads, full.head_dim,
                      mlp.down_proj.input_size, DTYPES[dtype], DTYPES[self._norm_dtype],
                      CpuKernels.cache_code(dtype, k_cache), layers[0].input_layernorm.eps,
                      full.attn.impl.scale, k_cache.shape[1], k_cache.shape[2], n,
                      ctypes.addressof(table_ptrs), ctypes.addressof(strides), ctx.data_ptr(),
                      ctypes.addressof(slot_ptrs), 1, ctypes.addressof(cos_ptr), ctypes.addressof(sin_ptr))
        state_slots = torch.tensor(meta.state_slots, dtype=torch.int64)
        step = HybridStep(row, linear.num_k_heads, linear.num_v_heads, linear.k_dim, linear.v_dim,
                          linear.conv1d.weight.shape[-1], full.rotary_dim, state_slots.data_ptr(),
                          linear.conv_states.shape[0])
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        if not gated_delta_kernels().decode_row_hybrid(array, step, hidden, residual):
            return None
        return hidden, residual
