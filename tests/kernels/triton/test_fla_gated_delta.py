"""The GPU path of the Gated DeltaNet layers (engine/layers/gated_delta_gpu.py): fla-core's
kernels against our torch forms (engine/layers/gated_delta.py), in float32, through the same
functions the layer calls, with the state cache's layout (slot rows of [value heads, key dim,
value dim], several value heads per key head).

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before anything imports triton). fla-core's fused recurrent kernel runs there: a decode step on
scattered slots and a chunk from a carried state are checked on the CPU. Its chunked kernels do
not (triton 3.9, fla-core 0.6.0: ``chunk_delta_h``'s kernel fails in the interpreter), so the
chunked prefill's test needs a GPU and skips on the CPU saying so; the full compile table
(benchmarks/gpu_compile/fla_kernels.py) compiles them for sm_80/89/90. Key dim 16 against value
dim 32: a state read in the other orientation ([V, K]) could not give the torch form's values.
Without fla-core installed every test here skips, saying so.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.layers import gated_delta, gated_delta_gpu
from kvserve.engine.layers.gated_delta_gpu import FLA_MISSING

pytest.importorskip("fla.ops.gated_delta_rule", reason=FLA_MISSING)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NEEDS_GPU = pytest.mark.skipif(not CUDA, reason="fla-core's chunked kernels do not run under Triton's "
                               "interpreter (chunk_delta_h's kernel fails there): this test needs a GPU")
HK, HV, DK, DV, KERNEL = 2, 4, 16, 32, 4  # two value heads read each key head
CHANNELS = 2 * HK * DK + HV * DV


def split(mixed: torch.Tensor):
    q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
    shape = mixed.shape[:-1]
    return q.reshape(*shape, HK, DK), k.reshape(*shape, HK, DK), v.reshape(*shape, HV, DV)


def inputs(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(tokens, CHANNELS, generator=gen)
    g = -torch.rand(tokens, HV, generator=gen) * 0.5  # decays in (exp(-0.5), 1]
    beta = torch.rand(tokens, HV, generator=gen)
    return mixed.to(DEVICE), g.to(DEVICE), beta.to(DEVICE)


def states(slots: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(slots, CHANNELS, KERNEL - 1, generator=gen)
    recurrent = torch.randn(slots, HV, DK, DV, generator=gen) * 0.3
    weight = torch.randn(CHANNELS, KERNEL, generator=gen) * 0.5
    return conv.to(DEVICE), recurrent.to(DEVICE), weight.to(DEVICE)


def test_the_layer_keeps_the_torch_and_c_forms_off_cuda():
    assert not gated_delta_gpu.takes(torch.zeros(2, CHANNELS))
    assert gated_delta_gpu.fla_rules() is not None
    if CUDA:
        assert gated_delta_gpu.takes(torch.zeros(2, CHANNELS, device="cuda"))


def test_a_decode_step_on_scattered_slots_equals_the_torch_step():
    """fla-core's fused recurrent step (and the conv's update) on slots 4, 1 and 2 of six: the
    outputs, the stepped rows and the untouched rows all as the torch step leaves them."""
    conv, recurrent, weight = states(6, seed=1)
    mixed, g, beta = inputs(3, seed=2)
    index = torch.tensor([4, 1, 2], device=DEVICE)
    ours_conv, ours_recurrent = conv.clone(), recurrent.clone()
    ours = gated_delta_gpu.decode(mixed, weight, ours_conv, ours_recurrent, index, g, beta, split)

    want_conv, want_states = conv[index].clone(), recurrent[index].clone()
    q, k, v = split(gated_delta.causal_conv_step(mixed, weight, want_conv))
    want = gated_delta.delta_rule_recurrent(q, k, v, g, beta, want_states)
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ours_conv[index], want_conv)
    torch.testing.assert_close(ours_recurrent[index], want_states, atol=2e-5, rtol=2e-5)
    untouched = torch.tensor([0, 3, 5], device=DEVICE)
    assert torch.equal(ours_conv[untouched], conv[untouched])
    assert torch.equal(ours_recurrent[untouched], recurrent[untouched])


def test_the_recurrent_kernel_over_a_chunk_from_a_carried_state_equals_the_chunked_torch_form():
    """A 70-token chunk (past a 64-token block of the torch chunked form) from a non-zero state:
    the same outputs and final state; the state layout needs no transposition."""
    _, recurrent, _ = states(1, seed=3)
    mixed, g, beta = inputs(70, seed=4)
    q, k, v = split(mixed)
    ours_state, want_state = recurrent.clone(), recurrent[0].clone()
    ours = gated_delta_gpu.rule_recurrent(q[None], k[None], v[None], g[None], beta[None], ours_state)[0]
    want = gated_delta.delta_rule_chunked(q, k, v, g, beta, want_state)
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_state[0], want_state, atol=1e-4, rtol=1e-4)


@NEEDS_GPU
def test_a_chunked_prefill_from_a_slot_equals_the_torch_forms():
    """One sequence's 150-token chunk (three 64-token blocks, the last partial) from a slot's conv
    window and state: fla-core's chunked form (and causal-conv1d's forward when installed)."""
    conv, recurrent, weight = states(1, seed=5)
    mixed, g, beta = inputs(150, seed=6)
    ours_conv, ours_state = conv[0].clone(), recurrent[0].clone()
    ours = gated_delta_gpu.prefill(mixed, weight, ours_conv, ours_state, g, beta, split)
    want_conv, want_state = conv[0].clone(), recurrent[0].clone()
    q, k, v = split(gated_delta.causal_conv(mixed, weight, want_conv))
    want = gated_delta.delta_rule_chunked(q, k, v, g, beta, want_state)
    torch.testing.assert_close(ours, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(ours_conv, want_conv)
    torch.testing.assert_close(ours_state, want_state, atol=2e-4, rtol=2e-4)
