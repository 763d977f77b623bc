"""The gated delta rule of the Gated DeltaNet layers in C (csrc/gated_delta.c), through the library
``bindings.load_kernels`` built; engine/layers/gated_delta.py calls it on the CPU and keeps its
torch forms elsewhere (and where these kernels refuse a shape).

- ``conv``: the causal convolution of a prompt's tokens (torch's bfloat16 depthwise conv1d takes
  longer than the rule itself), SiLU, rows of [q | k | v] out.
- ``prefill``: one sequence's tokens after its convolution, the state carried token by token in
  strips of 16 value columns that stay in L1 (fewer operations than the chunked WY form, and no
  triangular solves).
- ``decode``: one token of each sequence from the input projection: the convolution step and the
  rule, on the rows of the state cache in place (no gather and scatter of the slots' states).
- ``gated_norm``: the layer's RMSNorm gated by SiLU(z) on the rule's float32 output, one pass
  (torch's form ran a dozen over the prompt's values, as long as the in-projection's GEMM).
- ``gates``: beta and the decay g of each token and value head from the projection's b and a (one
  call where torch ran eight small ops a layer); ``sigmoid_gate``: the full-attention layers' output
  gate. The fused decode step (csrc/decode_row.c ``decode_row_hybrid``) runs the same C for both,
  so that its steps and the per-op path's give the same bits.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.kernels.cpu.abi import DTYPES
from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.kernels.cpu.build import header_constant

STRIP = header_constant("GDN_STRIP", "gated_delta.c")
MAX_KEY_DIM = header_constant("GDN_MAX_KEY_DIM", "gated_delta.c")
MAX_GROUP_VALUES = header_constant("GDN_MAX_GROUP_VALUES", "gated_delta.c")


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"CPU kernel {name} failed with status {status} "
                           "(1: a shape it does not take, 2: out of memory)")


class GatedDeltaKernels:
    """csrc/gated_delta.c's entry points; ``vector_bits``: 512 (AVX-512), 256 (AVX2), 0 (portable)."""

    def __init__(self, lib):
        self._lib = lib
        self.vector_bits = lib.gdn_vector_bits()

    @staticmethod
    def takes(mixed: torch.Tensor, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int) -> bool:
        """Whether the kernels take this layer's shape and ``mixed`` (CPU, float32 or bfloat16, rows
        of [q | k | v] with a contiguous last dimension)."""
        return (mixed.is_cpu and mixed.dtype in DTYPES and mixed.stride(-1) == 1 and mixed.dim() == 2
                and num_v_heads % num_k_heads == 0 and k_dim % 2 == 0 and k_dim <= MAX_KEY_DIM
                and v_dim % STRIP == 0 and num_v_heads // num_k_heads * v_dim <= MAX_GROUP_VALUES
                and mixed.shape[-1] == 2 * num_k_heads * k_dim + num_v_heads * v_dim)

    def conv(self, x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """``causal_conv`` of one sequence's tokens: ``x`` [T, C] (last dimension contiguous),
        ``weight`` [C, K] and ``window`` [C, K - 1] (updated in place) contiguous, of x's dtype.
        Returns [T, C] of x's dtype, contiguous."""
        tokens, channels = x.shape
        out = torch.empty(tokens, channels, dtype=x.dtype)
        _check(self._lib.gdn_conv(x.data_ptr(), x.stride(0), DTYPES[x.dtype], weight.data_ptr(),
                                  window.data_ptr(), weight.shape[1], tokens, channels, out.data_ptr(),
                                  torch.get_num_threads()), "gdn_conv")
        return out

    def prefill(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                num_k_heads: int, k_dim: int) -> torch.Tensor:
        """``delta_rule_chunked`` of one sequence: ``mixed`` [T, q | k | v] after the convolution,
        ``g``, ``beta`` [T, H]; ``state`` float32 [H, dk, dv] contiguous, updated in place.
        Returns float32 [T, H, dv]."""
        tokens, (heads, _, v_dim) = mixed.shape[0], state.shape
        g, beta = g.float().contiguous(), beta.float().contiguous()
        out = torch.empty(tokens, heads, v_dim, dtype=torch.float32)
        _check(self._lib.gdn_prefill(mixed.data_ptr(), mixed.stride(0), DTYPES[mixed.dtype], g.data_ptr(),
                                     beta.data_ptr(), tokens, num_k_heads, heads, k_dim, v_dim,
                                     state.data_ptr(), out.data_ptr(), torch.get_num_threads()),
               "gdn_prefill")
        return out

    def decode(self, mixed: torch.Tensor, conv_weight: torch.Tensor, conv_states: torch.Tensor,
               states: torch.Tensor, slots: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               num_k_heads: int, k_dim: int) -> torch.Tensor:
        """``causal_conv_step`` then ``delta_rule_recurrent`` of one token of each of B sequences:
        ``mixed`` [B, conv channels] (before the convolution), ``conv_weight`` [C, K] contiguous
        of mixed's dtype, ``conv_states`` [slots, C, K - 1] of that dtype and ``states`` float32
        [slots, H, dk, dv], both contiguous, rows ``slots`` (int64 [B]) updated in place.
        Returns float32 [B, H, dv]."""
        batch, (_, heads, _, v_dim) = mixed.shape[0], states.shape
        g, beta = g.float().contiguous(), beta.float().contiguous()
        out = torch.empty(batch, heads, v_dim, dtype=torch.float32)
        _check(self._lib.gdn_decode(mixed.data_ptr(), mixed.stride(0), DTYPES[mixed.dtype],
                                    conv_weight.data_ptr(), conv_states.data_ptr(), conv_weight.shape[1],
                                    slots.data_ptr(), batch,
                                    g.data_ptr(), beta.data_ptr(), num_k_heads, heads, k_dim, v_dim,
                                    states.data_ptr(), out.data_ptr(), torch.get_num_threads()), "gdn_decode")
        return out

    def gated_norm(self, rule: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
        """``GatedDeltaNet._gated_norm`` of the rule's output: ``rule`` float32 [T, H, dv]
        contiguous, ``z`` [T, H * dv] of the model's dtype (last dimension contiguous), ``weight``
        [dv] of that dtype. Returns [T, H * dv] of z's dtype, contiguous."""
        tokens, heads, v_dim = rule.shape
        out = torch.empty(tokens, heads * v_dim, dtype=z.dtype)
        _check(self._lib.gdn_gated_norm(rule.data_ptr(), z.data_ptr(), z.stride(0), weight.data_ptr(), tokens,
                                        heads, v_dim, eps, DTYPES[z.dtype], out.data_ptr(),
                                        torch.get_num_threads()), "gdn_gated_norm")
        return out


    def gates(self, ba: torch.Tensor, a_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta), float32 [T, H] each, of ``ba`` [T, 2H] (b then a, last dimension contiguous, of
        the model's dtype): beta = sigmoid(b) rounded to that dtype, g = -exp(A_log) softplus(a +
        dt_bias); ``a_log``, ``dt_bias`` float32 [H] contiguous."""
        tokens, heads = ba.shape[0], ba.shape[1] // 2
        g = torch.empty(tokens, heads, dtype=torch.float32)
        beta = torch.empty(tokens, heads, dtype=torch.float32)
        _check(self._lib.gdn_gates(ba.data_ptr(), ba.stride(0), DTYPES[ba.dtype], a_log.data_ptr(),
                                   dt_bias.data_ptr(), tokens, heads, g.data_ptr(), beta.data_ptr()),
               "gdn_gates")
        return g, beta

    def sigmoid_gate(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``out * sigmoid(gate)`` in place, each rounded to the dtype as torch rounds: ``out``
        [T, heads, D] contiguous, ``gate`` [T, heads, D] of its dtype, last dimension contiguous."""
        tokens, heads, width = out.shape
        _check(self._lib.sigmoid_gate(out.data_ptr(), out.stride(0), gate.data_ptr(), gate.stride(0),
                                      gate.stride(1), tokens, heads, width, DTYPES[out.dtype]),
               "sigmoid_gate")
        return out


    def decode_row_hybrid(self, layers: ctypes.Array, step, hidden: torch.Tensor,
                          residual: torch.Tensor) -> bool:
        """One token per row through every layer of a hybrid (csrc/decode_row.c ``decode_row_hybrid``;
        ``layers``: an array of ``abi.HybridLayer``, ``step`` an ``abi.HybridStep``): ``hidden``
        [rows, H] in, the last layer's output out; ``residual`` out. False where it refused the step
        (nothing was done)."""
        status = self._lib.decode_row_hybrid(ctypes.addressof(layers), len(layers), ctypes.byref(step),
                                             hidden.data_ptr(), residual.data_ptr(), torch.get_num_threads())
        if status == 1:
            return False
        _check(status, "decode_row_hybrid")
        return True


@functools.cache
def gated_delta_kernels() -> GatedDeltaKernels | None:
    """The kernels (None where ``load_kernels`` has none: no compiler, a failed build, or
    ``KVSERVE_CPU_KERNELS=0``)."""
    kernels = load_kernels()
    return None if kernels is None else GatedDeltaKernels(kernels._lib)
