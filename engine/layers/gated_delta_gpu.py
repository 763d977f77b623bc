"""The GPU path of a Gated DeltaNet layer's token mixing: fla-core's (flash-linear-attention)
Triton kernels for the gated delta rule, causal-conv1d's CUDA kernels for the convolution.

- **Rule.** A prefill chunk of several tokens runs fla-core's chunked form
  (``chunk_gated_delta_rule``), a decode row its fused recurrent form
  (``fused_recurrent_gated_delta_rule``). Both take the state as ``[sequences, value heads,
  key dim, value dim]`` float32, the layout of our slots (``state_v_first=False``: the state is
  read as S^T k and updated by k (beta (v - S^T k))^T, as ``delta_rule_recurrent`` does), so
  the slots' rows go in and come back as they are, without a transposition. q and k are
  L2-normalised in the kernel (``use_qk_l2norm_in_kernel``, eps 1e-6 as ours) and q scaled by
  key dim ** -0.5 (their default); value head j reads key head j // (value heads / key heads) in
  their kernels as in ours. q, k and v are handed over in float32, so the rule computes what the
  torch forms compute whatever the model's dtype.
- **Convolution.** With causal-conv1d importable (a CUDA extension: the gpu extra, never built
  on a machine without CUDA), a prefill chunk runs ``causal_conv1d_fn`` from the slot's window and
  a decode step ``causal_conv1d_update`` on the slots' windows in place (``conv_state_indices``:
  no gather); its windows are ``[sequences, channels, K - 1]``, ours. Without it the torch forms
  of ``gated_delta.py`` run (``causal_conv``, ``causal_conv_step``), which capture in a CUDA graph
  as well.
- A decode step finds its slots in an index tensor on the device (``index``), so that a captured
  graph replays it with the slot numbers its static buffer holds (engine/runner/cuda_graphs.py).

Used on CUDA when fla-core is importable (``takes``); else the torch forms run, as on other
devices. The tests run the recurrent kernel under Triton's interpreter against the torch forms;
the chunked kernels do not run there (``chunk_delta_h``'s kernel fails in the interpreter), so
their test needs a GPU, and the full compile table compiles them (benchmarks/gpu_compile).
"""

from __future__ import annotations

import functools
import importlib

import torch

from kvserve.engine.layers.gated_delta import causal_conv, causal_conv_step

FLA_MISSING = "needs fla-core: pip install .[gpu]"


@functools.cache
def fla_rules():
    """fla-core's gated delta rule module, or None when fla-core is not installed."""
    try:
        return importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return None


@functools.cache
def conv_extension():
    """causal-conv1d's module, or None when the extension is not installed (or not built)."""
    try:
        return importlib.import_module("causal_conv1d")
    except ImportError:
        return None


def takes(mixed: torch.Tensor) -> bool:
    """Whether this step's rule runs in fla-core's kernels: on CUDA with fla-core installed."""
    return mixed.is_cuda and fla_rules() is not None


def _rules():
    rules = fla_rules()
    if rules is None:
        raise RuntimeError(f"the GPU gated delta rule {FLA_MISSING}")
    return rules


def rule_chunked(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """T tokens of one sequence in fla-core's chunked form: q, k [T, Hk, Dk], v [T, H, Dv],
    g, beta [T, H]; ``state`` [H, Dk, Dv] float32, updated in place. Returns [T, H, Dv] float32."""
    out, final = _rules().chunk_gated_delta_rule(
        q.float()[None], k.float()[None], v.float()[None], g=g.float()[None], beta=beta.float()[None],
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    state.copy_(final[0])
    return out[0]


def rule_recurrent(q, k, v, g, beta, states: torch.Tensor) -> torch.Tensor:
    """T tokens of each of B sequences in fla-core's fused recurrent form: q, k [B, T, Hk, Dk],
    v [B, T, H, Dv], g, beta [B, T, H]; ``states`` [B, H, Dk, Dv] float32, updated in place.
    Returns [B, T, H, Dv] float32."""
    out, final = _rules().fused_recurrent_gated_delta_rule(
        q.float(), k.float(), v.float(), g=g.float(), beta=beta.float(),  # by name: gk, gv come between
        initial_state=states, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    states.copy_(final)
    return out


def conv_chunk(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """SiLU(conv(x)) of one sequence's chunk ``x`` [T, C] after the window ``state`` [C, K - 1],
    updated in place; causal-conv1d's kernel on CUDA when installed, else ``causal_conv``."""
    ext = conv_extension()
    if ext is None or not x.is_cuda:
        return causal_conv(x, weight, state)
    # x.t() is [C, T] with channels contiguous: the channel-last layout its initial_states needs
    out, final = ext.causal_conv1d_fn(x.t()[None], weight, None, initial_states=state.to(x.dtype)[None],
                                      return_final_states=True, activation="silu")
    state.copy_(final[0])
    return out[0].t()


def conv_rows(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor,
              index: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences, ``x`` [B, C]: the windows at rows ``index`` of
    ``windows`` [slots, C, K - 1] step in place; causal-conv1d's update on CUDA when installed,
    else the torch step on gathered rows."""
    ext = conv_extension()
    if ext is not None and x.is_cuda and windows.dtype == x.dtype:
        return ext.causal_conv1d_update(x, windows, weight, None, "silu",
                                        conv_state_indices=index.to(torch.int32))
    rows = windows.index_select(0, index)
    out = causal_conv_step(x, weight, rows)
    windows.index_copy_(0, index, rows)
    return out


def prefill(mixed, weight, conv_state, state, g, beta, split) -> torch.Tensor:
    """One sequence's chunk ``mixed`` [T, conv channels] from its slot's window and state (both
    updated in place): the conv, then the rule (chunked; recurrent for one token). ``split``
    cuts conv outputs into q, k, v heads. Returns [T, H, Dv] float32."""
    q, k, v = split(conv_chunk(mixed, weight, conv_state))
    if mixed.shape[0] == 1:
        return rule_recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])[0]
    return rule_chunked(q, k, v, g, beta, state)


def decode(mixed, weight, conv_states, recurrent_states, index, g, beta, split) -> torch.Tensor:
    """One token of each sequence at the slot rows ``index`` (a device tensor, distinct slots):
    the conv windows and recurrent states of those rows step in place. Returns [B, H, Dv]
    float32."""
    q, k, v = split(conv_rows(mixed, weight, conv_states, index))
    states = recurrent_states.index_select(0, index)
    out = rule_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], states)
    recurrent_states.index_copy_(0, index, states)
    return out[:, 0]
