"""csrc/gemm.c, the bfloat16 GEMM over packed weights that the CPU's projections of more than a few
rows go through (``engine/layers/cpu_matmul.py``): products against a float64 reference at every tile
edge, each row's result independent of the rows beside it, and the shapes it leaves to oneDNN."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.layers.cpu_matmul import linear, pack_weight
from kvserve.kernels.cpu.abi import PackedWeight
from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.kernels.cpu.build import header_constant

KERNEL = load_kernels()
pytestmark = pytest.mark.skipif(KERNEL is None or not KERNEL.gemm_available(),
                                reason="csrc/gemm.c is built where the compiler targets AVX-512 or AVX2")
needs_quantized = pytest.mark.skipif(KERNEL is None or not KERNEL.gemm_quantized,
                                     reason="int8/int4 panels: gemm.c's AVX-512 and AVX2 builds only")
MC = header_constant("GEMM_MC")  # rows of x per pass over the weight panels


def reference(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize(("n_out", "k_in"), [(16, 2), (32, 6), (48, 64), (5 * 48 + 16, 34), (960, 576)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 33, MC + 9])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_a_float64_reference(n_out, k_in, rows, bias):
    gen = torch.Generator().manual_seed(n_out * 1000 + rows)
    w = torch.randn(n_out, k_in, generator=gen).to(torch.bfloat16)
    b = torch.randn(n_out, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k_in, generator=gen).to(torch.bfloat16)
    packed = KERNEL.pack_gemm_weight(w)
    assert isinstance(packed, PackedWeight) and packed.data.numel() == w.numel()
    got = KERNEL.gemm(x, packed, b)
    want = reference(x, w, b)
    assert got.shape == (rows, n_out) and got.dtype == torch.bfloat16
    # float sums of exact bfloat16 products, rounded once: within a bfloat16 step of the value
    assert ((got.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-3 * k_in ** 0.5).all()


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5 * 48 + 32, 96, generator=gen).to(torch.bfloat16)
    x = torch.randn(MC + 20, 96, generator=gen).to(torch.bfloat16)
    packed = KERNEL.pack_gemm_weight(w)
    whole = KERNEL.gemm(x, packed, None)
    for start, count in ((0, 1), (3, 5), (7, 9), (MC - 2, 4), (MC + 19, 1)):
        assert torch.equal(KERNEL.gemm(x[start:start + count], packed, None), whole[start:start + count])


def test_rows_of_a_wider_activation_and_a_batch_dimension():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 40, generator=gen).to(torch.bfloat16)
    wide = torch.randn(11, 100, generator=gen).to(torch.bfloat16)
    packed = KERNEL.pack_gemm_weight(w)  # (pack_weight keeps oneDNN's on CPUs with AMX)
    x = wide[:, 30:70]  # rows 100 elements apart
    odd = torch.randn(11, 101, generator=gen).to(torch.bfloat16)[:, 31:71]  # rows an odd 101 apart
    assert torch.equal(KERNEL.gemm(odd, packed, None), KERNEL.gemm(odd.contiguous(), packed, None))
    assert torch.equal(linear(x, w, None, packed), KERNEL.gemm(x.contiguous(), packed, None))
    assert torch.equal(linear(x.reshape(1, 11, 40), w, None, packed)[0], linear(x, w, None, packed))


def test_shapes_it_does_not_take_stay_with_onednn_or_torch():
    odd_width = torch.randn(32, 7).to(torch.bfloat16)
    assert KERNEL.pack_gemm_weight(torch.randn(32, 9).to(torch.bfloat16)[:, :8]) is None  # rows 9 apart
    ragged_out = torch.randn(40, 8).to(torch.bfloat16)
    assert KERNEL.pack_gemm_weight(odd_width) is None and KERNEL.pack_gemm_weight(ragged_out) is None
    for w in (odd_width, ragged_out):
        packed = pack_weight(w)
        assert not isinstance(packed, PackedWeight)
        x = torch.randn(9, w.shape[1]).to(torch.bfloat16)
        got = linear(x, w, None, packed).double()
        assert torch.allclose(got, reference(x, w, None), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="bfloat16 x"):
        KERNEL.gemm(torch.zeros(3, 8), KERNEL.pack_gemm_weight(torch.zeros(16, 8).to(torch.bfloat16)), None)


@needs_quantized
@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize(("n_out", "k_in"), [(16, 64), (5 * 48 + 16, 128), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 9, 33, MC + 9])
def test_quantized_weights_dequantized_panel_by_panel(method, n_out, k_in, rows):
    """gemm_bf16_quantized: int4 and int8 weights (engine/layers/quantization.py) multiplied as
    gemm_bf16 multiplies their dequantized bfloat16 values (the format's definition,
    ``dequantize_torch``), bias added; each row's result independent of the rows beside it."""
    from kvserve.engine.layers.quantization import quantize_int4, quantize_int8

    gen = torch.Generator().manual_seed(n_out + rows)
    w = torch.randn(n_out, k_in, generator=gen).to(torch.bfloat16)
    b = torch.randn(n_out, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k_in, generator=gen).to(torch.bfloat16)
    q = (quantize_int4 if method == "int4" else quantize_int8)(w)
    got = KERNEL.quantized_gemm(x, q.kernel_linear(b, torch.bfloat16))
    deq = q.dequantize_torch(torch.bfloat16)
    assert torch.equal(got, KERNEL.gemm(x, KERNEL.pack_gemm_weight(deq), b))
    want = reference(x, deq, b)
    assert ((got.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-3 * k_in ** 0.5).all()
    assert torch.equal(KERNEL.quantized_gemm(x[-1:].clone(), q.kernel_linear(b, torch.bfloat16)), got[-1:])
    # the projections beyond the few-row kernels' rows take it
    if rows > 8:
        assert torch.equal(q.linear(x, b), got)
    assert KERNEL.quantized_gemm(x[:0], q.kernel_linear(b, torch.bfloat16)).shape == (0, n_out)


@pytest.mark.parametrize("method", [None, pytest.param("int4", marks=needs_quantized),
                                    pytest.param("int8", marks=needs_quantized)])
@pytest.mark.parametrize(("half", "k_in"), [(16, 64), (5 * 48 + 16, 128), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 9, 33, MC + 9])
def test_gate_up_product_comes_out_as_silu_of_gate_times_up(method, half, k_in, rows):
    """glu: a gate|up weight's silu(gate) * up straight out of the tiles (the product is never
    stored) equals silu_and_mul of the stored product bit for bit, packed or quantized, bias
    included, each row independent of the rows beside it; and the layer (MergedColumnParallelLinear
    .silu_and_mul) takes that path where gemm.c takes the call, leaving the rest to its caller."""
    from kvserve.engine.layers.activation import silu_and_mul
    from kvserve.engine.layers.linear import MergedColumnParallelLinear
    from kvserve.engine.layers.quantization import quantize_int4, quantize_int8

    gen = torch.Generator().manual_seed(half + rows)
    w = torch.randn(2 * half, k_in, generator=gen).to(torch.bfloat16)
    b = torch.randn(2 * half, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k_in, generator=gen).to(torch.bfloat16)
    if method is None:
        packed = KERNEL.pack_gemm_weight(w)
        got, product = KERNEL.gemm(x, packed, b, glu=True), KERNEL.gemm(x, packed, b)
        one = KERNEL.gemm(x[-1:].clone(), packed, b, glu=True)
    else:
        q = (quantize_int4 if method == "int4" else quantize_int8)(w)
        lin = q.kernel_linear(b, torch.bfloat16)
        got, product = KERNEL.quantized_gemm(x, lin, glu=True), KERNEL.quantized_gemm(x, lin)
        one = KERNEL.quantized_gemm(x[-1:].clone(), lin, glu=True)
    assert got.shape == (rows, half)
    assert torch.equal(got, silu_and_mul(product))
    assert torch.equal(one, got[-1:])

    layer = MergedColumnParallelLinear(k_in, [half, half], bias=True).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    if method is None:
        layer.packed = KERNEL.pack_gemm_weight(w)
    else:
        layer.quantize(method)
    fused = layer.silu_and_mul(x)
    if method is not None and rows <= header_constant("MAX_FUSED_ROWS"):
        assert fused is None  # the row kernel's rows: the caller multiplies, then silu_and_mul
    else:
        assert torch.equal(fused, silu_and_mul(layer(x)))
    with pytest.raises(ValueError, match="glu"):
        KERNEL.gemm(x, KERNEL.pack_gemm_weight(torch.ones(48, k_in).to(torch.bfloat16)), None, glu=True)
