"""The C kernels' interface as Python sees it: the constants of csrc/common.h (written once,
there), the element-type codes, each exported function's ctypes argument types, and the structs
the few-row linears and the fused decode step take (mirrors of ``lin_t``, ``row_layer_t`` and
``row_step_t``), and the KV cache layouts the attention kernels read (``takes_caches``,
``check_caches``). bindings.py loads the library and calls through these."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from kvserve.kernels.cpu.build import header_constant

MAX_HEAD_DIM = header_constant("MAX_HEAD_DIM")
KV_INT8 = header_constant("KV_INT8")  # the cache code of an int8 KV cache (rows of int8 + a float scale)
KV_SCALE_BYTES = header_constant("KV_SCALE_BYTES")
MAX_GROUP = header_constant("MAX_GROUP")
MAX_FUSED_ROWS = header_constant("MAX_FUSED_ROWS")
W_INT8 = header_constant("W_INT8")  # a Linear's kind for int8 weights (else the DTYPES code)
W_INT4 = header_constant("W_INT4")  # ... and for int4 weights (a scale and a minimum per INT4_GROUP inputs)
W_GGUF = header_constant("W_GGUF")  # ... and for GGUF block formats (csrc/kquant.c; ``KqPart``)

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C sources' DTYPE_* codes
_I64, _I32, _F32, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {  # every exported C function: its argument types (each returns int)
    "paged_decode": [_P, _I64, _I64, _P, _P, _I64, _I32, _P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32,
                     _F32, _P, _I64, _I64, _I32, _I32, _I32, _F32, _P, _I32],
    "rms_norm": [_P, _I64, _I64, _P, _I64, _P, _I32, _P, _I64, _I64, _I32, _I32, _I32, _F32, _I32, _I32],
    "silu_and_mul": [_P, _I64, _P, _I64, _I32, _I32, _I32, _I32],
    "gelu_tanh_and_mul": [_P, _I64, _P, _I64, _I32, _I32, _I32, _I32],
    "share_fp_mode": [_I32],
    "rotary": [_P, _I64, _I64, _I32, _I32, _I32, _P, _P, _I64, _I32, _I32],
    "store_kv": [_P, _I64, _I64, _P, _I64, _I64, _P, _I32, _I32, _I32, _P, _P, _I64, _I32, _I32],
    "argmax_rows": [_P, _I64, _I32, _I32, _P, _I32],
    "quantized_activation_block": [_I32],
    "small_linear": [_P, _I64, _P, _I64, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32],
    "inverse_cdf_draw": [_P, _I64, _I32, _I32, _P, _P, _I32],
    "small_linear_int8": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32],
    "linear_rows": [_P, _I32, _P, _P, _I32, _I32],
    "linear_takes": [_P],
    "dequantize_weight": [_P, _P, _I32, _I32],
    "decode_row": [_P, _I32, _P, _P, _P, _I32],
    "decode_row_available": [],
    "attention_vector_bits": [],
    "gemm_bf16_pack": [_P, _I64, _I32, _I32, _P, _I32],
    "gemm_bf16": [_P, _I64, _I32, _P, _P, _I32, _I32, _P, _I32, _I32],
    "gemm_bf16_available": [],
    "gemm_bf16_quantized": [_P, _P, _I64, _I32, _P, _I32, _I32],
    "gemm_bf16_quantized_available": [],
    "kq_isa": [],
    "kq_quantize": [_P, _I64, _I32, _I32, _I32, _P, _I32],
    "kq_matmul": [_P, _I64, _I32, _I32, _I32, _P, _I32, _P, _P, _I64, _I32, _I32, _I32],
    "kq_dequantize": [_P, _I64, _I32, _I32, _P, _I32, _P, _I64, _I32, _I32],
    "kq_gemm": [_P, _I64, _I32, _I32, _I32, _P, _I32, _P, _P, _I64, _I32, _I32],
    "kq_gemm_types": [_I32],
    "kq_vnni_peak": [_I32, _I32],
    "kq_repack_x16": [_P, _I64, _I32, _I32, _I32, _P, _I32],
    "gdn_vector_bits": [],
    "gdn_conv": [_P, _I64, _I32, _P, _P, _I32, _I32, _I32, _P, _I32],
    "gdn_prefill": [_P, _I64, _I32, _P, _P, _I32, _I32, _I32, _I32, _I32, _P, _P, _I32],
    "gdn_decode": [_P, _I64, _I32, _P, _P, _I32, _P, _I32, _P, _P, _I32, _I32, _I32, _I32, _P, _P, _I32],
    "gdn_gated_norm": [_P, _P, _I64, _P, _I32, _I32, _I32, _F32, _I32, _P, _I32],
    "gdn_gates": [_P, _I64, _I32, _P, _P, _I32, _I32, _P, _P],
    "sigmoid_gate": [_P, _I64, _P, _I64, _I64, _I32, _I32, _I32, _I32],
    "decode_row_hybrid": [_P, _I32, _P, _P, _P, _I32],
}


class PackedWeight(NamedTuple):
    """A bfloat16 weight [n_out, k_in] as csrc/gemm.c multiplies it: blocks of GEMM_VEC output
    features, each input pair's GEMM_VEC x 2 values side by side (``CpuKernels.pack_gemm_weight``)."""

    data: torch.Tensor
    n_out: int
    k_in: int


class Linear(ctypes.Structure):
    """csrc/common.h ``lin_t``: a few-row linear's weight (int8 with ``scales``, int4 with
    ``groups``, or the activations' dtype), rows ``row_bytes`` apart; a bfloat16 one may carry
    gemm.c's ``packed`` copy (``PackedWeight.data``), with which the fused step takes more rows."""

    _fields_ = [("w", _P), ("row_bytes", _I64), ("kind", _I32), ("scales", _P), ("bias", _P),
                ("n_out", _I32), ("k_in", _I32), ("groups", _P), ("packed", _P)]


class KqPart(ctypes.Structure):
    """csrc/kquant.h ``kq_part_t``: one part of a ``W_GGUF`` Linear (whose ``w`` points to an array
    of them and ``row_bytes`` counts them): ``rows`` output rows of ggml type ``type``."""

    _fields_ = [("w", _P), ("row_bytes", _I64), ("type", _I32), ("rows", _I32)]


class RowLayer(ctypes.Structure):
    """csrc/decode_row.c ``row_layer_t``: one decoder layer's weights, KV cache and group, and its
    variant (Gemma's MLP norms, QK-norm, soft cap, activation ``ACT_*``)."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", Linear), ("o", Linear), ("gate_up", Linear),
                ("down", Linear), ("k_cache", _P), ("v_cache", _P), ("window", _I32),
                ("rope", _I32), ("pre_mlp_norm", _P), ("post_mlp_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("soft_cap", _F32), ("act", _I32), ("group", _I32)]


ACT_SILU, ACT_GELU_TANH = 0, 1  # csrc/decode_row.c's codes of an MLP's gate activation


class RowStep(ctypes.Structure):
    """csrc/decode_row.c ``row_step_t``: the shapes, each row's place in each KV cache group's
    blocks (``tables``, ``table_stride``, ``slots``: arrays of one entry a group) and the rotary
    tables (``cos``, ``sin``: one pointer a table)."""

    _fields_ = [("rows", _I32), ("hidden", _I32), ("heads", _I32), ("kv_heads", _I32), ("head_dim", _I32),
                ("inter", _I32), ("dtype", _I32), ("norm_dtype", _I32), ("cache_dtype", _I32), ("eps", _F32),
                ("scale", _F32), ("num_blocks", _I64), ("block_size", _I32), ("num_groups", _I32),
                ("tables", _P), ("table_stride", _P), ("ctx", _P), ("slots", _P), ("num_rope", _I32),
                ("cos", _P), ("sin", _P)]


class HybridLayer(ctypes.Structure):
    """csrc/decode_row.c ``hyb_layer_t``: a hybrid's layer (Qwen3.5), Gated DeltaNet (``linear``) or
    gated full attention: its norms, projections, conv weight, state rows and gates' parameters, or
    its KV cache, QK-norm weights and group."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("mix", Linear), ("out", Linear), ("gate_up", Linear),
                ("down", Linear), ("linear", _I32), ("conv_w", _P), ("conv_states", _P), ("states", _P),
                ("A_log", _P), ("dt_bias", _P), ("gated_norm", _P), ("k_cache", _P), ("v_cache", _P),
                ("q_norm", _P), ("k_norm", _P), ("group", _I32)]


class HybridStep(ctypes.Structure):
    """csrc/decode_row.c ``hyb_step_t``: ``RowStep`` and the Gated DeltaNet layers' shapes, the
    rotary's width and each row's state slot."""

    _fields_ = [("row", RowStep), ("Hk", _I32), ("H", _I32), ("dk", _I32), ("dv", _I32), ("K", _I32),
                ("rot_dim", _I32), ("state_slots", _P), ("num_state_slots", _I64)]


def cache_row_width(head_dim: int, int8: bool) -> int:
    """Elements in the last dimension of a cache row: head_dim, or an int8 row's values and the
    ``KV_SCALE_BYTES`` of its scale (``KV_INT8``)."""
    return head_dim + KV_SCALE_BYTES if int8 else head_dim


def takes_caches(dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """CPU caches the attention kernels read beside queries of ``dtype``: that dtype, or int8
    (rows of int8 values and their float32 scale, ``KV_INT8``), contiguous rows."""
    kinds = (dtype, torch.int8)
    return all(c.is_cpu and c.dtype in kinds and c.stride(-1) == 1 for c in (k_cache, v_cache))


def cache_code(dtype: torch.dtype, cache: torch.Tensor) -> int:
    """The C sources' code for a cache beside queries of ``dtype``: KV_INT8 or a DTYPE_*."""
    return KV_INT8 if cache.dtype == torch.int8 else DTYPES[dtype]


def check_caches(dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int,
                 name: str) -> None:
    """ValueError unless the checked entries' K and V caches are what the kernels read beside
    queries (or K/V) of ``dtype`` with ``head_dim``."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
            and k_cache.shape == v_cache.shape and takes_caches(dtype, k_cache, v_cache)):
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(f"{name}: contiguous caches of one shape, of {kind} or int8")
    row = cache_row_width(head_dim, k_cache.dtype == torch.int8)
    if k_cache.shape[-1] != row:
        kind = str(k_cache.dtype).removeprefix("torch.")
        raise ValueError(f"{name}: a {kind} cache for head_dim {head_dim} has rows of {row}, "
                         f"got {k_cache.shape[-1]}")
