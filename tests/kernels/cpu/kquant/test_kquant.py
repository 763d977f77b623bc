"""csrc/kquant.c and its AVX2 / AVX512-VNNI dots (``kernels/cpu/kquant.py``): GGUF block weights
multiplied as stored, against the ``gguf`` package's dequantize followed by a float64 matmul.

Any bytes with finite float16 scales are a valid block, so the weights are random bytes with
random scales written in. The kernels quantize each activation row per 256 values to int8 (scale
``d = max|x| / 127``, round to nearest), so each activation is off by at most ``d / 2``: a product
may differ from the exact one by ``sum_i |w_i| d(i) / 2`` (``d(i)`` the scale of x_i's block),
plus float32 rounding of the sums (1e-5 of ``sum |w_i x_i|``). That is the tolerance, per output.
``make test-isa`` runs this file under the AVX2 build too (test_isa_paths.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from kvserve.kernels.cpu.kquant import BLOCK_TYPES, KQ_ACT_BYTES, KQ_BLOCK, PORTABLE, kquant_kernels

KQ = kquant_kernels()
pytestmark = pytest.mark.skipif(KQ is None, reason="the CPU kernels are not built here (no compiler)")
# where each type's float16 scales sit in its block
SCALES = {2: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
NAMES = {2: "Q4_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
TYPES = sorted(BLOCK_TYPES)
PATHS = [0, PORTABLE]  # this build's best dots, and the portable loops


def random_blocks(ggml_type: int, n_out: int, k: int, seed: int, scale: float = 0.02) -> torch.Tensor:
    """uint8 [n_out, row bytes] of random blocks with finite float16 scales of either sign."""
    values, size = BLOCK_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_out * k // values, size), dtype=np.uint8)
    for at in SCALES[ggml_type]:
        halves = (rng.standard_normal(blocks.shape[0]) * scale).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n_out, -1))


def reference(weight: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    values = dequantize(weight.numpy(), ggml_type).astype(np.float32)
    return torch.from_numpy(values).reshape(weight.shape[0], k)


def tolerance(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[rows, n_out]: the activation quantization's bound plus float32 slack (the module docstring)."""
    x = x.double()
    rows, k = x.shape
    pad = -k % KQ_BLOCK
    blocks = torch.nn.functional.pad(x.abs(), (0, pad)).view(rows, -1, KQ_BLOCK)
    half_step = (blocks.amax(dim=-1, keepdim=True) / 127 / 2).expand_as(blocks).reshape(rows, -1)[:, :k]
    return 1.001 * half_step @ w.double().abs().T + 1e-5 * x.abs() @ w.double().abs().T + 1e-6


def product(weight, ggml_type, k, x, path, bias=None, dtype=torch.float32):
    act = KQ.quantize(x)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=dtype)
    KQ.matmul(weight, ggml_type, k, act, out, bias, isa=path)
    return out


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES.get)
@pytest.mark.parametrize("path", PATHS, ids=["built", "portable"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_random_blocks_match_dequantize_then_matmul(ggml_type, path, rows):
    # 608: an odd number of blocks of 32, the last activation block short
    k = 512 if BLOCK_TYPES[ggml_type][0] == KQ_BLOCK else 608
    weight = random_blocks(ggml_type, 37, k, seed=ggml_type * 100 + rows)
    w = reference(weight, ggml_type, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = product(weight, ggml_type, k, x, path)
    want = x.double() @ w.double().T
    assert ((got.double() - want).abs() <= tolerance(w, x)).all(), (got - want).abs().max()


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES.get)
def test_the_built_dots_agree_with_the_portable_ones(ggml_type):
    """Both sum each superblock in integers: they differ only in the order of the float sums
    (a few float32 roundings of the sum of magnitudes)."""
    k = 1024
    weight = random_blocks(ggml_type, 64, k, seed=7)
    w = reference(weight, ggml_type, k).double().abs()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    built, portable = (product(weight, ggml_type, k, x, path).double() for path in PATHS)
    assert ((built - portable).abs() <= 1e-6 * x.double().abs() @ w.T).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES.get)
@pytest.mark.parametrize(("n_out", "k"), [(96, 2048), (32, 8192)], ids=["width2048", "width8192"])
def test_real_shaped_rows_with_bias_and_bfloat16(ggml_type, n_out, k):
    """Llama-3.2-1B's and SmolLM2-1.7B's widths (hidden 2048, intermediate 8192; a slice of the
    output rows: each row's dot is independent of the others), bfloat16 in and out with a bias."""
    weight = random_blocks(ggml_type, n_out, k, seed=k + ggml_type, scale=0.002)
    w = reference(weight, ggml_type, k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(17, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n_out, generator=gen).to(torch.bfloat16)
    for path in PATHS:
        got = product(weight, ggml_type, k, x, path, bias, torch.bfloat16).double()
        want = x.double() @ w.double().T + bias.double()
        assert ((got - want).abs() <= tolerance(w, x) + want.abs() * 2**-8).all()


def test_a_shard_of_columns_is_multiplied_in_place():
    """A row-parallel shard: a range of whole superblocks of each row, rows further apart than
    their bytes, written into a column range of a wider output."""
    k, ggml_type = 1024, 12
    weight = random_blocks(ggml_type, 20, k, seed=1)
    per_block = BLOCK_TYPES[ggml_type][1]
    shard = weight[:, per_block : 3 * per_block]  # inputs 256..767
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    out = torch.zeros(4, 30)
    KQ.matmul(shard, ggml_type, 512, KQ.quantize(x), out[:, 5:25])
    w = reference(weight, ggml_type, k)[:, 256:768]
    want = x.double() @ w.double().T
    assert ((out[:, 5:25].double() - want).abs() <= tolerance(w, x)).all()
    assert not out[:, :5].any() and not out[:, 25:].any()


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES.get)
def test_dequantized_rows_equal_the_gguf_package(ggml_type):
    k = 512
    weight = random_blocks(ggml_type, 11, k, seed=5)
    w = reference(weight, ggml_type, k)
    torch.testing.assert_close(KQ.dequantize(weight, ggml_type, k, torch.float32), w, rtol=2e-7, atol=0)
    ids = torch.tensor([10, 0, 3, 3])
    got = KQ.dequantize(weight, ggml_type, k, torch.bfloat16, ids)
    torch.testing.assert_close(got, w[ids].to(torch.bfloat16))


def test_types_and_widths_it_does_not_take_are_refused():
    x = torch.randn(2, 256)
    out = torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="status 1"):  # Q4_1: dequantized at load instead
        KQ.matmul(torch.zeros(4, 160, dtype=torch.uint8), 3, 256, KQ.quantize(x), out)
    with pytest.raises(RuntimeError, match="status 1"):  # Q4_K rows are whole superblocks
        KQ.matmul(torch.zeros(4, 144, dtype=torch.uint8), 12, 224, KQ.quantize(x[:, :224]), out)
    with pytest.raises(RuntimeError, match="status 1"):
        KQ.quantize(torch.randn(2, 40))


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES.get)
@pytest.mark.parametrize("path", PATHS, ids=["built", "portable"])
def test_each_row_is_computed_alike_whatever_rows_are_beside_it(ggml_type, path):
    """A row alone, or among 9 (4-row groups and a remainder), gets the same bits: a speculative
    verification row's logits are those of a plain decode."""
    k = 1024
    weight = random_blocks(ggml_type, 24, k, seed=11)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    together = product(weight, ggml_type, k, x, path)
    alone = torch.cat([product(weight, ggml_type, k, x[i : i + 1], path) for i in range(9)])
    assert torch.equal(together, alone)


def q8_k_reference(x: np.ndarray) -> list[tuple[np.float32, np.ndarray, np.ndarray]]:
    """Each 256 values of float32 row ``x`` (a short last block zero-padded) as llama.cpp's Q8_K:
    d = max|x| / 127, q = x (127 / max|x|) rounded half away from zero, the sums of each 16."""
    out = []
    for at in range(0, x.size, KQ_BLOCK):
        block = np.zeros(KQ_BLOCK, np.float32)
        block[: min(KQ_BLOCK, x.size - at)] = x[at : at + KQ_BLOCK]
        amax = np.abs(block).max()
        inv = np.float32(127) / amax if amax > 0 else np.float32(0)
        v = block * inv
        q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int32)
        out.append((amax / np.float32(127), q, q.reshape(-1, 16).sum(axis=1)))
    return out


@pytest.mark.parametrize("k", [256, 768, 288])
def test_activations_are_quantized_to_llama_cpps_q8_k_bit_for_bit(k):
    """Whole blocks (vectorized where the build has AVX-512) and a short last block (the loop):
    the same scale, bytes and sums, ties rounded away from zero (max 127: values .5 apart exactly)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, k)) * 3).astype(np.float32)
    x[0, 0] = 127.0
    x[0, 1:KQ_BLOCK - 1] = np.arange(KQ_BLOCK - 2, dtype=np.float32) / 2 - 63  # -63, -62.5, ..., 63.5
    x[0, KQ_BLOCK - 1] = -0.0
    act = KQ.quantize(torch.from_numpy(x)).numpy()
    for r in range(x.shape[0]):
        blocks = act[r].reshape(-1, KQ_ACT_BYTES)
        for b, (d, q, sums) in enumerate(q8_k_reference(x[r])):
            assert blocks[b, :4].view(np.float32)[0] == d
            np.testing.assert_array_equal(blocks[b, 4:260].view(np.int8).astype(np.int32), q)
            np.testing.assert_array_equal(blocks[b, 260:].view(np.int16).astype(np.int32), sums)
