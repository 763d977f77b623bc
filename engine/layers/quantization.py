"""Quantized weights for the CPU (``quantization="int8"`` or ``"int4"``, ``--quantization``).

After the weights are loaded, every linear projection (and the LM head) keeps its weight
quantized; mixtures of experts' expert weights stay in the serving dtype:

- **int8**: one scale per output row (symmetric, ``scale = max|w| / 127``), a byte a weight.
- **int4**: per output row and per 32 inputs a scale and a minimum in float16, ``w = scale * q +
  min`` with q in 0..15 (``scale = (max - min) / 15``): 4 bits a weight plus 1 for scale and
  minimum, the scheme of GGUF's Q4_1 in a layout of its own (the bundled model's file is Q4_1, so
  its weights come back as stored, up to the float16 rounding of its scales and minimums).
  The LM head takes int8 (``quantize_model``).

At a handful of rows a step only streams weights, so fewer bytes per weight make it faster: up
to ``MAX_FUSED_ROWS`` rows go through the CPU kernels (kernels/cpu/csrc/linear.c on AVX-512,
linear_avx2.c on AVX2; the fused decode step uses the same ones). On CPUs with AVX512-VNNI or
AVX2 those quantize the activations too, per 32 values (scale = max|x| / 127), and sum the
products in integers, as llama.cpp does for its quantized files; widening each weight to float
instead kept them compute-bound at about half the speed the weights stream from cache
(``CpuKernels.quantized_activation_block`` says which applies; docs/serving/quantization.md has
the figures and the accuracy cost). Without the kernels, int8 rows go through PyTorch's
weight-only kernel (``_weight_int8pack_mm``). At more rows
the matmul is bound by arithmetic, so larger batches (prefill chunks, decode steps of more
sequences) multiply by the weight dequantized, with activations in the serving dtype: in bfloat16
by csrc/gemm.c (AVX-512 or AVX2), which dequantizes a cache-sized panel of the weight at a
time and runs its tiles over it (no dequantized copy is written out: at 9 rows that made a step
~5x cheaper than dequantizing every weight whole and handing it to oneDNN); in float32, and for
int4 weights the kernels do not take (no AVX512-VNNI or AVX2, or an input width not a multiple of
64), by the whole weight dequantized.
The tied embedding keeps its float table for lookups; the LM head gets its own quantized copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.engine.config import QUANTIZATIONS
from kvserve.kernels.cpu.abi import DTYPES, MAX_FUSED_ROWS, Linear
from kvserve.kernels.cpu.bindings import CpuKernels, kernels_for, load_kernels
from kvserve.kernels.cpu.build import header_constant

log = logging.getLogger("kvserve.engine")

INT4_GROUP = header_constant("INT4_GROUP")  # inputs per scale and minimum
INT4_WIDTH = header_constant("INT4_WIDTH")  # int4 layers' input widths are multiples of this
SB_GROUPS = header_constant("SB_GROUPS")  # groups per superblock of the packed layout (csrc/linear.c)


def _lanes(groups: int) -> int:
    """Lanes per group in a superblock of this many groups (csrc/linear.c's sb_lanes)."""
    return SB_GROUPS // groups if SB_GROUPS % groups == 0 else 1


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [out, in] (uint8) two a byte, in csrc/linear.c's superblock layout: per 16
    groups of INT4_GROUP inputs (fewer in a row's last superblock, G), each group's 8 quads of 4
    values spread over P = 16 / G lanes (1 where G does not divide 16) and 8 / P steps (quad u:
    step u / P, lane g P + u % P); steps 2t and 2t + 1 share a vector (low and high 4 bits); a
    single step is 32 bytes, its values 0-31 low and 32-63 high."""
    out, k_in = q.shape
    groups = q.view(out, k_in // INT4_GROUP, INT4_GROUP)
    parts = []
    for start in range(0, groups.shape[1], SB_GROUPS):
        block = groups[:, start : start + SB_GROUPS]
        g = block.shape[1]
        lanes = _lanes(g)
        quads = block.reshape(out, g, 8 // lanes, lanes, 4)  # group, step, lane within the group, value
        steps = quads.permute(0, 2, 1, 3, 4).reshape(out, 8 // lanes, -1)
        if steps.shape[1] == 1:
            parts.append(steps[:, 0, :32] | (steps[:, 0, 32:] << 4))
        else:
            parts.append((steps[:, 0::2] | (steps[:, 1::2] << 4)).reshape(out, -1))
    return torch.cat(parts, dim=1)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``_pack_int4``'s inverse: [out, in] values."""
    out, half = packed.shape
    parts = []
    for start in range(0, half, 16 * SB_GROUPS):
        block = packed[:, start : start + 16 * SB_GROUPS]
        g = block.shape[1] // 16
        lanes = _lanes(g)
        if lanes == 8:  # one step
            steps = torch.cat((block & 0x0F, block >> 4), dim=1).reshape(out, 1, -1)
        else:
            pairs = block.reshape(out, 4 // lanes, -1)
            steps = torch.stack((pairs & 0x0F, pairs >> 4), dim=2).reshape(out, 8 // lanes, -1)
        quads = steps.reshape(out, 8 // lanes, g, lanes, 4).permute(0, 2, 1, 3, 4)
        parts.append(quads.reshape(out, g * INT4_GROUP))
    return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's weight [out, in] as ``method`` keeps it (see the module docstring).

    int8: ``data`` int8 [out, in], ``scales`` [out] in the weight's dtype. int4: ``data`` uint8
    [out, in / 2] (two values a byte, as ``_pack_int4`` lays them out), ``scales`` float16
    [out, 2, in / INT4_GROUP] (each group's scale, then each group's minimum)."""

    method: str
    data: torch.Tensor
    scales: torch.Tensor
    # the kernels' Linear per (bias, dtype), made once: the tensors it points to are kept with it
    _linears: dict = field(default_factory=dict, repr=False, compare=False)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype``: by the CPU kernels where they take it (every thread;
        a prefill step dequantizes each layer's weight once), else ``dequantize_torch``."""
        takes = dtype in DTYPES and (self.method == "int4" or self.scales.dtype == dtype)
        if takes and self.data.device.type == "cpu" and (kernels := load_kernels()) is not None:
            weight = kernels.dequantize(self.kernel_linear(None, dtype), dtype)
            if weight is not None:
                return weight
        return self.dequantize_torch(dtype)

    def dequantize_torch(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype`` by torch ops: the format's definition."""
        if self.method == "int8":
            return self.data.to(dtype) * self.scales.to(dtype)[:, None]
        out = self.data.shape[0]
        q = _unpack_int4(self.data).view(out, -1, INT4_GROUP).float()
        scale, low = self.scales.float().unbind(dim=1)
        return (q * scale[..., None] + low[..., None]).view(out, -1).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b``."""
        rows = x.reshape(-1, x.shape[-1])
        y = None
        few = 0 < rows.shape[0] <= MAX_FUSED_ROWS  # (a step of prefill chunks only asks for 0 rows of logits)
        if few and (kernels := kernels_for(rows, bias)) is not None:
            y = kernels.linear_rows(rows, self._rows_linear(bias, x.dtype))
            if y is None and self.method == "int8":
                y = kernels.small_linear(rows, self.data, bias, self.scales.to(x.dtype))
            bias = None if y is not None else bias
        if y is None and self.method == "int8" and few and x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.data, self.scales.to(x.dtype))
        if y is None and self._gemm_takes(x.dtype) and (kernels := kernels_for(rows, bias)) is not None:
            y = kernels.quantized_gemm(rows.contiguous(), self.kernel_linear(bias, x.dtype))  # bias as rows
            bias = None if y is not None else bias
        if y is None:
            y = F.linear(rows, self.dequantize(x.dtype))
        y = y.view(*x.shape[:-1], self.data.shape[0])
        return y if bias is None else y + bias

    def silu_and_mul(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(gate) * up`` of ``linear(rows, bias)`` for a gate|up weight, from csrc/gemm.c's
        panels as it multiplies, where it takes the call: bfloat16 rows, more of them than the row
        kernel takes (fewer go through it, as in ``linear``); else None."""
        if rows.shape[0] <= MAX_FUSED_ROWS or not self._gemm_takes(rows.dtype):
            return None
        if (kernels := kernels_for(rows, bias)) is None:
            return None
        return kernels.quantized_gemm(rows.contiguous(), self.kernel_linear(bias, rows.dtype), glu=True)

    def _gemm_takes(self, dtype: torch.dtype) -> bool:
        """Whether csrc/gemm.c multiplies activations of ``dtype`` by this weight (bfloat16; int8
        with scales of that dtype)."""
        return dtype == torch.bfloat16 and (self.method == "int4" or self.scales.dtype == dtype)

    def _rows_linear(self, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
        """``kernel_linear`` made once per bias and dtype (a decode step asks for it per projection)."""
        key = (None if bias is None else bias.data_ptr(), dtype)
        if (made := self._linears.get(key)) is None:
            # int8 scales in the activations' dtype, as the kernels read them
            weight = self
            if self.method == "int8":
                weight = QuantizedWeight("int8", self.data, self.scales.to(dtype))
            made = self._linears[key] = (weight.kernel_linear(bias, dtype), bias, weight)
        return made[0]

    def kernel_linear(self, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
        """The weight as the C kernels' ``Linear`` (the fused decode step)."""
        if self.method == "int8":
            return CpuKernels.linear_of(self.data, bias, self.scales, dtype)
        return CpuKernels.linear_of(self.data, bias, None, dtype, self.scales)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Per-row symmetric int8 (scales in the weight's dtype)."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    qweight = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", qweight.contiguous(), scales.to(weight.dtype))


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Per ``INT4_GROUP`` inputs of a row: min and scale = (max - min) / 15 as float16, q =
    round((w - min) / scale) in 0..15, packed two a byte (``_pack_int4``)."""
    out, k_in = weight.shape
    if k_in % INT4_WIDTH:
        raise ValueError(f"quantization 'int4' needs layer input widths that are multiples of {INT4_WIDTH}, "
                         f"got a weight of shape {list(weight.shape)} (with tensor parallelism, this "
                         f"rank's shard)")
    w = weight.float().view(out, -1, INT4_GROUP)
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15.0).half()
    low = low.half()
    step = scale.float()
    q = torch.round((w - low.float()) / step.clamp_min(torch.finfo(torch.float32).tiny))
    q = torch.where(step > 0, q, 0)
    q = q.clamp_(0, 15).to(torch.uint8).view(out, k_in)
    pairs = torch.stack((scale.squeeze(-1), low.squeeze(-1)), dim=1)
    return QuantizedWeight("int4", _pack_int4(q).contiguous(), pairs.contiguous())


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}


def quantize_model(model: torch.nn.Module, method: str, device: torch.device) -> None:
    """Quantize every layer of ``model`` that takes quantized weights (a ``quantize(method)``
    method: the projections take ``method``; the LM head takes int8 for int4 as well, since its
    errors go straight into the logits; GGUF files keep it at 6-8 bits too, the bundled model's
    at Q8_0), in place."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {method!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization {method!r} runs on the CPU only, got device {device.type!r}")
    kernels = load_kernels()
    if kernels is None or not kernels.gemm_quantized:
        # several times slower than bfloat16 per step: docs/serving/quantization.md has the figures
        log.warning("%s weights: this CPU lacks the kernels that multiply quantized weights in place "
                    "(AVX-512 or AVX2 with FMA, and AVX512-VNNI or AVX2 for int4); every step "
                    "dequantizes them, several times slower than serving the model unquantized here", method)
    elif method == "int4" and not kernels.quantized_activation_block(INT4_WIDTH):
        log.warning("int4 weights: the CPU kernels that multiply them (AVX512-VNNI, AVX2) are not available "
                    "here; every step multiplies the dequantized weights, slower than --quantization int8")
    for module in model.modules():
        if hasattr(module, "quantize"):
            module.quantize(method)
