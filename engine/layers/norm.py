"""RMSNorm, with the residual add fused into the same call as the decoder layers use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.cpu.abi import DTYPES
from kvserve.kernels.cpu.bindings import kernels_for


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; torch's fused kernel computes in float32 whatever the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``. The sum is
        written into ``residual``: the decoder layers hand the running residual from one norm to
        the next and never read the old value again."""
        # on the CPU: one fused pass (kernels/cpu/csrc/elementwise.c); 3-D (per-head) rows without residual
        if (self.weight.dtype in DTYPES and (x.dim() == 2 or (residual is None and x.dim() == 3))
                and (kernels := kernels_for(x, residual)) is not None):
            out = kernels.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._normalize(x)
        x = residual.add_(x)
        return self._normalize(x), x

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's ``x / rms(x) * (1 + w)``: the checkpoint stores ``w``; the parameter holds ``1 + w``
    in float32 whatever the model's dtype (added at load, as transformers adds it in float32 at
    every call), so the same kernels serve and the product is rounded once."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"{tuple(param.shape)}")
        param.data.copy_(loaded.float() + 1.0)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
