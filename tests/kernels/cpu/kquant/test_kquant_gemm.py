"""csrc/kquant_gemm.c, the int8 GEMM of GGUF block weights for prefill chunks
(``KQuantKernels.gemm``): against the ``gguf`` package's dequantize followed by a float64 matmul,
within the activations' int8 rounding (test_kquant.py's ``tolerance``), and against the block dots
(the same quantized activations and integer sums: they differ only in the order of float sums, and
not at all for the types the GEMM computes in the dots' canonical order, ``gemm_alike``).
Random valid blocks and real widths; ``make test-isa`` runs it under each x86 class's build
(AVX512-VNNI's vpdpbusd, AVX2's maddubs; the portable build has no GEMM and refuses)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from kvserve.benchmarks.scale.kernels import random_weight
from kvserve.kernels.cpu.kquant import BLOCK_TYPES, KQ_BLOCK, kquant_kernels

NAMES = {2: "Q4_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
KQ = kquant_kernels()
pytestmark = pytest.mark.skipif(KQ is None, reason="the CPU kernels are not built here (no compiler)")
TYPES = sorted(BLOCK_TYPES)
TAKEN = [t for t in TYPES if KQ is not None and KQ.gemm_takes(t, preferred=False)]


def random_blocks(ggml_type: int, n_out: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n_out, row bytes]: random bytes with finite float16 scales of either sign."""
    return random_weight(ggml_type, n_out, k, seed)


def reference(weight: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    values = dequantize(weight.numpy(), ggml_type).astype(np.float32)
    return torch.from_numpy(values).reshape(weight.shape[0], k)


def tolerance(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[rows, n_out]: each activation is off by at most half its 256-value block's step (max|x| /
    127 / 2), times |w|, plus float32 slack (as test_kquant.py)."""
    x = x.double()
    rows, k = x.shape
    half_step = (x.abs().view(rows, -1, KQ_BLOCK).amax(dim=-1, keepdim=True) / 254).expand(rows, -1, KQ_BLOCK)
    w = w.double().abs()
    return 1.001 * half_step.reshape(rows, k) @ w.T + 1e-5 * x.abs() @ w.T + 1e-6


def gemm(weight, ggml_type, k, x, bias=None, dtype=torch.float32):
    out = torch.empty(x.shape[0], weight.shape[0], dtype=dtype)
    KQ.gemm(weight, ggml_type, k, KQ.quantize(x), out, bias)
    return out


def dots(weight, ggml_type, k, x):
    out = torch.empty(x.shape[0], weight.shape[0])
    KQ.matmul(weight, ggml_type, k, KQ.quantize(x), out)
    return out


def test_the_vector_builds_take_the_k_quants():
    """The vector builds take every stored type (AVX2's Q8_0 by its signed values: its bytes offset
    to 0..255 would saturate maddubs' int16 pairs), the portable build none."""
    want = {512: TYPES, 256: TYPES, 0: []}[KQ.isa]
    assert want == TAKEN
    assert all(KQ.gemm_takes(t, preferred=False) for t in TYPES if KQ.gemm_takes(t))
    # AVX512-VNNI's K-quants follow the dots' canonical order (kquant_avx512.c); AVX2 not yet
    alike = {512: [t for t in TYPES if NAMES[t] in ("Q4_K", "Q5_K", "Q6_K")], 256: [], 0: []}[KQ.isa]
    assert alike == [t for t in TYPES if KQ.gemm_alike(t)]


ALIKE = [t for t in TAKEN if KQ.gemm_alike(t)]


@pytest.mark.parametrize("ggml_type", ALIKE, ids=NAMES.get)
@pytest.mark.parametrize("k", [256, 2048, 2304, 8192])
def test_alike_types_give_the_dots_bits_at_every_row_count(ggml_type, k):
    """Where ``gemm_alike``: every row of the GEMM (tiles of 8, 4, 2, 1 rows, a last panel of fewer
    weight rows) equals the block dots' bits, at 1, 8, 4 and 2 rows a pass (19 = 8 + 8 + 2 + 1) and
    one row at a time, in float32 and bfloat16 with a bias; widths of 1, 8, 9 and 32 superblocks
    (the one-row dots take 8 superblocks at a time), activations of mixed magnitudes."""
    n_out, rows = 37, 19
    weight = random_blocks(ggml_type, n_out, k, seed=k + ggml_type)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-3, 3, rows).unsqueeze(1)
    for dtype in (torch.float32, torch.bfloat16):
        bias = torch.randn(n_out, generator=gen).to(dtype) if dtype == torch.bfloat16 else None
        xs = x.to(dtype)
        act = KQ.quantize(xs)
        got, many = torch.empty(rows, n_out, dtype=dtype), torch.empty(rows, n_out, dtype=dtype)
        KQ.gemm(weight, ggml_type, k, act, got, bias)
        KQ.matmul(weight, ggml_type, k, act, many, bias)
        assert torch.equal(got, many)
        for r in range(rows):
            one = torch.empty(1, n_out, dtype=dtype)
            KQ.matmul(weight, ggml_type, k, KQ.quantize(xs[r : r + 1]), one, bias)
            assert torch.equal(one[0], got[r]), r


@pytest.mark.parametrize("ggml_type", TAKEN, ids=NAMES.get)
@pytest.mark.parametrize(("rows", "n_out"), [(1, 37), (9, 16), (13, 50), (130, 21)])
def test_random_blocks_match_dequantize_then_matmul(ggml_type, rows, n_out):
    """Every tile height (8, 4, 2, 1 rows on AVX-512; 4, 2, 1 on AVX2) and a last panel of fewer
    weight rows than its lanes."""
    k = 512
    weight = random_blocks(ggml_type, n_out, k, seed=ggml_type * 10 + rows)
    w = reference(weight, ggml_type, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = gemm(weight, ggml_type, k, x).double()
    want = x.double() @ w.double().T
    assert ((got - want).abs() <= tolerance(w, x)).all(), (got - want).abs().max()
    # the block dots sum the same integers: only the float sums' order differs
    slack = 1e-5 * x.double().abs() @ w.double().abs().T
    assert ((got - dots(weight, ggml_type, k, x).double()).abs() <= slack).all()


@pytest.mark.parametrize("ggml_type", TAKEN, ids=NAMES.get)
@pytest.mark.parametrize(("n_out", "k"), [(300, 2048), (40, 8192)], ids=["width2048", "width8192"])
def test_real_shaped_rows_with_bias_and_bfloat16(ggml_type, n_out, k):
    """SmolLM2-1.7B's widths (hidden 2048, intermediate 8192; a slice of the output rows), a prefill
    chunk of 128 rows, bfloat16 in and out with a bias."""
    weight = random_blocks(ggml_type, n_out, k, seed=k + ggml_type)
    w = reference(weight, ggml_type, k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(128, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n_out, generator=gen).to(torch.bfloat16)
    got = gemm(weight, ggml_type, k, x, bias, torch.bfloat16).double()
    want = x.double() @ w.double().T + bias.double()
    assert ((got - want).abs() <= tolerance(w, x) + want.abs() * 2**-8).all()


def test_a_shard_of_columns_is_multiplied_in_place():
    """A row-parallel shard (whole superblocks of each row, rows further apart than their bytes)
    written into a column range of a wider output."""
    ggml_type = 12
    if ggml_type not in TAKEN:
        pytest.skip("no int8 GEMM in this build")
    weight = random_blocks(ggml_type, 20, 1024, seed=1)
    per_block = BLOCK_TYPES[ggml_type][1]
    shard = weight[:, per_block : 3 * per_block]  # inputs 256..767
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(2))
    out = torch.zeros(11, 30)
    KQ.gemm(shard, ggml_type, 512, KQ.quantize(x), out[:, 5:25])
    w = reference(weight, ggml_type, 1024)[:, 256:768]
    assert ((out[:, 5:25].double() - x.double() @ w.double().T).abs() <= tolerance(w, x)).all()
    assert not out[:, :5].any() and not out[:, 25:].any()


def test_types_and_widths_it_does_not_take_are_refused():
    x = torch.randn(2, 2 * KQ_BLOCK)
    out = torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="status 1"):  # Q4_1: dequantized at load instead
        KQ.gemm(torch.zeros(4, 160, dtype=torch.uint8), 3, 256, KQ.quantize(x[:, :256]), out)
    with pytest.raises(RuntimeError, match="status 1"):  # Q8_0 rows of 288: not whole 256-value blocks
        KQ.gemm(torch.zeros(4, 9 * 34, dtype=torch.uint8), 8, 288, KQ.quantize(torch.randn(2, 288)), out)
    for t in TYPES:
        if t not in TAKEN:
            values, size = BLOCK_TYPES[t]
            with pytest.raises(RuntimeError, match="status 1"):
                KQ.gemm(torch.zeros(4, 512 // values * size, dtype=torch.uint8), t, 512, KQ.quantize(x), out)
