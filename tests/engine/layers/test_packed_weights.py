"""Packed bfloat16 weights on the CPU (``engine/layers/cpu_matmul.py`` ``pack_weight``): the
same products as the plain weights, made once at load, at every row count the engine runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.layers.cpu_matmul import linear, pack_weight

needs_packing = pytest.mark.skipif(pack_weight(torch.zeros(2, 2, dtype=torch.bfloat16)) is None,
                                   reason="no oneDNN bfloat16 support on this CPU")


@needs_packing
@pytest.mark.parametrize("rows", [2, 7, 48, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(320, 192, generator=gen).to(torch.bfloat16)
    b = torch.randn(320, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 192, generator=gen).to(torch.bfloat16)
    packed = pack_weight(w)
    assert packed is not None
    want = F.linear(x, w, b)
    got = linear(x, w, b, packed)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()
    # a [batch, tokens, hidden] input and a strided view (a slice of a wider activation)
    wide = torch.randn(rows, 400, generator=gen).to(torch.bfloat16)
    assert torch.allclose(linear(wide[:, :192], w, b, packed).float(), F.linear(wide[:, :192], w, b).float(),
                          rtol=1e-2, atol=1e-2)
    assert linear(x.view(1, rows, 192), w, b, packed).shape == (1, rows, 320)


def test_only_bfloat16_cpu_weights_are_packed():
    assert pack_weight(torch.zeros(4, 4)) is None
    assert pack_weight(torch.zeros(4, 4, dtype=torch.float16)) is None
    assert pack_weight(torch.zeros(4, dtype=torch.bfloat16)) is None


# How far two bfloat16 GEMMs with other summation orders (gemm.c's tiles; oneDNN's, which widens
# bfloat16 to float and blocks k its own way where the CPU has no AVX512-BF16) move the bundled
# model's log-probabilities: its logits (16 to 32 at the top) round to bfloat16 at the LM head, in
# steps of 0.125 there, and the two differ by a step or two (up to 0.135 measured on all three x86
# classes; a wrong layout or blocking moves them by whole units)
BF16_GEMM_LOGPROB_TOLERANCE = 0.25


@needs_packing
def test_bf16_engine_packs_its_projections_and_generates_what_plain_weights_do():
    """Greedy tokens of the bundled model in bfloat16, packed (as the engine loads it) and with
    the packed copies dropped (every layer back on ``F.linear``), batched so that every step has
    more than one row (the fused decode step, which reads the plain weights, kept out). The two
    multiply in different kernels, so they agree up to the first near tie: the same tokens with
    log-probabilities within the tolerance, and where the tokens part, the plain run ranks the packed
    run's token within twice that of its own (a layout or blocking bug moves far more)."""
    llm = LLM("default", dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64)
    model = llm.engine.executor.model
    model.model._decode_row = None  # decode steps of 4 rows multiply here too, not in the fused step
    # (the LM head multiplies the file's Q8_0 table as stored: engine/layers/gguf_linear.py)
    layers = [m for m in model.modules() if hasattr(m, "packed") and m.quantized is None]
    assert layers and all(m.packed is not None for m in layers)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    packed = llm.generate(prompts, params, use_tqdm=False)
    for m in layers:
        m.packed = None
    plain = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(packed, plain, strict=True):
        parted = [i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y]
        same = parted[0] if parted else len(a.token_ids)
        for i in range(same):
            gap = abs(a.logprobs[i].logprob - b.logprobs[i].logprob)
            assert gap <= BF16_GEMM_LOGPROB_TOLERANCE, (b.text, i, gap)
        if same < len(a.token_ids):
            ranked = dict(b.logprobs[same].top)
            assert a.token_ids[same] in ranked, (b.text, same)
            gap = ranked[b.token_ids[same]] - ranked[a.token_ids[same]]
            assert gap <= 2 * BF16_GEMM_LOGPROB_TOLERANCE, (b.text, same, gap)


def _bf16_layers():
    from torch import nn

    from kvserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
    model = nn.Sequential(ColumnParallelLinear(192, 320), RowParallelLinear(320, 192))
    for layer in model:
        layer.weight.data = torch.randn_like(layer.weight).to(torch.bfloat16)
    return model


@needs_packing
def test_packing_counts_its_bytes_and_stays_off_when_memory_is_short(monkeypatch, caplog):
    from kvserve.engine.layers import cpu_matmul
    model = _bf16_layers()
    monkeypatch.setattr(cpu_matmul, "available_memory", lambda: 1 << 40)
    assert cpu_matmul.pack_model_weights(model) == (320 * 192 + 192 * 320) * 2
    assert all(layer.packed is not None for layer in model)
    model = _bf16_layers()
    monkeypatch.setattr(cpu_matmul, "available_memory", lambda: 100_000)  # < 2 x the copies' 245,760 bytes
    with caplog.at_level("WARNING", logger="kvserve.engine.layers"):
        assert cpu_matmul.pack_model_weights(model) == 0
    assert all(layer.packed is None for layer in model)
    # enough in all, but not once the KV cache's budget is set aside, or shared by four ranks
    monkeypatch.setattr(cpu_matmul, "available_memory", lambda: 1_000_000)
    assert cpu_matmul.pack_model_weights(model, reserved=600_000) == 0
    assert cpu_matmul.pack_model_weights(model, sharers=4) == 0
    assert cpu_matmul.pack_model_weights(model) == 245_760
    assert "not packed" in caplog.text
    x = torch.randn(5, 192).to(torch.bfloat16)
    assert model(x).shape == (5, 192)  # plain F.linear
