"""Tensor-parallel linear layers and the weight loaders that shard checkpoint tensors by rank.

- ``ColumnParallelLinear``: the output features are split across ranks; no communication.
- ``MergedColumnParallelLinear``: several column layers stored as one matrix (gate|up), each
  part split across ranks, so one matmul serves them all; a part may itself be pieces that split
  across ranks each on its own (``sections``: Qwen3.5's ``in_proj_qkv``, q | k | v by head).
- ``QKVParallelLinear``: q|k|v in one matrix, split by query heads and by KV heads (KV heads are
  replicated when there are fewer of them than ranks).
- ``RowParallelLinear``: the input features are split; partial sums are all-reduced.

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies the
rank's slice of a full checkpoint tensor into it; the model loader calls it by name. A GGUF file's
block-format tensors (``gguf_linear.GGUFTensor``) are sliced the same way and kept as stored:
``finish_loading`` then makes the layer's weight a ``GGUFWeight``. How a layer's product is
computed on the CPU (which kernel, the packed copies) is ``cpu_matmul``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext, divide, kv_head_shard
from kvserve.engine.layers.cpu_matmul import Packed, RowsAlike, linear
from kvserve.engine.layers.gguf_linear import GGUFTensor, GGUFWeight, gguf_weight, row_offset
from kvserve.engine.layers.quantization import QUANTIZERS, QuantizedWeight
from kvserve.kernels.cpu.abi import PackedWeight
from kvserve.kernels.cpu.bindings import load_kernels


def _new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def rank_pieces(loaded: torch.Tensor, pieces: list[int], parallel: ParallelContext) -> torch.Tensor:
    """The rank's rows of ``loaded``, whose rows are ``pieces`` (sizes) that split across ranks
    each on its own (a conv weight of q | k | v channels), concatenated in their order."""
    if sum(pieces) != loaded.shape[0]:
        raise ValueError(f"checkpoint tensor of {loaded.shape[0]} rows does not fit pieces of {pieces} rows")
    parts, start = [], 0
    for piece in pieces:
        size = divide(piece, parallel.size, "output features")
        parts.append(loaded.narrow(0, start + parallel.rank * size, size))
        start += piece
    return torch.cat(parts)


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
        # once quantized, or loaded as GGUF blocks (the float weight is gone then)
        self.quantized: QuantizedWeight | GGUFWeight | None = None
        self.gguf_parts: list[tuple[int, GGUFTensor]] = []  # block-format rows loaded, until finish_loading
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
        self._load(param, param.data, loaded)

    def _load(self, param: nn.Parameter, dst: torch.Tensor, loaded: torch.Tensor | GGUFTensor) -> None:
        """``copy_weight(dst, loaded)``; a GGUF tensor is kept as stored, as the rows ``dst`` covers."""
        if not isinstance(loaded, GGUFTensor):
            copy_weight(dst, loaded)
            return
        if param is not self.weight or tuple(dst.shape) != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {loaded.shape} does not fit {tuple(dst.shape)}")
        self.gguf_parts.append((row_offset(param.data, dst), loaded))

    def finish_loading(self) -> None:
        """After every tensor is loaded: a weight that got GGUF tensors is kept as a ``GGUFWeight``
        (its other rows as floats), and the float weight goes."""
        if self.gguf_parts:
            # a projection's Q4_K and Q6_K parts repacked for the int8 kernels, except in float32 (whose
            # products multiply dequantized panels: docs/design/gguf_kquants.md)
            self.quantized = gguf_weight(self.weight.data, self.gguf_parts,
                                         repack=self.weight.dtype != torch.float32)
            self.gguf_parts = []
            self.weight = _new_param(0)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 parallel: ParallelContext | None = None):
        parallel = parallel or ParallelContext()
        super().__init__(input_size, divide(output_size, parallel.size, "output features"), bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        self._load(param, param.data, loaded.narrow(0, self.parallel.rank * size, size))


class MergedColumnParallelLinear(LinearBase):
    """Column layers of ``output_sizes`` stacked in one matrix; ``shard_id`` is the part's index.
    ``sections`` (per part, the sizes of its pieces; default one piece) says which parts are pieces
    that each split across ranks on their own: a rank's rows of such a part are its rows of each
    piece, in order."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 parallel: ParallelContext | None = None, sections: list[list[int]] | None = None):
        parallel = parallel or ParallelContext()
        self.sections = sections or [[size] for size in output_sizes]
        if [sum(pieces) for pieces in self.sections] != list(output_sizes):
            raise ValueError(f"sections {self.sections} do not add up to the parts {list(output_sizes)}")
        self.part_sizes = [sum(divide(piece, parallel.size, "output features") for piece in pieces)
                           for pieces in self.sections]
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
        offset, start = sum(self.part_sizes[:shard_id]), 0
        for piece in self.sections[shard_id]:  # one piece unless the part has sections
            size = piece // self.parallel.size
            part = loaded.narrow(0, start + self.parallel.rank * size, size)
            self._load(param, param.data.narrow(0, offset, size), part)
            offset, start = offset + size, start + piece


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
        self._load(param, param.data.narrow(0, offset, size), part)


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
        self._load(param, param.data, loaded.narrow(1, self.parallel.rank * size, size))
