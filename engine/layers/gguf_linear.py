"""GGUF block-format weights kept as the file stores them, on the CPU (docs/design/gguf_kquants.md).

The GGUF loader hands a projection's tensors over as ``GGUFTensor`` (uint8 rows of the file's
blocks, a view of the memory-mapped file: no copy) where kernels/cpu/kquant.py multiplies their
type (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K); the linear layers narrow them to their rank's shard like
any checkpoint tensor and keep them as parts of a ``GGUFWeight`` (q, k and v, or gate and up, are
separate tensors of possibly different types in the file: each stays a part of its own; a part
the file stores in another type arrives as floats and stays a dense part). A projection's Q4_K
parts are then repacked (``GGUFTensor.repacked``: the int8 GEMM's panels, on AVX512-VNNI builds,
not in float32), their file pages handed back.

In bfloat16 a product quantizes the activation rows once (per 256 values, int8, as llama.cpp
does) and multiplies every part in its own format into its columns of the output: the few rows of
a decode by the block dots, a prefill chunk (``PANEL_FROM_ROWS`` rows up; ``GEMM_FROM_ROWS`` for
types whose GEMM rows are the dots' bits) by the int8 GEMM where this CPU class takes it for the
part's type (``gemm_takes``), else by dequantized bfloat16 panels
into the float GEMM where that GEMM has AVX512-BF16 and by the block dots where not
(``dots_over_panels``). In float32, and at more rows
than ``MAX_FUSED_ROWS`` on CPUs without AVX2 (the kernels' portable dots take fewer), it multiplies
dequantized panels of ``PANEL_ROWS`` output rows instead: float32 asks for the stored weights'
exact products, which the activations' int8 rounding (~0.6% of a product) would not give. Without
the kernels (no compiler) and on GPUs the loader dequantizes every tensor to the serving dtype.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import torch

from kvserve.engine.layers.cpu_matmul import linear as float_linear
from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS, W_GGUF, KqPart, Linear
from kvserve.kernels.cpu.kquant import (
    BLOCK_TYPES,
    Q4_K_X16,
    Q6_K_X16,
    REPACKED,
    X16_LANES,
    X16_SUPER,
    kquant_kernels,
)

GGML_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16", Q4_K_X16: "Q4_K_X16",
              Q6_K_X16: "Q6_K_X16"}
# KVSERVE_GGUF_REPACK=0 keeps the projections as the file stores them (as llama.cpp's --no-repack)
REPACK_SWITCH = "KVSERVE_GGUF_REPACK"
_MADV_DONTNEED = 4
PANEL_ROWS = 256  # output rows dequantized at a time where the float GEMM multiplies
# from this many activation rows (a prefill chunk) a bfloat16 product takes the int8 GEMM (or
# dequantized panels into the float GEMM): the crossover with the block dots, measured at a 1.7B
# projection (docs/design/gguf_kquants.md)
PANEL_FROM_ROWS = 128
# from this many rows a part whose type the int8 GEMM computes as the dots do, bit for bit
# (``kernels.gemm_alike``: AVX512-VNNI's K-quants), takes the GEMM: the crossover measured at a
# 1.7B projection (docs/design/gguf_kquants.md); the rows are alike on either side of it
GEMM_FROM_ROWS = 16


def ggml_name(ggml_type: int) -> str:
    return GGML_NAMES.get(ggml_type, f"ggml type {ggml_type}")


def gemm_from_rows(kernels, part: GGUFTensor) -> int:
    """From how many activation rows a product takes the int8 GEMM for ``part``, if it takes it:
    ``GEMM_FROM_ROWS`` where its rows are the dots' bits, else ``PANEL_FROM_ROWS`` (a prefill
    chunk: the rows then differ from the dots' in the order of their float sums)."""
    return GEMM_FROM_ROWS if kernels.gemm_alike(part.ggml_type) else PANEL_FROM_ROWS


def gemm_takes(kernels, part: GGUFTensor) -> bool:
    """Whether a prefill chunk multiplies ``part`` by the int8 GEMM (csrc/kquant_gemm.c): its type
    is one this CPU class measured faster there than in dequantized bfloat16 panels, and its
    width is whole 256-value blocks."""
    return kernels.gemm_takes(part.ggml_type) and part.shape[1] % 256 == 0


@dataclass(frozen=True)
class GGUFTensor:
    """A 2-D GGUF tensor as stored: ``data`` uint8 [rows, bytes of a row's blocks] (rows may lie
    further apart: a shard of columns), ``shape`` (rows, values per row); ``mapped``: ``data`` is a
    view of the memory-mapped file (not a copy). ``Q4_K_X16`` (``repacked``): ``data`` holds panels
    of ``X16_LANES`` rows, uint8 [rows / X16_LANES, a panel's bytes]."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]
    mapped: bool = False

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        """A shard, as ``torch.Tensor.narrow``: rows, or whole blocks of each row's values."""
        if self.ggml_type in X16_SUPER:
            raise ValueError("a repacked tensor is not sharded: shard the tensor as stored, then repack")
        if dim == 0:
            return GGUFTensor(self.data.narrow(0, start, length), self.ggml_type, (length, self.shape[1]),
                              self.mapped)
        values, size = BLOCK_TYPES[self.ggml_type]
        if start % values or length % values:
            raise ValueError(f"a {ggml_name(self.ggml_type)} tensor of {self.shape[1]} inputs splits only "
                             f"at whole blocks of {values}: a shard of inputs {start}..{start + length} does "
                             "not (choose a tensor parallel size that divides the blocks)")
        data = self.data.narrow(1, start // values * size, length // values * size)
        return GGUFTensor(data, self.ggml_type, (self.shape[0], length), self.mapped)

    def rows(self, first: int, count: int) -> GGUFTensor:
        """Weight rows ``first`` .. ``first + count - 1`` (a repacked tensor's at whole panels)."""
        group = X16_LANES if self.ggml_type in X16_SUPER else 1
        if first % group or (count % group and first + count < self.shape[0]):
            raise ValueError(f"rows of a repacked tensor go in panels of {group}")
        count = min(count, self.shape[0] - first)
        data = self.data[first // group : (first + count + group - 1) // group]
        return GGUFTensor(data, self.ggml_type, (count, self.shape[1]), self.mapped)

    def repacked(self) -> GGUFTensor:
        """This tensor in the int8 GEMM's panels (``REPACKED``: Q4_K on AVX512-VNNI builds,
        rows a multiple of ``X16_LANES``; every product of it then reads it as stored, no per-step
        unpacking; the same bits as the block dots), its file pages handed back to the kernel
        (``mapped``); itself where there is no repacked form or ``KVSERVE_GGUF_REPACK=0``."""
        kernels = kquant_kernels()
        if kernels is None or os.environ.get(REPACK_SWITCH, "1") == "0":
            return self
        data = kernels.repack(self.data, self.ggml_type, self.shape[1])
        if data is None:
            return self
        if self.mapped:
            release_pages(self.data)
        return GGUFTensor(data, REPACKED[self.ggml_type], self.shape)

    def dequantize(self, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (all where None) as floats of ``dtype``."""
        return kquant_kernels().dequantize(self.data, self.ggml_type, self.shape[1], dtype, ids)


@dataclass(frozen=True)
class GGUFWeight:
    """A projection's weight [n_out, k_in] as parts of output rows: (first row, ``GGUFTensor`` or a
    dense float tensor), in order, covering every row."""

    parts: tuple[tuple[int, GGUFTensor | torch.Tensor], ...]
    n_out: int
    k_in: int
    method = "gguf"

    def formats(self) -> list[str]:
        """The formats its parts are multiplied in (a GGUF type's name, or a torch dtype's)."""
        return [ggml_name(p.ggml_type) if isinstance(p, GGUFTensor) else str(p.dtype).removeprefix("torch.")
                for _, p in self.parts]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b`` in x's dtype."""
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        kernels = kquant_kernels()
        y = torch.empty(rows.shape[0], self.n_out, dtype=x.dtype)
        panels = x.dtype == torch.float32 or (kernels.isa == 0 and rows.shape[0] > MAX_FUSED_ROWS)
        prefill = rows.shape[0] >= PANEL_FROM_ROWS
        act = None
        for start, part in self.parts:
            n = part.shape[0]
            out, b = y[:, start : start + n], None if bias is None else bias[start : start + n]
            # float products: a decode step's rows each alike whatever rows are beside it, as the float
            # layers compute them (a speculative verification row gives a plain decode's logits)
            if isinstance(part, torch.Tensor):
                out.copy_(float_linear(rows, part, b, few_rows=MAX_FUSED_ROWS))
            elif panels or (prefill and not gemm_takes(kernels, part)
                            and not kernels.dots_over_panels(part.ggml_type)):
                for first in range(0, n, PANEL_ROWS):
                    panel = part.rows(first, PANEL_ROWS)
                    cols = slice(first, first + panel.shape[0])
                    weight, bias_cols = panel.dequantize(x.dtype), None if b is None else b[cols]
                    out[:, cols] = float_linear(rows, weight, bias_cols, few_rows=MAX_FUSED_ROWS)
            elif rows.shape[0]:
                act = kernels.quantize(rows) if act is None else act
                gemm = gemm_takes(kernels, part) and rows.shape[0] >= gemm_from_rows(kernels, part)
                multiply = kernels.gemm if gemm else kernels.matmul
                multiply(part.data, part.ggml_type, self.k_in, act, out, b)
        return y.view(*x.shape[:-1], self.n_out)

    def alike_rows(self, dtype: torch.dtype) -> int | None:
        """Up to how many rows a product in ``dtype`` computes each row alike whatever rows are
        beside it (None: at any count). Where every part is in the block kernels (bfloat16 with
        vector dots built: the activations are quantized per row and the tiles sum each row in one
        order, tests/kernels/cpu/kquant/test_kquant.py): at any count where the int8 GEMM computes
        every part's rows as the dots do (``gemm_alike``, widths it takes), else below
        ``PANEL_FROM_ROWS``; otherwise ``MAX_FUSED_ROWS`` (the row kernel's)."""
        kernels = kquant_kernels()
        if (dtype != torch.float32 and kernels.isa != 0
                and all(isinstance(p, GGUFTensor) for _, p in self.parts)):
            if all(kernels.gemm_alike(p.ggml_type) and gemm_takes(kernels, p) for _, p in self.parts):
                return None
            return PANEL_FROM_ROWS - 1
        return MAX_FUSED_ROWS

    def silu_and_mul(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """None: the caller applies ``silu_and_mul`` to ``linear``'s product (no fused form here)."""
        return None

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight [n_out, k_in] in ``dtype``."""
        return torch.cat([p.to(dtype) if isinstance(p, torch.Tensor) else p.dequantize(dtype)
                          for _, p in self.parts])

    def kernel_linear(self, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
        """The C kernels' ``Linear`` of kind ``W_GGUF``: in bfloat16 with vector dots built and every
        part kept as stored, its parts (``KqPart``, kept alive by the returned object's ``parts``)
        for the fused decode step, whose row kernel multiplies them as ``linear`` does (the same
        quantized rows, the same dots); else one that the row kernels refuse (the step then runs per
        op, through ``linear``: float32 asks for the exact products of dequantized panels)."""
        kernels = kquant_kernels()
        blocks = [p for _, p in self.parts if isinstance(p, GGUFTensor)]
        bias_ptr = None if bias is None else bias.data_ptr()
        if dtype != torch.bfloat16 or kernels is None or kernels.isa == 0 or len(blocks) != len(self.parts):
            first = self.parts[0][1]
            data = first if isinstance(first, torch.Tensor) else first.data
            return Linear(data.data_ptr(), 0, W_GGUF, None, bias_ptr, self.n_out, self.k_in, None, None)
        parts = (KqPart * len(blocks))(*[KqPart(p.data.data_ptr(), p.data.stride(0), p.ggml_type, p.shape[0])
                                         for p in blocks])
        linear = Linear(ctypes.addressof(parts), len(blocks), W_GGUF, None, bias_ptr, self.n_out, self.k_in,
                        None, None)
        linear.parts = parts
        return linear


def release_pages(data: torch.Tensor) -> None:
    """Hand the whole pages under ``data`` (a view of the copy-on-write file mapping, never written)
    back to the kernel: they leave this process's resident memory; a later read would map the file's
    bytes again."""
    start = data.data_ptr()
    end = start + (data.shape[0] - 1) * data.stride(0) + data.shape[1]
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def gguf_weight(param: torch.Tensor, parts: list[tuple[int, GGUFTensor]], repack: bool = False) -> GGUFWeight:
    """The weight of a layer whose float ``param`` [n_out, k_in] got the rows of ``parts`` as GGUF
    tensors and every other row as floats: those rows become dense parts (copies; the float
    parameter is dropped after). ``repack``: the parts that have a repacked form take it
    (``GGUFTensor.repacked``)."""
    n_out, k_in = param.shape
    placed: list[tuple[int, GGUFTensor | torch.Tensor]] = []
    at = 0
    for start, part in sorted(parts, key=lambda p: p[0]):
        if start > at:
            placed.append((at, param[at:start].clone()))
        placed.append((start, part.repacked() if repack else part))
        at = start + part.shape[0]
    if at < n_out:
        placed.append((at, param[at:].clone()))
    return GGUFWeight(tuple(placed), n_out, k_in)


def row_offset(param: torch.Tensor, dst: torch.Tensor) -> int:
    """The first row of ``param`` that ``dst`` (a narrowed view of it) starts at."""
    return (dst.storage_offset() - param.storage_offset()) // param.stride(0)


def weight_formats(model: torch.nn.Module) -> list[str]:
    """What each kind of weight is multiplied in, over every layer: ``"<name>=<formats>"`` per
    projection name (``qkv_proj``, ``down_proj``, ``lm_head``, ...), the formats a GGUF type kept as
    stored (``Q4_K``), ``int8``/``int4`` (``--quantization``) or the float dtype, comma-separated."""
    kinds: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        kind = name.rpartition(".")[2]
        quantized = getattr(module, "quantized", None)
        if isinstance(quantized, GGUFWeight):
            kinds.setdefault(kind, set()).update(quantized.formats())
        elif quantized is not None:
            kinds.setdefault(kind, set()).add(quantized.method)
        elif isinstance(getattr(module, "table", None), GGUFTensor):
            kinds.setdefault(kind, set()).add(ggml_name(module.table.ggml_type))
        elif hasattr(module, "quantized") or hasattr(module, "table"):  # float linears, embeddings
            kinds.setdefault(kind, set()).add(str(module.weight.dtype).removeprefix("torch."))
    return [f"{kind}={','.join(sorted(formats))}" for kind, formats in sorted(kinds.items())]
