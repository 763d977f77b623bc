"""The Triton kernels against a naive torch reference written here.

Without a GPU the kernels run under Triton's interpreter: TRITON_INTERPRET must be set
before the kernels module is first imported (triton reads it when ``@triton.jit`` runs).
On a GPU the same tests run the compiled kernels.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (the dev and gpu extras bring it)")

from kvserve.kernels import (  # noqa: E402
    DecodeWorkspace,
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_work,
    store_kv_cache,
)
from kvserve.kernels.triton.paged_attention import MAX_SPLITS, _paged_decode_kernel  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.bfloat16]
# (num_heads, kv_heads, head_dim, block_size): the default model's 9/3 x 64, and a 2-way group
SHAPES = [(9, 3, 64, 16), (4, 2, 16, 4)]


def test_kernels_run_in_interpreter_mode_on_cpu():
    if DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert type(_paged_decode_kernel).__name__ == "InterpretedFunction", (
            "kvserve.kernels was imported before TRITON_INTERPRET=1 was set; "
            "set it in tests/conftest.py so every test module sees it"
        )


# ---------------------------------------------------------------- reference and inputs


def reference_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    """Float32 attention of each sequence's query rows over its keys gathered from the cache."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(len(seq_lens)):
        start, end, length = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seq_lens[i])
        if length == 0:
            continue
        pos = torch.arange(length, device=q.device)
        blocks = block_tables[i, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(length - (end - start), length, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def paged_inputs(seq_lens, kv_heads, head_dim, block_size, dtype, seed=0):
    """Random caches and block tables whose block ids are shuffled and padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 1
    block_tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used : used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (k_cache, v_cache, block_tables, seq_lens_t)]


def assert_close(actual, expected, dtype):
    err = (actual.float() - expected).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err} > {TOL[dtype]} for {dtype}"


# ---------------------------------------------------------------- store_kv_cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_cache_writes_each_token_at_its_slot_and_skips_minus_one(dtype):
    kv_heads, head_dim, block_size, num_blocks = 3, 64, 4, 5  # 3 x 64 = 192: not a power of two
    gen = torch.Generator().manual_seed(1)
    # k and v as views of a fused projection, as the model produces them: token stride 9*64
    qkv = torch.randn(6, 9, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, 3:6], qkv[:, 6:9]
    slots = torch.tensor([0, 7, -1, 13, 19, -1], device=DEVICE)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, -7.0)

    store_kv_cache(k, v, k_cache, v_cache, slots)

    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    written = slots >= 0
    assert torch.equal(flat_k[slots[written]], k[written])
    assert torch.equal(flat_v[slots[written]], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[written]] = False
    assert bool((flat_k[untouched] == 7.0).all()) and bool((flat_v[untouched] == -7.0).all())


def test_store_kv_cache_rejects_a_cache_of_the_wrong_layout():
    k = torch.zeros(2, 3, 64, device=DEVICE)
    wrong = torch.zeros(4, 16, 64, 3, device=DEVICE)
    with pytest.raises(ValueError, match="caches must be"):
        store_kv_cache(k, k, wrong, wrong, torch.zeros(2, dtype=torch.long, device=DEVICE))


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_decode_attention_matches_reference(shape, dtype):
    num_heads, kv_heads, head_dim, block_size = shape
    seq_lens = [1, 3 * block_size, 2 * block_size + 3]  # one key, whole blocks, a partial last block
    k_cache, v_cache, block_tables, seq_lens_t = paged_inputs(seq_lens, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(2))
    q = q.to(dtype).to(DEVICE)
    scale = head_dim**-0.5

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, scale)

    cu = torch.arange(len(seq_lens) + 1)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, reference_attention(q, k_cache, v_cache, cu, seq_lens_t, block_tables, scale), dtype)


def test_paged_decode_attention_gives_zeros_for_a_padded_row_with_no_keys():
    k_cache, v_cache, block_tables, seq_lens_t = paged_inputs([5, 0], 2, 16, 4, torch.float32)
    block_tables[1] = 0  # a padded CUDA-graph row: block table zeros, seq_len 0
    q = torch.randn(2, 4, 16, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.25)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("block_size", [32, 24])
def test_split_decode_matches_reference_with_splits_ending_mid_block(block_size, num_splits):
    """Splits cut the context at multiples of the kernel's key tile (16 here), which fall inside
    32- and 24-token cache blocks; short contexts leave trailing splits empty; a padded row
    (seq_len 0) has no keys in any split."""
    num_heads, kv_heads, head_dim = 4, 2, 16
    seq_lens = [1, 37, 70, 0, 16]
    k_cache, v_cache, block_tables, seq_lens_t = paged_inputs(seq_lens, kv_heads, head_dim, block_size,
                                                              torch.float32)  # fmt: skip
    block_tables[3] = 0
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(7)).to(DEVICE)

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.25, num_splits=num_splits)

    cu = torch.arange(len(seq_lens) + 1)
    expected = reference_attention(q, k_cache, v_cache, cu, seq_lens_t, block_tables, 0.25)
    assert_close(out, expected, torch.float32)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_split_decode_in_bfloat16_through_a_shared_workspace_matches_unsplit():
    num_heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    seq_lens = [50, 3]
    k_cache, v_cache, block_tables, seq_lens_t = paged_inputs(seq_lens, kv_heads, head_dim, block_size,
                                                              torch.bfloat16)  # fmt: skip
    q = torch.randn(2, num_heads, head_dim, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    q = q.to(DEVICE)
    workspace = DecodeWorkspace.allocate(8, num_heads, head_dim, q.device)
    whole = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.125)
    split = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.125, num_splits=4,
                                   workspace=workspace)  # fmt: skip
    assert_close(split, whole.float(), torch.bfloat16)
    with pytest.raises(ValueError, match="workspace holds 8 rows"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.125, num_splits=5,
                               workspace=workspace)  # fmt: skip


def test_decode_splits_only_when_the_batch_leaves_most_sms_idle():
    assert decode_num_splits(1, 8, 132) == MAX_SPLITS  # 8 programs on 132 SMs
    assert decode_num_splits(8, 8, 132) == 5  # 64 programs: about two per SM with 5 splits
    assert decode_num_splits(17, 8, 132) == 1  # 136 programs fill the GPU
    assert decode_num_splits(4, 2, 1) == 1  # the CPU: never
    workspace = DecodeWorkspace.for_every_batch(16, 8, 128, 132, torch.device("cpu"))
    split_rows = [b * n for b in range(1, 600) if (n := decode_num_splits(b, 8, 132)) > 1]
    assert workspace.rows() == max(split_rows) == 16 * 3
    assert workspace.out.shape[1:] == (16, 128)


# ---------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_prefill_attention_matches_reference_for_fresh_cached_and_chunked_prompts(shape, dtype):
    num_heads, kv_heads, head_dim, block_size = shape
    # (context after this step, new tokens): a fresh prompt; a prefix hit of two whole blocks
    # then 5 new tokens; a chunk continuation starting mid-block; a single new token
    cases = [(11, 11), (2 * block_size + 5, 5), (3 * block_size + 2, block_size + 3), (6, 1)]
    seq_lens = [c for c, _ in cases]
    q_lens = [n for _, n in cases]
    k_cache, v_cache, block_tables, seq_lens_t = paged_inputs(seq_lens, kv_heads, head_dim, block_size, dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    q = q.to(dtype).to(DEVICE)
    scale = head_dim**-0.5

    out = paged_prefill_attention(q, k_cache, v_cache, cu, seq_lens_t, block_tables, scale)

    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, reference_attention(q, k_cache, v_cache, cu, seq_lens_t, block_tables, scale), dtype)


def test_prefill_work_lists_only_real_tiles_longest_first():
    # three decode rows around a 40-token chunk that continues a 10-token context; 16-token tiles
    work = prefill_work([1, 40, 1, 1], [5, 50, 9, 2], 16, torch.device("cpu"))
    assert work.dtype == torch.int32
    assert work.tolist() == [[1, 2], [1, 1], [1, 0], [2, 0], [0, 0], [3, 0]]
    assert prefill_work([], [], 16, torch.device("cpu")).shape == (0, 2)


def test_prefill_of_one_long_chunk_among_decodes_matches_reference():
    num_heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    cases = [(6, 1), (45, 37), (3, 1), (9, 1)]  # (context, new tokens)
    seq_lens = [c for c, _ in cases]
    q_lens = [n for _, n in cases]
    k_cache, v_cache, block_tables, seq_lens_t = paged_inputs(seq_lens, kv_heads, head_dim, block_size,
                                                              torch.float32)  # fmt: skip
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(DEVICE)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    work = prefill_work(q_lens, seq_lens, 8, q.device)  # 8 tokens per tile: 4 x 2 heads = 16 rows

    out = paged_prefill_attention(q, k_cache, v_cache, cu, seq_lens_t, block_tables, 0.25, work=work)

    assert work.shape[0] == 3 + 5  # a tile per decode row and five for the chunk, nothing empty
    expected = reference_attention(q, k_cache, v_cache, cu, seq_lens_t, block_tables, 0.25)
    assert_close(out, expected, torch.float32)


def test_store_then_prefill_equals_causal_attention_on_the_whole_prompt_in_two_chunks():
    """The engine's order of work: store the chunk's K/V, then attend over the cache. Two
    chunks must give what one causal pass over the dense prompt gives."""
    num_heads, kv_heads, head_dim, block_size, length, split = 4, 2, 16, 4, 13, 6
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(length, h, head_dim, generator=gen) for h in (num_heads, kv_heads, kv_heads))
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    k_cache = torch.zeros(6, block_size, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.tensor([[5, 2, 0, 3]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(length, device=DEVICE)
    slots = block_tables[0, pos // block_size].long() * block_size + pos % block_size

    chunks = []
    for lo, hi in ((0, split), (split, length)):
        store_kv_cache(k[lo:hi], v[lo:hi], k_cache, v_cache, slots[lo:hi])
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
        chunks.append(paged_prefill_attention(q[lo:hi], k_cache, v_cache, cu, seq_lens, block_tables, 0.25))

    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.25, enable_gqa=True
    ).transpose(0, 1)
    assert_close(torch.cat(chunks), dense, torch.float32)


def test_paged_attention_rejects_heads_that_are_not_a_multiple_of_kv_heads():
    k_cache, v_cache, block_tables, seq_lens_t = paged_inputs([4], 2, 16, 4, torch.float32)
    q = torch.zeros(1, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.25)

