"""How a projection multiplies on the CPU, and the packed copies it multiplies by.

``linear`` picks the kernel for a product: csrc/gemm.c over a packed bfloat16 copy (every row's
sums in one order at any count), the C row kernel for a few rows, oneDNN's blocked copy, else
``F.linear``. ``pack_weight`` / ``pack_model_weights`` make the copies once at load, within the
memory the KV cache leaves. ``RowsAlike`` is the switch a speculating runner turns on for
decode-only steps, so that verification rows multiply as plain one-row steps do.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS, PackedWeight
from kvserve.kernels.cpu.bindings import kernels_for, load_kernels

log = logging.getLogger("kvserve.engine.layers")
GiB = 1 << 30


Packed = torch.Tensor | PackedWeight  # oneDNN's blocked copy, or csrc/gemm.c's


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: Packed | None = None, few_rows: int = 1) -> torch.Tensor:
    """``F.linear``; on the CPU, every row through csrc/gemm.c where ``packed`` is its copy (each
    row's result independent of the rows beside it at any count, and as fast as the row kernel at
    one row: faster from two); else up to ``few_rows`` rows (one: a single stream's decode step) go
    through the C row kernel, which reads the weight at memory speed where torch's one-row bfloat16
    matmul reads it at less than half of that (kernels/cpu/bindings.py ``small_linear``), and
    computes each row alike whatever rows are beside it (up to MAX_FUSED_ROWS); more rows go
    through oneDNN's ``packed`` copy (``pack_weight``) where there is one."""
    if isinstance(packed, PackedWeight):
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return load_kernels().gemm(rows, packed, bias).view(*x.shape[:-1], packed.n_out)
    if x.dim() == 2 and 0 < x.shape[0] <= few_rows and (kernels := kernels_for(x, weight, bias)) is not None:
        return kernels.small_linear(x, weight, bias)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class RowsAlike:
    """Shared by a speculating model's float projections (``compute_rows_alike``): whether this
    step computes up to MAX_FUSED_ROWS rows in the C kernel, each row alike whatever rows are
    beside it, as the fused decode step does where it runs. The runner turns it on for decode-only
    steps (verification rows are decode rows), so that where the fused step does not run (tensor
    parallelism, layers it does not compute) a verification row's logits are still those a plain
    one-row decode gives, bit for bit; prefill steps multiply as in a runner that does not
    speculate. Off otherwise: in bfloat16 oneDNN's packed GEMM is faster for a few rows. Weights
    packed for csrc/gemm.c do not need it (their rows are alike at every count)."""

    def __init__(self) -> None:
        self.rows = 1

    def set(self, on: bool) -> None:
        self.rows = MAX_FUSED_ROWS if on else 1


def compute_rows_alike(model: nn.Module) -> RowsAlike:
    """The switch (``RowsAlike``) every float projection of ``model`` (each layer with a
    ``rows_alike`` attribute: ``linear.LinearBase``) then follows."""
    switch = RowsAlike()
    for module in model.modules():
        if hasattr(module, "rows_alike"):
            module.rows_alike = switch
    return switch


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``pack_weight`` makes a blocked copy of ``weight``: a 2-D bfloat16 CPU weight,
    with csrc/gemm.c built (AVX-512, or AVX2 with FMA) or oneDNN's bfloat16 support."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and (gemm_kernel() is not None or onednn_bf16()))


def onednn_bf16() -> bool:
    """Whether oneDNN packs and multiplies bfloat16 here (it needs AVX-512 at least)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def gemm_kernel():
    """The CPU kernels when their bfloat16 GEMM (csrc/gemm.c) was built here and the CPU has no AMX
    tiles (oneDNN multiplies in those, several times faster than AVX512-BF16 can), else None."""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return None
    kernels = load_kernels()
    return kernels if kernels is not None and kernels.gemm_available() else None


def pack_weight(weight: torch.Tensor) -> Packed | None:
    """A blocked copy of a bfloat16 CPU weight [out, in] for ``linear``, made once, or None where
    there is nothing to gain (``can_pack``): csrc/gemm.c's where it takes the weight (AVX-512 or
    AVX2 without AMX: faster than oneDNN's at a few rows, as fast at many), else oneDNN's.

    torch's CPU bfloat16 matmul takes the plain [out, in] weight and re-blocks it for its
    AMX/AVX-512 kernels inside every call; oneDNN's blocked copy is made once, the same products
    (``benchmarks/instruments/ceiling.py`` times both; figures in docs/performance/step_profile.md)."""
    if not can_pack(weight):
        return None
    weight = weight.contiguous()
    if (kernels := gemm_kernel()) is not None and (packed := kernels.pack_gemm_weight(weight)) is not None:
        return packed
    return torch.ops.mkldnn._reorder_linear_weight(weight, None) if onednn_bf16() else None


# Blocked copies are made only while they take at most this share of the memory available.
PACK_MEMORY_SHARE = 0.5


def available_memory() -> int | None:
    """Bytes the kernel reports as available to new allocations (None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pack_model_weights(model: nn.Module, reserved: int = 0, sharers: int = 1) -> int:
    """``pack_weight`` for every layer of ``model`` that multiplies by its ``weight`` through
    ``linear`` (those with a ``packed`` attribute), unless its weight is quantized; the number of
    bytes the blocked copies add (the plain weights stay: the few-row kernel and the tied
    embedding read them). None are made when they would take more than ``PACK_MEMORY_SHARE`` of
    this process's part of the available memory: what is left after ``reserved`` bytes still to be
    allocated (the KV cache), divided among ``sharers`` processes loading at once (the local
    tensor-parallel ranks). A large model then multiplies its plain weights, as before."""
    layers = [m for m in model.modules()
              if hasattr(m, "packed") and m.quantized is None and can_pack(m.weight)]
    needed = sum(m.weight.nbytes for m in layers)
    available = available_memory()
    if layers and available is not None:
        share = max(0, available - reserved) / max(1, sharers)
        if needed > PACK_MEMORY_SHARE * share:
            log.warning("bfloat16 weights not packed for oneDNN: the blocked copies would take %.1f GiB of "
                        "this process's %.1f GiB of the available memory", needed / GiB, share / GiB)
            return 0
    for m in layers:
        m.packed = pack_weight(m.weight.data)
    return needed
