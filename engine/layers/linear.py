"""Tensor-parallel linear layers and the weight loaders that shard checkpoint tensors by rank.

- ``ColumnParallelLinear``: the output features are split across ranks; no communication.
- ``MergedColumnParallelLinear``: several column layers stored as one matrix (gate|up), each
  part split across ranks, so one matmul serves them all.
- ``QKVParallelLinear``: q|k|v in one matrix, split by query heads and by KV heads (KV heads are
  replicated when there are fewer of them than ranks).
- ``RowParallelLinear``: the input features are split; partial sums are all-reduced.

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies the
rank's slice of a full checkpoint tensor into it; the model loader calls it by name.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext, divide, kv_head_shard
from kvserve.engine.layers.quantization import QUANTIZERS, QuantizedWeight
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
    """The switch (``RowsAlike``) every float projection of ``model`` then follows."""
    switch = RowsAlike()
    for module in model.modules():
        if isinstance(module, LinearBase):
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
    AVX2 without AMX; against oneDNN with AVX512-BF16 1.5x at 8 rows, 1.15x at 32, as fast from ~500
    rows on), else oneDNN's.

    torch's CPU bfloat16 matmul takes the plain [out, in] weight and re-blocks it for its
    AMX/AVX-512 kernels inside every call; oneDNN's blocked copy is made once. Measured on a Xeon
    with AMX, the bundled model's projections at 48 rows: 25-47 ms -> 17-27 ms in the same runs,
    the same products (``benchmarks/instruments/ceiling.py`` times both)."""
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


def _new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` after checking that the checkpoint tensor has the parameter's shape."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W`` of shape [output_size, input_size] (this rank's part)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, parallel: ParallelContext | None):
        super().__init__()
        self.parallel = parallel or ParallelContext()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _new_param(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _new_param(output_size)
            self.bias.weight_loader = self.weight_loader
        self.quantized: QuantizedWeight | None = None  # once quantized (the float weight is gone then)
        self.packed: Packed | None = None  # pack_weight's blocked copy, on the CPU
        self.rows_alike: RowsAlike | None = None  # a speculating runner's switch (``compute_rows_alike``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.linear(x, bias)
        few_rows = self.rows_alike.rows if self.rows_alike is not None else 1
        return linear(x, self.weight, bias, self.packed, few_rows=few_rows)

    def quantize(self, method: str) -> None:
        """Keep the weight quantized by ``method`` (``layers/quantization.py``); the float weight goes."""
        self.quantized = QUANTIZERS[method](self.weight.data)
        self.weight = _new_param(0)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_weight(param.data, loaded)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 parallel: ParallelContext | None = None):
        parallel = parallel or ParallelContext()
        super().__init__(input_size, divide(output_size, parallel.size, "output features"), bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        copy_weight(param.data, loaded.narrow(0, self.parallel.rank * size, size))


class MergedColumnParallelLinear(LinearBase):
    """Column layers of ``output_sizes`` stacked in one matrix; ``shard_id`` is the part's index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 parallel: ParallelContext | None = None):
        parallel = parallel or ParallelContext()
        self.part_sizes = [divide(size, parallel.size, "output features") for size in output_sizes]
        super().__init__(input_size, sum(self.part_sizes), bias, parallel)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of a gate|up layer's product, computed by csrc/gemm.c as it multiplies
        (the product itself is never stored): bfloat16 x with the weight packed for it, or an int8 or
        int4 weight at more rows than the row kernel takes. Exactly ``silu_and_mul(self(x))``; None
        where gemm.c does not take the call (then the caller does that)."""
        if len(self.part_sizes) != 2 or self.part_sizes[0] != self.part_sizes[1] or x.dtype != torch.bfloat16:
            return None
        rows = x.reshape(-1, x.shape[-1])
        if self.quantized is not None:
            y = self.quantized.silu_and_mul(rows, self.bias)
        elif isinstance(self.packed, PackedWeight) and self.packed.n_out % 32 == 0:
            rows = rows if rows.stride(-1) == 1 else rows.contiguous()
            y = load_kernels().gemm(rows, self.packed, self.bias, glu=True)
        else:
            return None
        return None if y is None else y.view(*x.shape[:-1], self.part_sizes[0])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("a merged linear layer needs the shard id of the loaded part")
        size = self.part_sizes[shard_id]
        offset = sum(self.part_sizes[:shard_id])
        copy_weight(param.data.narrow(0, offset, size), loaded.narrow(0, self.parallel.rank * size, size))


class QKVParallelLinear(LinearBase):
    """q|k|v projections in one matrix; ``shard_id`` is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, parallel: ParallelContext | None = None):
        parallel = parallel or ParallelContext()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, parallel.size, "num_attention_heads")
        self.num_kv_heads, self.kv_head_start = kv_head_shard(num_kv_heads, parallel.rank, parallel.size)
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.shard_offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"a qkv layer needs shard id 'q', 'k' or 'v', got {shard_id!r}")
        offset, size = self.shard_offsets[shard_id]
        head_start = self.parallel.rank * self.num_heads if shard_id == "q" else self.kv_head_start
        part = loaded.narrow(0, head_start * self.head_dim, size)
        copy_weight(param.data.narrow(0, offset, size), part)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed by all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 parallel: ParallelContext | None = None):
        parallel = parallel or ParallelContext()
        super().__init__(divide(input_size, parallel.size, "input features"), output_size, bias, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return self.matmul(x, self.bias)
        y = self.parallel.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is added once, after the all-reduce
            copy_weight(param.data, loaded)
            return
        size = param.shape[1]
        copy_weight(param.data, loaded.narrow(1, self.parallel.rank * size, size))
