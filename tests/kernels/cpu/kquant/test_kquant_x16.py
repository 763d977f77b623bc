"""Q4_K and Q6_K repacked at load (``KQuantKernels.repack``, ``REPACKED``; csrc/kquant_gemm.c): the int8
GEMM's panels kept as the weight, read as stored at any row count. Against the blocks as the
file stores them, multiplied by the block dots (few rows) and the GEMM (many): the same bits, in
float32 and bfloat16, with a bias, at widths of 1, 9 and 32 superblocks, row counts through every
tile height and past a block of rows, a shard of columns; dequantized rows equal to the stored
blocks' dequantized rows. Random valid blocks (any bytes with finite float16 scales). AVX512-VNNI
builds only (``make test-isa`` runs it under the Ice Lake class; the AVX2 class has no repacked
form and keeps the blocks)."""

from __future__ import annotations

import pytest
import torch

from kvserve.benchmarks.scale.kernels import random_weight
from kvserve.kernels.cpu.kquant import BLOCK_TYPES, REPACKED, X16_LANES, X16_SUPER, kquant_kernels

Q4_K, Q5_K, Q6_K = 12, 13, 14
NAMES = {Q4_K: "Q4_K", Q6_K: "Q6_K"}
KQ = kquant_kernels()
pytestmark = pytest.mark.skipif(KQ is None or KQ.isa != 512,
                                reason="Q4_K and Q6_K are repacked on AVX512-VNNI builds only")


def product(weight, ggml_type, k, act, rows, n_out, dtype, bias=None, gemm=False):
    out = torch.empty(rows, n_out, dtype=dtype)
    (KQ.gemm if gemm else KQ.matmul)(weight, ggml_type, k, act, out, bias)
    return out


@pytest.mark.parametrize("stored", sorted(REPACKED), ids=NAMES.get)
@pytest.mark.parametrize(("n_out", "k"), [(16, 256), (48, 2304), (32, 8192)])
def test_repacked_rows_are_the_stored_blocks_bits(stored, n_out, k):
    """Rows 1..71 (tiles of 8, 4, 2 and 1; blocks of 32 rows a superblock, the last one short) and
    one row at a time, activations of mixed magnitudes."""
    weight = random_weight(stored, n_out, k, seed=k + n_out + stored)
    packed, x16 = KQ.repack(weight, stored, k), REPACKED[stored]
    assert packed.shape == (n_out // X16_LANES, k // 256 * X16_SUPER[x16])
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(71, k, generator=gen) * torch.logspace(-3, 3, 71).unsqueeze(1)
    for dtype in (torch.float32, torch.bfloat16):
        bias = torch.randn(n_out, generator=gen).to(dtype) if dtype == torch.bfloat16 else None
        for rows in (1, 2, 3, 5, 8, 15, 16, 19, 32, 33, 71):
            act = KQ.quantize(x[:rows].to(dtype))
            want = product(weight, stored, k, act, rows, n_out, dtype, bias)  # the dots (the GEMM from 16)
            assert torch.equal(product(packed, x16, k, act, rows, n_out, dtype, bias), want), (dtype, rows)
            assert torch.equal(product(packed, x16, k, act, rows, n_out, dtype, bias, gemm=True), want)
            assert torch.equal(product(weight, stored, k, act, rows, n_out, dtype, bias, gemm=True), want)


@pytest.mark.parametrize("stored", sorted(REPACKED), ids=NAMES.get)
def test_a_repacked_shard_of_columns_written_into_a_wider_output(stored):
    """A row-parallel shard (whole superblocks of each row, rows further apart than their bytes),
    repacked, then multiplied into a column range of a wider output: the stored shard's bits."""
    weight = random_weight(stored, 32, 1024, seed=1)
    per_block = BLOCK_TYPES[stored][1]
    shard = weight[:, per_block : 3 * per_block]  # inputs 256..767
    packed = KQ.repack(shard, stored, 512)
    act = KQ.quantize(torch.randn(11, 512, generator=torch.Generator().manual_seed(2)))
    got, want = torch.zeros(11, 40), torch.zeros(11, 40)
    KQ.matmul(packed, REPACKED[stored], 512, act, got[:, 5:37])
    KQ.matmul(shard, stored, 512, act, want[:, 5:37])
    assert torch.equal(got, want) and got[:, 5:37].abs().sum() > 0


@pytest.mark.parametrize("stored", sorted(REPACKED), ids=NAMES.get)
def test_dequantized_rows_are_the_stored_blocks_values(stored):
    weight = random_weight(stored, 48, 768, seed=4)
    packed, x16 = KQ.repack(weight, stored, 768), REPACKED[stored]
    ids = torch.tensor([0, 47, 16, 5, 31, 17])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(KQ.dequantize(packed, x16, 768, dtype), KQ.dequantize(weight, stored, 768, dtype))
        assert torch.equal(KQ.dequantize(packed, x16, 768, dtype, ids),
                           KQ.dequantize(weight, stored, 768, dtype, ids))


def test_only_q4_k_and_q6_k_in_whole_panels_are_repacked():
    """Other types, and row counts that are not whole panels of 16, keep their blocks (None)."""
    assert sorted(REPACKED) == [Q4_K, Q6_K]
    for other in (Q5_K, 2, 8):  # Q5_K, Q4_0, Q8_0
        assert KQ.repack(random_weight(other, 32, 256, seed=5), other, 256) is None
    for stored in REPACKED:
        assert KQ.repack(random_weight(stored, 24, 256, seed=6), stored, 256) is None
    for x16 in REPACKED.values():
        assert KQ.gemm_takes(x16) and KQ.gemm_alike(x16) and not KQ.dots_over_panels(x16)
