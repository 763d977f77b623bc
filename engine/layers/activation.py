"""The gated activation of Llama-style MLPs: ``silu(gate) * up`` over a fused gate|up tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation over gate|up halves of the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # silu's output is a fresh tensor: multiply into it


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
