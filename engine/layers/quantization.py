"""int8 weights for the CPU (``quantization="int8"``, ``--quantization int8``).

After the weights are loaded, every projection (and the LM head) keeps its weight as int8 with
one scale per output row (symmetric, ``scale = max|w| / 127``). At a handful of rows a step only
streams weights, so reading a byte instead of two per weight nearly halves it: one row (a single
stream's step) and the fused decode step of up to 8 sequences go through the CPU kernels
(kernels/csrc/linear.c); other steps of up to 8 rows through PyTorch's int8 weight-only kernel
(``_weight_int8pack_mm``). At more rows the matmul is bound by arithmetic and that kernel is
slower than the bf16 GEMM, so larger batches multiply by the weight dequantized on the fly, with
activations in the serving dtype.

On CPUs with AVX512-VNNI the few-row kernels quantize the activations too, per 32 values (scale
= max|x| / 127), and sum 64 products per instruction in integers, as llama.cpp does for its
quantized files: widening each int8 weight to float kept them compute-bound at about half the
speed the weights stream from cache (``CpuKernels.int8_activation_block`` says which applies;
README "Where a step's time goes" has the figures and the accuracy cost).
The tied embedding keeps its float table for lookups; the LM head gets its own int8 copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.engine.config import QUANTIZATIONS
from kvserve.kernels.cpu_kernels import kernels_for

# up to this many rows the int8 kernel beats the bf16 GEMM (measured on AVX-512 with bf16)
INT8_KERNEL_MAX_ROWS = 8


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], scales [out] in the weight's dtype): per-row symmetric quantization."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    qweight = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return qweight.contiguous(), scales.to(weight.dtype)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for W = qweight * scales (row-wise)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1 and (kernels := kernels_for(rows, scales, bias)) is not None:
        y = kernels.small_linear(rows, qweight, bias, scales)  # one row: kernels/cpu_kernels.py
        return y.view(*x.shape[:-1], qweight.shape[0])
    if rows.shape[0] <= INT8_KERNEL_MAX_ROWS and x.device.type == "cpu":
        y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), qweight, scales)
    else:
        y = F.linear(rows, qweight.to(x.dtype) * scales[:, None])
    y = y.view(*x.shape[:-1], qweight.shape[0])
    return y if bias is None else y + bias


def quantize_model(model: torch.nn.Module, method: str, device: torch.device) -> None:
    """Quantize every layer of ``model`` that supports ``method`` (``quantize_int8``), in place."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {method!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization {method!r} runs on the CPU only, got device {device.type!r}")
    for module in model.modules():
        if hasattr(module, "quantize_int8"):
            module.quantize_int8()
