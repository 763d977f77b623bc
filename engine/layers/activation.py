"""The gated activation of Llama-style MLPs: ``silu(gate) * up`` over a fused gate|up tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # silu's output is a fresh tensor: multiply into it
