"""csrc/gated_delta.c against the torch forms of engine/layers/gated_delta.py (and transformers'
recurrent rule) in float32 on random inputs: prompts across and off 64-token blocks, a state carried
from a snapshot and from chunk to chunk, decode steps of several sequences on scattered slots of the
state cache in place (the other rows untouched), bfloat16 inputs, and the shapes refused."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.layers import gated_delta
from kvserve.kernels.cpu.gated_delta import gated_delta_kernels

KERNELS = gated_delta_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no CPU kernels (no compiler, or disabled)")
HK, H, DK, DV, K = 2, 4, 32, 48, 4  # two value heads per key head; three strips of 16 values
CHANNELS = 2 * HK * DK + H * DV


def inputs(tokens: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(tokens, CHANNELS, generator=gen).to(dtype)
    g, beta = -torch.rand(tokens, H, generator=gen) * 2, torch.rand(tokens, H, generator=gen)
    return mixed, g, beta


def torch_rule(mixed, g, beta, state):
    """delta_rule_chunked (delta_rule_recurrent for one token) on [q | k | v] rows."""
    q, k, v = mixed.split([HK * DK, HK * DK, H * DV], dim=-1)
    q, k, v = q.reshape(-1, HK, DK), k.reshape(-1, HK, DK), v.reshape(-1, H, DV)
    if mixed.shape[0] == 1:
        return gated_delta.delta_rule_recurrent(q, k, v, g, beta, state.unsqueeze(0))
    return gated_delta.delta_rule_chunked(q, k, v, g, beta, state)


def test_the_vector_path_is_one_of_the_three():
    assert KERNELS.vector_bits in (0, 256, 512)


@pytest.mark.parametrize("tokens", [1, 2, 63, 64, 65, 130, 300])
def test_prefill_from_a_snapshot_equals_the_torch_rule(tokens):
    mixed, g, beta = inputs(tokens, tokens)
    snapshot = torch.randn(H, DK, DV, generator=torch.Generator().manual_seed(99)) * 0.3
    state_c, state_t = snapshot.clone(), snapshot.clone()
    out_c = KERNELS.prefill(mixed, g, beta, state_c, HK, DK)
    out_t = torch_rule(mixed, g, beta, state_t)
    torch.testing.assert_close(out_c, out_t, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state_c, state_t, atol=2e-5, rtol=1e-4)


def test_prefill_in_chunks_equals_transformers_over_the_whole_prompt():
    """Chunks of 1, 64, 3, 70 and 62 tokens (a strided view of a wider projection, as the layer
    passes it) carry the state to transformers' outputs over all 200."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    mixed, g, beta = inputs(200, 7)
    q, k, v = mixed.split([HK * DK, HK * DK, H * DV], dim=-1)
    q, k = (x.reshape(1, -1, HK, DK).repeat_interleave(H // HK, dim=2) for x in (q, k))
    want, want_state = hf.torch_recurrent_gated_delta_rule(q, k, v.reshape(1, -1, H, DV), g=g[None],
                                                           beta=beta[None], use_qk_l2norm_in_kernel=True,
                                                           output_final_state=True)
    wide = torch.cat((mixed, torch.randn(200, 5)), dim=-1)[:, :CHANNELS]  # rows CHANNELS + 5 apart
    state, outs, start = torch.zeros(H, DK, DV), [], 0
    for n in (1, 64, 3, 70, 62):
        outs.append(KERNELS.prefill(wide[start:start + n], g[start:start + n], beta[start:start + n], state,
                                    HK, DK))
        start += n
    torch.testing.assert_close(torch.cat(outs), want[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state, want_state[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_on_scattered_slots_equal_the_torch_step_in_place(dtype):
    slots = torch.tensor([5, 0, 3], dtype=torch.int64)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(CHANNELS, K, generator=gen).to(dtype)
    conv = torch.randn(7, CHANNELS, K - 1, generator=gen).to(dtype)
    states = torch.randn(7, H, DK, DV, generator=gen) * 0.3
    conv_t, states_t = conv.clone(), states.clone()
    for step in range(5):
        mixed, g, beta = inputs(len(slots), 100 + step, dtype)
        out_c = KERNELS.decode(mixed, weight, conv, states, slots, g, beta, HK, DK)
        window, state = conv_t[slots], states_t[slots]
        x = gated_delta.causal_conv_step(mixed, weight, window)
        q, k, v = x.split([HK * DK, HK * DK, H * DV], dim=-1)
        out_t = gated_delta.delta_rule_recurrent(q.reshape(-1, HK, DK), k.reshape(-1, HK, DK),
                                                 v.reshape(-1, H, DV), g, beta, state)
        conv_t[slots], states_t[slots] = window, state
        tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out_c, out_t, **tol)
        torch.testing.assert_close(states, states_t, **tol)
        assert torch.equal(conv, conv_t)  # the windows hold the inputs themselves
    untouched = [1, 2, 4, 6]
    assert torch.equal(states[untouched], states_t[untouched])


def test_shapes_the_kernels_refuse_keep_the_torch_forms():
    narrow = torch.zeros(3, 2 * HK * DK + H * 8)  # value heads of 8: not whole strips of 16
    assert gated_delta.cpu_kernels(narrow, HK, H, DK, 8) is None
    assert gated_delta.cpu_kernels(torch.zeros(3, CHANNELS, dtype=torch.float16), HK, H, DK, DV) is None
    assert gated_delta.cpu_kernels(torch.zeros(3, CHANNELS), HK, H, DK, DV) is KERNELS
    with pytest.raises(RuntimeError, match="shape it does not take"):
        KERNELS.prefill(torch.zeros(2, CHANNELS), torch.zeros(2, H), torch.zeros(2, H),
                        torch.zeros(H, DK + 1, DV), HK, DK + 1)  # an odd key dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_convolution_in_chunks_equals_the_torch_convolution(dtype):
    """Chunks of 1, 2, 70 and 3 tokens (inside the K - 1 window and across it) from a snapshot's
    window; 70 channels (a last item of 6)."""
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(76, 70, generator=gen).to(dtype), torch.randn(70, K, generator=gen).to(dtype)
    window = torch.randn(70, K - 1, generator=gen).to(dtype)
    window_t, start = window.clone(), 0
    for n in (1, 2, 70, 3):
        got = KERNELS.conv(x[start:start + n], weight, window)
        want = gated_delta.causal_conv(x[start:start + n], weight, window_t)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5) if dtype == torch.float32 else \
            torch.testing.assert_close(got, want)
        assert torch.equal(window, window_t)
        start += n


def test_the_layer_runs_the_kernels_on_the_cpu_and_its_torch_forms_give_the_same():
    """A Qwen3.5 Gated DeltaNet layer (tiny shape): its prefill and decode are the kernels' own
    outputs, bit for bit, and within float32 rounding of the same layer with its kernels off."""
    from kvserve.engine.distributed.parallel import ParallelContext
    from kvserve.engine.models.qwen3_5 import GatedDeltaNet, state_shapes
    from kvserve.testing.random_model import make_config

    config = make_config("qwen3.5-tiny")
    layer = GatedDeltaNet(config, ParallelContext())
    gen = torch.Generator().manual_seed(11)
    layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen))
    conv_shape, state_shape = state_shapes(config)
    layer.bind_state(torch.zeros(3, *conv_shape), torch.zeros(3, *state_shape))
    heads = layer.num_v_heads
    mixed, g, beta = (torch.randn(70, layer.conv_size, generator=gen), -torch.rand(70, heads, generator=gen),
                      torch.rand(70, heads, generator=gen))
    weight = layer.conv1d.weight[:, 0]
    window, state = torch.zeros(conv_shape), torch.zeros(state_shape)
    want = KERNELS.prefill(KERNELS.conv(mixed[:69], weight, window), g[:69], beta[:69], state,
                           layer.num_k_heads, layer.k_dim)
    got = layer._sequence(mixed[:69], g[:69], beta[:69], 2, True)
    assert torch.equal(got, want) and torch.equal(layer.recurrent_states[2], state)
    slots = torch.tensor([2], dtype=torch.int64)
    convs, states = window[None].clone(), state[None].clone()
    want = KERNELS.decode(mixed[69:], weight, convs, states, slots - 2, g[69:], beta[69:], layer.num_k_heads,
                          layer.k_dim)
    assert torch.equal(layer._decode(mixed[69:], g[69:], beta[69:], [2]), want)
    layer.recurrent_states.zero_()
    layer._kernels = lambda mixed: None  # the torch forms
    tol = dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(layer._sequence(mixed[:69], g[:69], beta[:69], 2, True), got, **tol)
    torch.testing.assert_close(layer._decode(mixed[69:], g[69:], beta[69:], [2]), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_norm_equals_the_layers_torch_form(dtype):
    """gdn_gated_norm against GatedDeltaNet._gated_norm on the same rule output, z a strided view
    of a wider projection (as the layer's split gives it), 37 tokens (odd, so the threads' rows
    split unevenly): bfloat16 rounds where torch rounds, so they differ by at most one bfloat16 step
    where the sum of squares or SiLU's exp rounded differently."""
    from types import SimpleNamespace

    from kvserve.engine.models.qwen3_5 import GatedDeltaNet

    gen = torch.Generator().manual_seed(21)
    rule = torch.randn(37, H, DV, generator=gen) * 3
    wide = torch.randn(37, H * DV + 9, generator=gen).to(dtype)
    z = wide[:, 5:5 + H * DV]
    weight = (torch.randn(DV, generator=gen) * 0.5 + 1).to(dtype)
    got = KERNELS.gated_norm(rule, z, weight, 1e-6)
    layer = SimpleNamespace(norm_weight=weight, eps=1e-6)
    want = GatedDeltaNet._gated_norm(layer, rule.to(dtype), z.reshape(37, H, DV)).reshape(37, -1)
    assert got.dtype == dtype and got.shape == (37, H * DV)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:
        step = want.float().abs().clamp_min(1e-3) * 2**-7  # one bfloat16 step
        assert ((got.float() - want.float()).abs() <= step).all()
        assert (got == want).float().mean() > 0.99  # and almost all the same bits
    with pytest.raises(RuntimeError, match="shape it does not take"):
        KERNELS.gated_norm(torch.zeros(2, H, 8192), torch.zeros(2, H * 8192), torch.zeros(8192), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gates_equal_the_torch_ops_they_replace(dtype):
    """gdn_gates against torch's beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), b and a
    side by side in a wider projection's rows (as the layer's split leaves them), a + dt_bias above
    softplus's threshold of 20 too: within float32 rounding (bfloat16 beta: one bfloat16 step)."""
    gen = torch.Generator().manual_seed(31)
    wide = (torch.randn(9, 7 + 2 * H, generator=gen) * 6).to(dtype)
    wide[0, 7 + H:] = 30  # softplus's threshold
    b, a = wide[:, 7:7 + H], wide[:, 7 + H:]
    a_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    g, beta = gated_delta.gates(b, a, a_log, dt_bias, KERNELS)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (9, H)
    want_g, want_beta = gated_delta.gates(b, a, a_log, dt_bias, None)  # the torch ops
    torch.testing.assert_close(g, want_g, atol=1e-6, rtol=1e-5)
    assert torch.equal(beta.to(dtype).float(), beta)  # rounded to the model's dtype, as torch's
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(beta, want_beta.float(), atol=tol, rtol=0)
    # b and a not side by side: the torch ops
    b, a = b.contiguous(), a.contiguous()
    got = gated_delta.gates(b, a, a_log, dt_bias, KERNELS)
    want = gated_delta.gates(b, a, a_log, dt_bias, None)
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_output_gate_equals_torchs(dtype):
    """sigmoid_gate against torch's out * sigmoid(gate) of the model's dtype, the gate the second
    half of each head of a q|gate projection (strided): within one rounding of the sigmoid."""
    gen = torch.Generator().manual_seed(41)
    out = (torch.randn(5, 3, 64, generator=gen) * 2).to(dtype)
    gate = (torch.randn(5, 3, 128, generator=gen) * 4).to(dtype)[..., 64:]
    want = out * torch.sigmoid(gate)
    got = KERNELS.sigmoid_gate(out.clone(), gate)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:
        step = want.float().abs().clamp_min(1e-3) * 2**-7
        assert ((got.float() - want.float()).abs() <= 2 * step).all()
