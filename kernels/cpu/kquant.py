"""GGUF block-format weights multiplied as stored (csrc/kquant.c, kquant_avx2.c, kquant_avx512.c),
through the library ``bindings.load_kernels`` built.

A product is two calls: ``quantize`` turns activation rows into int8 blocks of ``KQ_BLOCK`` values
(a float scale and the sums of each 16 values a block), once per layer input, and ``matmul``
multiplies a weight (uint8 rows of the file's blocks, e.g. a view of the memory-mapped file) by
them, writing into a column range of the output, so that q, k and v (or gate and up), each a
tensor of its own type in the file, share one quantization of their input. ``dequantize`` gives
rows of a weight as floats (embedding lookups; the panels of CPUs without vector dots); ``gemm``
is ``matmul`` for a prefill chunk's many rows (csrc/kquant_gemm.c); ``repack`` rewrites a Q4_K or
Q6_K weight into the GEMM's panels, which every product then reads as they are (csrc/kquant_x16.c).
"""

from __future__ import annotations

import functools
import time

import torch

from kvserve.kernels.cpu.abi import DTYPES
from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.kernels.cpu.build import header_constant

KQ_BLOCK = header_constant("KQ_BLOCK", "kquant.h")
KQ_ACT_BYTES = header_constant("KQ_ACT_BYTES", "kquant.h")


def _code(name: str) -> int:
    return header_constant(name, "kquant.h")


# ggml type -> (values, bytes) per block, for the types csrc/kquant.c multiplies as stored
BLOCK_TYPES = {_code("GGML_Q4_0"): (32, 18), _code("GGML_Q8_0"): (32, 34),
               _code("GGML_Q4_K"): (256, 144), _code("GGML_Q5_K"): (256, 176),
               _code("GGML_Q6_K"): (256, 210)}
PORTABLE = 1  # ``matmul``'s isa: the portable dots whatever the build has (tests)
# Q4_K and Q6_K repacked at load into the int8 GEMM's panels of X16_LANES rows (csrc/kquant.h;
# AVX512-VNNI builds): ``repack`` makes them; a tensor of one is uint8 [rows / X16_LANES, a panel's
# bytes]; REPACKED maps a stored type to its repacked type, X16_SUPER a repacked type to its bytes a
# panel's superblock
Q4_K_X16 = _code("KQ_Q4_K_X16")
Q6_K_X16 = _code("KQ_Q6_K_X16")
X16_LANES = _code("KQ_X16_LANES")
X16_SUPER = {Q4_K_X16: _code("KQ_X16_SUPER"), Q6_K_X16: _code("KQ_Q6X16_SUPER")}
REPACKED = {_code("GGML_Q4_K"): Q4_K_X16, _code("GGML_Q6_K"): Q6_K_X16}


def stored_rows(weight: torch.Tensor, ggml_type: int) -> int:
    """The weight rows a tensor of ``ggml_type`` holds (an X16 tensor's rows are panels)."""
    return weight.shape[0] * (X16_LANES if ggml_type in X16_SUPER else 1)


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"CPU kernel {name} failed with status {status} "
                           "(1: a type or width it does not take, 2: out of memory)")


class KQuantKernels:
    """csrc/kquant.c's entry points. ``isa``: which dots ``matmul`` runs: 512 (AVX512-VNNI), 256
    (AVX2) or 0 (the portable loops: no vector dots were built for this CPU)."""

    def __init__(self, lib):
        self._lib = lib
        self.isa = lib.kq_isa()
        self._gemm_types = tuple(lib.kq_gemm_types(which) for which in range(4))
        self._q4_0 = _code("GGML_Q4_0")

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 [rows, blocks * KQ_ACT_BYTES]: the rows of 2-D ``x`` (float32 or bfloat16, last
        dimension contiguous, width a multiple of 32) quantized per ``KQ_BLOCK`` values."""
        rows, k = x.shape
        blocks = -(-k // KQ_BLOCK)
        act = torch.empty(rows, blocks * KQ_ACT_BYTES, dtype=torch.uint8)
        _check(self._lib.kq_quantize(x.data_ptr(), x.stride(0), rows, k, DTYPES[x.dtype], act.data_ptr(),
                                     torch.get_num_threads()), "kq_quantize")
        return act

    def matmul(self, weight: torch.Tensor, ggml_type: int, k: int, act: torch.Tensor, out: torch.Tensor,
               bias: torch.Tensor | None = None, isa: int = 0) -> None:
        """``out[m, n] = <weight row n, activation row m> (+ bias[n])``: ``weight`` uint8 [n_out,
        row bytes] (rows may be further apart: a shard), ``act`` from ``quantize`` of width ``k``,
        ``out`` [rows, n_out] of float32 or bfloat16 with a contiguous last dimension (a column
        slice of a wider output is fine), ``bias`` of out's dtype, contiguous."""
        n_out, rows = stored_rows(weight, ggml_type), act.shape[0]
        _check(self._lib.kq_matmul(
            weight.data_ptr(), weight.stride(0), ggml_type, n_out, k, act.data_ptr(), rows,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), DTYPES[out.dtype], isa,
            torch.get_num_threads()), "kq_matmul")

    def gemm_takes(self, ggml_type: int, preferred: bool = True) -> bool:
        """Whether ``gemm`` multiplies ``ggml_type`` on this build (``preferred``: and is the faster
        of it and dequantized bfloat16 panels for a prefill chunk here, measured per CPU class)."""
        if ggml_type in X16_SUPER:
            return self.isa == 512
        return bool(self._gemm_types[preferred] >> (ggml_type - self._q4_0) & 1)

    def dots_over_panels(self, ggml_type: int) -> bool:
        """Whether a prefill chunk of ``ggml_type`` that ``gemm`` does not take is faster by the
        block dots (``matmul``) than by dequantized bfloat16 panels here (CPUs without AVX512-BF16,
        whose bfloat16 GEMM runs in float32)."""
        return ggml_type not in X16_SUPER and bool(self._gemm_types[2] >> (ggml_type - self._q4_0) & 1)

    def gemm_alike(self, ggml_type: int) -> bool:
        """Whether ``gemm`` computes each row of ``ggml_type`` bit for bit as the block dots
        (``matmul``) do (AVX512-VNNI's K-quants: one canonical order of sums), so that a product may
        take either at any row count and every row is the same."""
        if ggml_type in X16_SUPER:
            return self.isa == 512
        return bool(self._gemm_types[3] >> (ggml_type - self._q4_0) & 1)

    def vnni_peak(self, rounds: int = 3, clock=time.perf_counter) -> float:
        """int8 multiply-adds a second of a tight loop of independent vpdpbusd on every thread
        (by ``clock``: the wall clock, or ``time.thread_time`` at one thread; the best of
        ``rounds``; 0 where the build has no AVX512-VNNI): the peak the GEMM is held to, taken in
        the same run."""
        n, threads, best = 1 << 21, torch.get_num_threads(), float("inf")
        if self._lib.kq_vnni_peak(1000, threads) == -1:
            return 0.0
        for _ in range(rounds):
            start = clock()
            self._lib.kq_vnni_peak(n, threads)
            best = min(best, clock() - start)
        return threads * n * 12 * 64 / best

    def gemm(self, weight: torch.Tensor, ggml_type: int, k: int, act: torch.Tensor, out: torch.Tensor,
             bias: torch.Tensor | None = None) -> None:
        """``matmul``'s product by csrc/kquant_gemm.c's int8 GEMM (a prefill chunk's many rows: each
        panel of weight rows unpacked once for all of them); ``k`` a multiple of ``KQ_BLOCK`` and a
        type ``gemm_takes(..., preferred=False)``."""
        n_out, rows = stored_rows(weight, ggml_type), act.shape[0]
        _check(self._lib.kq_gemm(
            weight.data_ptr(), weight.stride(0), ggml_type, n_out, k, act.data_ptr(), rows,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), DTYPES[out.dtype],
            torch.get_num_threads()), "kq_gemm")

    def dequantize(self, weight: torch.Tensor, ggml_type: int, k: int, dtype: torch.dtype,
                   ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (int64; every row where None) of ``weight`` as [len(ids), k] of ``dtype``."""
        n = stored_rows(weight, ggml_type) if ids is None else ids.numel()
        out = torch.empty(n, k, dtype=dtype)
        ids = None if ids is None else ids.to(torch.int64).contiguous()
        _check(self._lib.kq_dequantize(weight.data_ptr(), weight.stride(0), ggml_type, k,
                                       None if ids is None else ids.data_ptr(), n, out.data_ptr(), k,
                                       DTYPES[dtype], torch.get_num_threads()), "kq_dequantize")
        return out

    def repack(self, weight: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor | None:
        """``weight`` (uint8 rows of ``ggml_type``'s blocks, ``k`` values a row) repacked as
        ``REPACKED[ggml_type]``: a new uint8 [rows / X16_LANES, panel bytes] tensor; None where this
        build or shape has no repacked form (AVX512-VNNI builds, Q4_K and Q6_K, rows a multiple of
        X16_LANES, k of ``KQ_BLOCK``)."""
        n_out = weight.shape[0]
        if (self.isa != 512 or ggml_type not in REPACKED or n_out % X16_LANES or k % KQ_BLOCK
                or weight.stride(-1) != 1):
            return None
        panel = k // KQ_BLOCK * X16_SUPER[REPACKED[ggml_type]]
        out = torch.empty(n_out // X16_LANES, panel, dtype=torch.uint8)
        _check(self._lib.kq_repack_x16(weight.data_ptr(), weight.stride(0), ggml_type, n_out, k,
                                       out.data_ptr(), torch.get_num_threads()), "kq_repack_x16")
        return out


@functools.cache
def kquant_kernels() -> KQuantKernels | None:
    """The kernels (None where ``load_kernels`` has none: no compiler, a failed build, or
    ``KVSERVE_CPU_KERNELS=0``)."""
    kernels = load_kernels()
    return None if kernels is None else KQuantKernels(kernels._lib)
