"""The gated activations of Llama-style MLPs over a fused gate|up tensor: ``silu(gate) * up``
(SwiGLU) and ``gelu_tanh(gate) * up`` (GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.cpu.bindings import kernels_for


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation over gate|up halves of the last dimension."""
    if x.dim() == 2 and (kernels := kernels_for(x)) is not None:  # CPU: one fused pass
        return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # silu's output is a fresh tensor: multiply into it


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """GeGLU's activation (Gemma): ``gelu_tanh(gate) * up`` over gate|up halves of the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # CPU: one fused pass (csrc/elementwise.c), the arithmetic of the fused decode step's
        if x.dim() == 2 and (kernels := kernels_for(x)) is not None:
            return kernels.silu_and_mul(x, gelu_tanh=True)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)
