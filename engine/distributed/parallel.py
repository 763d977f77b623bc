"""The tensor-parallel context: which rank this process is, how many ranks share the model, and
the two collectives the layers need (all-reduce after row-parallel layers, gather of logits).

A ``ParallelContext`` is built once per worker and passed to each layer at construction; there
is no module-level global. With ``size == 1`` the collectives are identity functions, so the
same layers run single-process with no torch.distributed set up at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None = the default group

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank must be in [0, {self.size}), got {self.rank}")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over all ranks, in place; identity for one rank."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank holds (ranks must agree on sizes such as KV blocks)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dimension on rank 0.

        Rank 0 gets the full tensor, the other ranks get None. Identity for one rank.
        """
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_leader else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather(x.contiguous(), parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=-1) if self.is_leader else None


def _collective_device(group) -> torch.device:
    """NCCL moves CUDA tensors only, gloo CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` where the split must be exact (heads, vocab rows, ...)."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by tensor_parallel_size ({denominator})"
        )
    return numerator // denominator


def kv_head_shard(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(how many, first) KV heads rank ``rank`` of ``size`` holds. KV heads are split when there
    are at least as many as ranks, else replicated, as vLLM does: each rank keeps a copy of the
    one its query heads use, which needs ``size`` to be a multiple of ``num_kv_heads``."""
    if num_kv_heads >= size:
        count = divide(num_kv_heads, size, "num_key_value_heads")
        return count, rank * count
    if size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({size}) must be a multiple of num_key_value_heads ({num_kv_heads}) "
            "when it is larger"
        )
    return 1, rank * num_kv_heads // size
