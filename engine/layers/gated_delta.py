"""The two sequence mixers of a Gated DeltaNet layer (Qwen3.5, Qwen3-Next), in torch, one sequence
at a time, carrying a fixed-size state from call to call:

- ``causal_conv``: a depthwise causal convolution of kernel K whose state is the last K - 1 inputs,
  so a chunk may start anywhere (inside the previous chunk's window included);
- the gated delta rule: a recurrent state S [heads, key dim, value dim] that decays by exp(g) and
  is corrected towards each new (k, v) by beta (S += k (beta (v - S^T k))^T), read by q.
  ``delta_rule_recurrent`` steps token by token (decode); ``delta_rule_chunked`` does a prefill
  in blocks of ``CHUNK`` tokens with the WY form (a triangular solve per block, then one state
  update per block), the form the fla-core kernels use.

On the CPU the Gated DeltaNet layers run both rules (and the decode step's convolution) in C
instead (kernels/cpu/gated_delta.py, ``cpu_kernels``): the recurrent form for prefill too, with the
state in L1-sized strips, and the decode step on the state cache's rows in place; the torch forms
stay the path of other devices and of shapes the kernels refuse.

Both rules work in float32 whatever the model's dtype; q and k are L2-normalised over the head
and q scaled by head_dim ** -0.5, as transformers and fla-core do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.cpu.abi import DTYPES
from kvserve.kernels.cpu.gated_delta import GatedDeltaKernels, gated_delta_kernels

CHUNK = 64  # tokens per block of the chunked form


def cpu_kernels(mixed: torch.Tensor, num_k_heads: int, num_v_heads: int, k_dim: int,
                v_dim: int) -> GatedDeltaKernels | None:
    """The C kernels when they take this layer's step (``mixed``: its [q | k | v] rows), else None
    (another device, a shape or dtype they refuse, no kernels built, ``KVSERVE_CPU_KERNELS=0``)."""
    if not GatedDeltaKernels.takes(mixed, num_k_heads, num_v_heads, k_dim, v_dim):
        return None
    return gated_delta_kernels()


def gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
          kernels: GatedDeltaKernels | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) of each token [T, H] from the projection's b and a [T, H]: beta = sigmoid(b),
    g = -exp(A_log) softplus(a + dt_bias) in float32. In C (``kernels.gates``, float32 beta holding
    the dtype's rounding) where ``kernels`` are given and b, a lie side by side in one row (the
    in-projection's last columns), as the fused decode step computes them; else torch's ops."""
    elem = b.element_size()
    if (kernels is not None and b.dim() == 2 and b.dtype == a.dtype and b.dtype in DTYPES
            and b.stride(-1) == 1 and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr() + b.shape[1] * elem
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a_log.dtype == dt_bias.dtype == torch.float32):
        ba = b.as_strided((b.shape[0], 2 * b.shape[1]), b.stride())
        return kernels.gates(ba, a_log.contiguous(), dt_bias.contiguous())
    return -a_log.exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def row_waves(slots: list[int]) -> list[list[int]]:
    """The rows of a step of one token per row, in waves that step each slot at most once: wave j
    holds the j-th row of every slot that has one (a slot's rows in order)."""
    waves: list[list[int]] = []
    seen: dict[int, int] = {}
    for row, slot in enumerate(slots):
        j = seen[slot] = seen.get(slot, -1) + 1
        if j == len(waves):
            waves.append([])
        waves[j].append(row)
    return waves


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """SiLU(conv(x)) for ``x`` [T, C] after the inputs in ``state`` [C, K - 1] (zeros: none);
    ``state`` is updated in place to the last K - 1 inputs. ``weight``: [C, K]."""
    window = state.shape[-1]
    joined = torch.cat((state.to(x.dtype), x.t()), dim=-1)  # [C, K - 1 + T]
    state.copy_(joined[:, joined.shape[-1] - window :])
    out = F.conv1d(joined.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out).t()


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: ``x`` [B, C], ``states`` [B, C, K - 1] updated in place."""
    joined = torch.cat((states.to(x.dtype), x.unsqueeze(-1)), dim=-1)  # [B, C, K]
    states.copy_(joined[..., 1:])
    return F.silu((joined * weight).sum(-1))


def _normalised(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k in float32, L2-normalised over the head, q scaled; key heads repeated to the value heads."""
    q = q.float()
    k = k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = num_v_heads // q.shape[-2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q, k


def delta_rule_recurrent(q, k, v, g, beta, states: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: q, k [B, Hk, Dk], v [B, H, Dv], g, beta [B, H];
    ``states`` [B, H, Dk, Dv] float32, updated in place. Returns [B, H, Dv] float32."""
    q, k = _normalised(q, k, v.shape[-2])
    s = states * g.float().exp()[..., None, None]
    predicted = (s * k.unsqueeze(-1)).sum(-2)  # S^T k: [B, H, Dv]
    delta = (v.float() - predicted) * beta.float().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    states.copy_(s)
    return (s * q.unsqueeze(-1)).sum(-2)


def delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """T tokens of one sequence: q, k [T, Hk, Dk], v [T, H, Dv], g, beta [T, H]; ``state``
    [H, Dk, Dv] float32, updated in place. Returns [T, H, Dv] float32."""
    length = q.shape[0]
    q, k = _normalised(q, k, v.shape[-2])
    pad = -length % CHUNK  # padded tokens have k = 0, beta = 0, g = 0: they change nothing
    heads_first = lambda x: F.pad(x.float().transpose(0, 1), (0, 0, 0, pad))  # noqa: E731 - [H, T', D]
    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    g, beta = (F.pad(x.float().t(), (0, pad)) for x in (g, beta))  # [H, T']
    blocks = (length + pad) // CHUNK
    q, k, v = (x.reshape(x.shape[0], blocks, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(-1, blocks, CHUNK), beta.reshape(-1, blocks, CHUNK)
    decay = g.cumsum(-1)  # log of the decay from a block's start to each position
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # exp(decay_i - decay_j) for j <= i, 0 above the diagonal
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # WY form: (I + strictly lower (beta k k^T * decay)) turns the block's corrections into a solve
    system = (k_beta @ k.transpose(-1, -2) * pairwise).tril(-1)
    system = system + torch.eye(CHUNK, dtype=system.dtype, device=system.device)
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    new_values = solve(v * beta.unsqueeze(-1))
    state_reads = solve(k_beta * decay.exp().unsqueeze(-1))
    scores = q @ k.transpose(-1, -2) * pairwise
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    block_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    s = state.float()
    for i in range(blocks):
        corrected = new_values[:, i] - state_reads[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ corrected
        s = s * block_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ corrected
    state.copy_(s)
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1)
