"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE): a router picks ``top_k`` experts
per token and the token's output is the routing-weighted sum of those experts' SwiGLU MLPs (plus,
for Qwen2-MoE, a sigmoid-gated shared expert that every token runs).

- Routing: router logits -> softmax (float32) -> top-k; the chosen probabilities are
  renormalised to sum to 1 when the checkpoint says so (``norm_topk_prob``; Mixtral always).
- Experts: one fused tensor per layer, ``gate_up_proj`` ``[E, 2 * I, H]`` (gate rows, then up
  rows) and ``down_proj`` ``[E, H, I]``. On the CPU, ``grouped_experts`` sorts the (token,
  expert) pairs by expert and runs each active expert once on all of its tokens; on CUDA the
  Triton kernel of ``kvserve.kernels.triton.fused_moe`` does the same in two grouped-GEMM launches.
- Tensor parallel: every rank holds every expert, sliced along the intermediate dimension
  (gate/up rows and down columns), so each rank's output is a partial sum and the one
  all-reduce after the layer is the dense MLP's. The router is replicated.

Checkpoints name each expert's weights apart (``...mlp.experts.7.gate_proj.weight``;
Mixtral ``...block_sparse_moe.experts.7.w1.weight``); ``ExpertNames`` says how, and
``ExpertNames.route`` maps such a name onto the fused parameter and its shard id
``(expert, part)``, which ``FusedExperts.weight_loader`` copies into place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext, divide
from kvserve.engine.layers.activation import SiluAndMul, silu_and_mul
from kvserve.engine.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
    copy_weight,
)

PARTS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertNames:
    """The checkpoint's names of one expert's three projections (``gate``, ``up``, ``down``)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def route(self, name: str) -> tuple[str, tuple[int, str]] | None:
        """(fused parameter name, (expert, part)) for a per-expert checkpoint name, else None."""
        names = {self.gate: "gate", self.up: "up", self.down: "down"}
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if not match or match[3] not in names:
            return None
        part = names[match[3]]
        target = "gate_up_proj" if part != "down" else "down_proj"
        return f"{match[1]}.{target}", (int(match[2]), part)

    def checkpoint_name(self, param_name: str, expert: int, part: str) -> str:
        """The checkpoint name of one expert's ``part`` of the fused parameter ``param_name``."""
        prefix = param_name.rsplit(".", 1)[0]
        return f"{prefix}.{expert}.{getattr(self, part)}.weight"


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights, int64 expert ids), each ``[T, top_k]``, from router logits ``[T, E]``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, act=silu_and_mul, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' weighted SwiGLU MLPs summed per token, ``[T, H]``: the (token, expert) pairs
    sorted by expert, one gate|up and one down matmul per expert that has tokens. gpt-oss passes
    its own ``act`` (over the gate|up product) and the experts' biases ``b13`` [E, 2I], ``b2`` [E, H]."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # sizes the matmuls: host-side
    rows = x.index_select(0, token_of)
    out_rows = torch.empty(rows.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            bias13, bias2 = (None if b is None else b[expert] for b in (b13, b2))
            hidden = act(F.linear(rows[start : start + count], w13[expert], bias13))
            out_rows[start : start + count] = F.linear(hidden, w2[expert], bias2)
            start += count
    out_rows *= topk_weights.flatten().index_select(0, order).unsqueeze(1)
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, out_rows).to(x.dtype)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on CUDA (no host read-back: CUDA-graph safe), the grouped path elsewhere."""
    if x.is_cuda:
        from kvserve.kernels.triton.fused_moe import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids)
    return grouped_experts(x, w13, w2, topk_weights, topk_ids)


class FusedExperts(nn.Module):
    """Every expert's gate|up and down projections in two tensors; this rank's intermediate slice."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.num_experts = num_experts
        self.intermediate = divide(intermediate_size, parallel.size, "moe intermediate size")
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * self.intermediate, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False)
        for param, parts in ((self.gate_up_proj, ("gate", "up")), (self.down_proj, ("down",))):
            param.weight_loader = self.weight_loader
            # what the loader must see filled: one shard per expert and part
            param.checkpoint_shards = [(e, part) for e in range(num_experts) for part in parts]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str] | None = None) -> None:
        """Copy this rank's slice of one expert's full ``gate``/``up`` [I, H] or ``down`` [H, I]."""
        if shard_id is None:
            raise ValueError("fused expert tensors are loaded from per-expert checkpoint tensors "
                             "(...experts.<e>.<projection>.weight), not from an already fused one")
        expert, part = shard_id
        if not 0 <= expert < self.num_experts or part not in PARTS:
            raise ValueError(f"expert shard {shard_id!r} does not exist (num_experts={self.num_experts})")
        size, start = self.intermediate, self.parallel.rank * self.intermediate
        if part == "down":
            copy_weight(param.data[expert], loaded.narrow(1, start, size))
        else:
            offset = 0 if part == "gate" else size
            copy_weight(param.data[expert].narrow(0, offset, size), loaded.narrow(0, start, size))

    def checkpoint_parts(self, param_name: str, names: ExpertNames) -> list[tuple[str, tuple[int, ...]]]:
        """(checkpoint name, full shape) of every per-expert tensor the parameter is made of."""
        param = self.gate_up_proj if param_name.endswith(".gate_up_proj") else self.down_proj
        hidden, full = self.down_proj.shape[1], self.intermediate * self.parallel.size
        shape = {"gate": (full, hidden), "up": (full, hidden), "down": (hidden, full)}
        return [(names.checkpoint_name(param_name, expert, part), shape[part])
                for expert, part in param.checkpoint_shards]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SwiGLU MLP whose down projection is left as this rank's
    partial sum, so that the MoE block's one all-reduce also completes it."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelContext):
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [size, size], False, parallel)
        self.down_proj = RowParallelLinear(size, hidden_size, False, parallel)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(self.act(self.gate_up_proj(x)), None)  # no all-reduce: a partial sum


class SparseMoeBlock(nn.Module):
    """Router (``gate``) plus experts (and, with ``shared_expert_size``, Qwen2-MoE's sigmoid-gated
    shared expert); the layer's one all-reduce closes it under TP."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, parallel: ParallelContext, shared_expert_size: int = 0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.renormalize = renormalize
        self.parallel = parallel
        self.gate = LinearBase(hidden_size, num_experts, bias=False, parallel=parallel)  # replicated
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, parallel)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_size:
            self.shared_expert = SharedExpert(hidden_size, shared_expert_size, parallel)
            self.shared_expert_gate = LinearBase(hidden_size, 1, bias=False, parallel=parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            # the gate is the same on every rank, so gating the partial sums gates their total
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.parallel.all_reduce(out)
