"""Weight-only int8: per-row quantization, both kernel paths, and a whole model through the runner."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.config import EngineConfig
from kvserve.engine.layers.quantization import INT8_KERNEL_MAX_ROWS, int8_linear, quantize_int8
from kvserve.engine.model_input import ModelInput
from kvserve.engine.model_runner import ModelRunner
from kvserve.kernels.cpu_kernels import load_kernels

KERNELS = load_kernels()


def activation_block(k_in: int) -> int:
    """The block the one-row int8 kernel quantizes activations of width k_in by (0: floats)."""
    return KERNELS.int8_activation_block(k_in) if KERNELS is not None else 0


def as_the_kernel_rounds(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [rows, K] as floats after the kernel's quantization per ``block`` values (none for 0):
    sign * round(|x| * 127 / max|x|) * max|x| / 127, halves to even."""
    x = x.float()
    if not block:
        return x
    b = x.view(x.shape[0], -1, block)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (b.sign() * torch.round(b.abs() * inv) * (amax / 127.0)).view_as(x)


def test_rows_are_quantized_within_half_a_step_of_their_scale():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 1, 64)[:, None]
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scales.shape == (64,)
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, 100])
def test_int8_linear_is_the_product_with_the_dequantized_weight(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(80, 64, generator=gen).to(dtype), torch.randn(80, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    q, scales = quantize_int8(w)
    block = activation_block(64) if rows == 1 else 0  # one row: the kernel, below
    expected = F.linear(as_the_kernel_rounds(x, block), q.float() * scales.float()[:, None], bias.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(int8_linear(x, q, scales, bias).float(), expected, atol=tol, rtol=tol)


@pytest.mark.skipif(not activation_block(64), reason="int8 activations: kernels on AVX512-VNNI CPUs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_kernel_quantizes_activations_per_block_of_32(dtype):
    """On AVX512-VNNI CPUs the one-row int8 kernel quantizes x per 32 values and sums in integers:
    its result is the product of the weight with x as rounded so, to float precision (blocks of
    very different magnitudes, an all-zero block, negative values); not x's exact product."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 640, generator=gen)
    x[0, :32] *= 300
    x[0, 64:96] = 0
    x[0, 100:130] = -x[0, 100:130].abs() / 50
    x = x.to(dtype)
    q = torch.randint(-127, 128, (203, 640), generator=gen, dtype=torch.int8)
    scales = (torch.rand(203, generator=gen) / 100).to(dtype)
    bias = torch.randn(203, generator=gen).to(dtype)
    weight = q.double() * scales.double()[:, None]
    block = activation_block(640)
    assert block == 32 and activation_block(999) == 0  # widths not a multiple of 64 stay floats
    want = F.linear(as_the_kernel_rounds(x, block).double(), weight, bias.double())
    got = KERNELS.small_linear(x, q, bias, scales).double()
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # float sums; bfloat16's output rounding
    assert ((got - want).abs() / (want.abs() + 1)).max().item() < tol
    exact = F.linear(x.double(), weight, bias.double())
    assert ((got - exact).abs() / (exact.abs() + 1)).max().item() > 10 * tol


def test_unknown_quantization_is_refused_with_the_field_name():
    with pytest.raises(ValueError, match="quantization must be one of \\['int8'\\], got 'int4'"):
        EngineConfig(quantization="int4")


def test_int8_runner_keeps_the_float_models_clear_greedy_choices(tiny_qwen2_dir):
    ids = [5, 17, 250, 3, 99, 42, 7, 7, 1, 0, 123, 64, 31, 400, 2, 8, 8, 9]
    inp = ModelInput(ids, list(range(len(ids))), [len(ids)], [len(ids)], [[0, 1]],
                     list(range(len(ids))), list(range(len(ids))))
    logits = {}
    for quantization in (None, "int8"):
        runner = ModelRunner(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", num_kv_blocks=4,
                                          quantization=quantization))
        logits[quantization] = runner.execute_model(inp)
        if quantization:
            assert runner.model.model.layers[0].mlp.down_proj.qweight.dtype == torch.int8
        runner.shutdown()
    full, int8 = logits[None], logits["int8"]
    assert (int8 - full).abs().max() < 0.05 * full.abs().max()
    top2 = full.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert clear.sum() >= 3
    assert torch.equal(int8.argmax(-1)[clear], full.argmax(-1)[clear])
