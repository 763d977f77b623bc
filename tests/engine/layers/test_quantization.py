"""Quantized weights (int8, int4): the quantizers, every kernel path against the dequantized
weight (with the activations as the kernels round them), and whole models through the runner."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.clients import Client
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.layers.quantization import INT4_GROUP, QUANTIZERS, quantize_int4, quantize_int8
from kvserve.engine.model_input import ModelInput
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS
from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.testing.plugin import TEST_SERVER_ENV
from kvserve.testing.process import ServerProcess

KERNELS = load_kernels()
# int4 superblocks (16 groups of 32 inputs): whole ones, then a last one of 2 groups (8 lanes a
# group, one step), 4 (4 lanes), 8 (2 lanes) or 6 (1 lane, 8 steps)
INT4_WIDTHS = [576, 640, 768, 704]


def activation_block(k_in: int) -> int:
    """The block the few-row kernels quantize activations of width k_in by (0: floats)."""
    return KERNELS.quantized_activation_block(k_in) if KERNELS is not None else 0


def as_the_kernel_rounds(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [rows, K] as floats after the kernels' quantization per ``block`` values (none for 0):
    sign * round(|x| * (127 / max|x|)) * (max|x| / 127), halves to even, every step in float32
    (``full_like(..) / amax``: torch computes ``127.0 / amax`` as a reciprocal times 127, which
    rounds differently)."""
    x = x.float()
    if not block:
        return x
    b = x.view(x.shape[0], -1, block)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (b.sign() * torch.round(b.abs() * inv) * (amax / torch.full_like(amax, 127.0))).view_as(x)


def test_int8_rows_are_quantized_within_half_a_step_of_their_scale():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 1, 64)[:, None]
    quantized = quantize_int8(w)
    q, scales = quantized.data, quantized.scales
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scales.shape == (64,)
    assert ((quantized.dequantize_torch(torch.float32) - w).abs() <= scales[:, None] / 2 + 1e-7).all()


def test_int4_groups_are_quantized_within_half_a_step_and_come_back_as_stored():
    """Per 32 inputs of a row: within half a step of the group's (float16) scale, the group's
    extremes at 0 and 15; weights that are already int4 values (a Q4_1 file's, dequantized)
    quantize to the same bytes and pairs."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 256, generator=gen) * torch.linspace(0.01, 2, 40)[:, None]
    w[3, :INT4_GROUP] = 0.25  # a constant group: scale 0
    quantized = quantize_int4(w)
    assert quantized.data.dtype == torch.uint8 and quantized.data.shape == (40, 128)
    assert quantized.scales.dtype == torch.float16 and quantized.scales.shape == (40, 2, 256 // INT4_GROUP)
    back = quantized.dequantize_torch(torch.float32)
    step = quantized.scales[:, 0].float().repeat_interleave(INT4_GROUP, dim=1)
    assert ((back - w).abs() <= step / 2 + 2e-3 * w.abs().amax(dim=1, keepdim=True)).all()  # + float16 pairs
    assert torch.equal(back[3, :INT4_GROUP], torch.full((INT4_GROUP,), 0.25))
    again = quantize_int4(back)
    assert torch.equal(again.data, quantized.data) and torch.equal(again.scales, quantized.scales)


@pytest.mark.skipif(KERNELS is None, reason="the CPU kernels did not build")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", INT4_WIDTHS)
def test_kernel_dequantizes_as_torch_does(method, dtype, width):
    """The prefill path's weights: the kernel's dequantization is the format's (torch's), for
    every superblock shape of int4, within one rounding."""
    w = torch.randn(37, width, generator=torch.Generator().manual_seed(2)).to(dtype)
    quantized = QUANTIZERS[method](w)
    got = KERNELS.dequantize(quantized.kernel_linear(None, dtype), dtype)  # the kernel's, not a fallback
    want = quantized.dequantize_torch(dtype)
    assert got is not None and got.dtype == dtype and got.shape == want.shape
    ulp = 1e-6 if dtype == torch.float32 else 8e-3
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-30).all()
    assert torch.equal(quantized.dequantize(dtype), got)  # what the GEMM path multiplies


def test_int4_refuses_widths_the_packing_does_not_take():
    with pytest.raises(ValueError, match="int4.*multiples of 64.*\\[8, 96\\]"):
        quantize_int4(torch.randn(8, 96))


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, MAX_FUSED_ROWS, MAX_FUSED_ROWS + 1, 100])
def test_linear_is_the_product_with_the_dequantized_weight(method, dtype, rows):
    """Up to MAX_FUSED_ROWS rows the kernels (activations rounded as they round them where they
    quantize them); more rows the GEMM on the dequantized weight."""
    gen = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(80, 192, generator=gen).to(dtype), torch.randn(80, generator=gen).to(dtype)
    x = torch.randn(rows, 192, generator=gen).to(dtype)  # int4: one superblock of 6 groups
    quantized = QUANTIZERS[method](w)
    block = activation_block(192) if rows <= MAX_FUSED_ROWS else 0
    weight = quantized.dequantize_torch(torch.float32)
    expected = F.linear(as_the_kernel_rounds(x, block), weight, bias.float())
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (0.1, 2e-2)  # bfloat16: outputs up to ~30
    torch.testing.assert_close(quantized.linear(x, bias).float(), expected, atol=atol, rtol=rtol)


@pytest.mark.skipif(not activation_block(64), reason="quantized activations: kernels on AVX512-VNNI CPUs")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("width", INT4_WIDTHS)
def test_kernels_quantize_activations_per_block_of_32(method, dtype, rows, width):
    """On AVX512-VNNI CPUs the few-row kernels quantize x per 32 values and sum in integers: the
    result is the product of the dequantized weight with x as rounded so, to float precision
    (blocks of very different magnitudes, an all-zero block, a block of negative values, a tie
    that float32 rounding decides; every int4 superblock shape); not x's exact product."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, width, generator=gen)
    x[0, :32] *= 300
    x[0, 64:96] = 0
    x[0, 96:128] = -x[0, 96:128].abs() / 50
    x[-1, 128:160] = torch.linspace(-1, 1, 32)
    x[-1, 128], x[-1, 133] = 2.96875, 1.484375  # 1.484375 * (127 / 2.96875) = 63.4999962 in float32
    x = x.to(dtype)
    w = torch.randn(203, width, generator=gen)
    bias = torch.randn(203, generator=gen).to(dtype)
    quantized = QUANTIZERS[method](w.to(dtype))
    weight = quantized.dequantize_torch(torch.float64)
    block = activation_block(width)
    assert block == 32 and activation_block(999) == 0  # widths not a multiple of 64 stay floats
    rounded = as_the_kernel_rounds(x, block).double()
    want = F.linear(rounded, weight, bias.double())
    got = quantized.linear(x, bias).double()
    # float32 sums: relative to the sum of the terms' magnitudes; bfloat16: its output rounding
    magnitude = F.linear(rounded.abs(), weight.abs(), bias.double().abs()) + 1
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert ((got - want).abs() / magnitude).max().item() < tol
    if dtype == torch.float32:  # (bfloat16's rounding is as large as the activations')
        exact = F.linear(x.double(), weight, bias.double())
        assert ((got - exact).abs() / magnitude).max().item() > 10 * tol


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_no_rows_give_no_rows(method):
    """A step of prefill chunks only asks the LM head for the logits of 0 rows."""
    quantized = QUANTIZERS[method](torch.randn(40, 128).to(torch.bfloat16))
    assert quantized.linear(torch.empty(0, 128, dtype=torch.bfloat16)).shape == (0, 40)


def test_unknown_quantization_is_refused_with_the_field_name():
    with pytest.raises(ValueError, match="quantization must be one of \\['int8', 'int4'\\], got 'int3'"):
        EngineConfig(quantization="int3")


def _logits(model: str, quantization: str | None, ids: list[int]) -> tuple[torch.Tensor, ModelRunner]:
    every = list(range(len(ids)))
    inp = ModelInput(input_ids=ids, positions=every, query_lens=[len(ids)], context_lens=[len(ids)],
                     block_tables=[[0, 1]], slot_mapping=list(every), logits_indices=list(every))
    config = EngineConfig(model=model, dtype="float32", num_kv_blocks=4, quantization=quantization)
    runner = ModelRunner(config)
    return runner.execute_model(inp), runner


def _keeps_clear_choices(full: torch.Tensor, quantized: torch.Tensor, margin: float) -> None:
    top2 = full.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > margin
    assert clear.sum() >= 3
    assert torch.equal(quantized.argmax(-1)[clear], full.argmax(-1)[clear])


def test_int8_runner_keeps_the_float_models_clear_greedy_choices(tiny_qwen2_dir, caplog):
    ids = [5, 17, 250, 3, 99, 42, 7, 7, 1, 0, 123, 64, 31, 400, 2, 8, 8, 9]
    full, runner = _logits(str(tiny_qwen2_dir), None, ids)
    runner.shutdown()
    with caplog.at_level("WARNING", logger="kvserve.engine"):
        int8, runner = _logits(str(tiny_qwen2_dir), "int8", ids)
    # a CPU without the in-place kernels (AVX2 only) dequantizes every step: the user is told
    warned = "int8 weights: this CPU lacks the kernels" in caplog.text
    assert warned == (KERNELS is None or not KERNELS.gemm_quantized)
    assert runner.model.model.layers[0].mlp.down_proj.quantized.data.dtype == torch.int8
    runner.shutdown()
    assert (int8 - full).abs().max() < 0.05 * full.abs().max()
    _keeps_clear_choices(full, int8, 0.1)


def test_int4_runner_keeps_the_bundled_models_clear_greedy_choices():
    """The bundled model's file is Q4_1: int4 holds its weights as stored (up to float16 pairs)."""
    ids = [1, 504, 3575, 282, 4649, 314, 260, 1345, 28, 198, 504, 3575, 282]
    full, runner = _logits("default", None, ids)
    runner.shutdown()
    int4, runner = _logits("default", "int4", ids)
    layer = runner.model.model.layers[0]
    assert layer.mlp.down_proj.quantized.method == "int4" and layer.mlp.down_proj.weight.numel() == 0
    runner.shutdown()
    assert (int4 - full).abs().max() < 0.05 * full.abs().max()
    _keeps_clear_choices(full, int4, 0.5)


@pytest.mark.skipif(not activation_block(576), reason="int4 decode steps in the kernels: AVX512-VNNI CPUs")
def test_a_server_with_int4_weights_gives_the_engines_tokens():
    """``kvserve serve --quantization int4``: the engine-core process quantizes the same way
    (ModelInfo says int4) and one request's greedy tokens are the in-process engine's."""
    prompt = "The three primary colors are"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM("default", dtype="bfloat16", quantization="int4", max_num_seqs=4, num_kv_blocks=64)
    try:
        want = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    finally:
        llm.shutdown()
    with ServerProcess("--dtype", "bfloat16", "--quantization", "int4", "--max-num-seqs", "4",
                       "--num-kv-blocks", "64", env=TEST_SERVER_ENV) as srv, \
            Client(srv.target, timeout=120) as client:
        got = client.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True)
        info = client.model_info()
    assert info["quantization"] == "int4" and info["dtype"] == "bfloat16"
    assert got.token_ids == want
