"""The int8 KV cache (``kv_cache_dtype="int8"``, engine/layers/attention/kv_quant.py): rows quantized
within half a step of their scale; the C kernels store the bytes the torch ops store and attend
over the dequantized cache; an engine with it holds about twice the tokens in the same memory,
keeps its greedy tokens under chunking and prefix hits (nearly, under preemption and batching),
and stays close to the model-dtype cache's tokens. Other backends and devices refuse it by name."""

from __future__ import annotations

import pytest
import torch

from kvserve.benchmarks.single_stream import PARITY_PROMPTS, agreement
from kvserve.clients import Client
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.layers.attention.backend import create_attention_backend
from kvserve.engine.layers.attention.kv_quant import SCALE_BYTES, dequantize_rows, quantize_rows
from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.testing.engine import with_control_plane
from kvserve.testing.plugin import TEST_SERVER_ENV
from kvserve.testing.process import ServerProcess

KERNEL = load_kernels()
needs_kernels = pytest.mark.skipif(KERNEL is None, reason="no C compiler here: the torch-ops path serves")
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def scales_of(rows: torch.Tensor) -> torch.Tensor:
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def test_rows_come_back_within_half_a_step_of_their_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen) * 5
    x[2, 1] = 0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, 64 + SCALE_BYTES)
    scale = scales_of(rows)
    assert torch.allclose(scale[..., 0], x.abs().amax(-1) / 127)
    assert ((dequantize_rows(rows, torch.float32) - x).abs() <= scale / 2 + 1e-6).all()
    assert torch.equal(rows[2, 1], torch.zeros(64 + SCALE_BYTES, dtype=torch.int8))  # a zero row: zeros
    largest = rows[..., :64].abs().amax(-1)
    assert (largest[x.abs().amax(-1) > 0] == 127).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_stores_the_bytes_the_torch_ops_store(dtype):
    kv_heads, d, blocks, block_size = 3, 64, 4, 8
    gen = torch.Generator().manual_seed(1)
    k, v = ((torch.randn(5, kv_heads, d, generator=gen) * 3).to(dtype) for _ in range(2))
    caches = [torch.zeros(kv_heads, blocks, block_size, d + SCALE_BYTES, dtype=torch.int8) for _ in range(2)]
    slots = torch.tensor([0, 9, -1, 31, 17])
    given = k.clone(), v.clone()
    KERNEL.store_kv_checked(k, v, *caches, slots)
    for cache, x, x0 in zip(caches, (k, v), given, strict=True):
        flat = cache.view(kv_heads, -1, d + SCALE_BYTES)
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(flat[:, slot], quantize_rows(x0[t]))
                # and the step's own K/V now hold what the cache holds (its fresh-prefill attention)
                assert torch.equal(x[t], dequantize_rows(flat[:, slot], dtype))
        assert torch.equal(x[2], x0[2])
        assert int((flat != 0).any(-1).sum()) == 4 * kv_heads  # slot -1 went nowhere
    with pytest.raises(ValueError, match="rows of 68, got 64"):
        KERNEL.store_kv_checked(k, v, *(c[..., :d].contiguous() for c in caches), slots)
    wide = torch.zeros(1, 1, 1, 600, dtype=torch.float32)  # int8 rows wider than the kernel's buffer
    with pytest.raises(RuntimeError, match="wider than MAX_HEAD_DIM"):
        KERNEL.store_kv(wide[0], wide[0], *(torch.zeros(1, 1, 1, 604, dtype=torch.int8) for _ in range(2)),
                        torch.tensor([0]))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (9, 3, 64), (16, 2, 128),  # the AVX-512 path
    (8, 2, 96), (6, 1, 32),  # the portable path
])
def test_the_kernel_attends_over_the_dequantized_cache(dtype, heads, kv_heads, head_dim):
    """Contexts of 1 token, a partial block, exactly two blocks and many, blocks out of order:
    the kernel's output is float64 attention over the cache as ``dequantize_rows`` reads it."""
    block_size, num_blocks = 16, 48
    gen = torch.Generator().manual_seed(heads + head_dim)
    k_cache, v_cache = (quantize_rows(torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen))
                        for _ in range(2))
    lens = torch.tensor([1, 11, 32, 250], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:16] for _ in lens]).to(torch.int32)
    q = torch.randn(4, heads, head_dim, generator=gen).to(dtype)
    ids = torch.arange(4, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    KERNEL.paged_decode_checked(q, k_cache, v_cache, tables, lens, ids, ids, out, scale)
    keys, values = (dequantize_rows(c, torch.float64) for c in (k_cache, v_cache))
    group = heads // kv_heads
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, : -(-n // block_size)].long()
        kk, vv = (c[:, blocks].reshape(kv_heads, -1, head_dim)[:, :n].repeat_interleave(group, 0)
                  for c in (keys, values))
        probs = torch.einsum("hd,hnd->hn", q[i].double() * scale, kk).softmax(-1)
        want = torch.einsum("hn,hnd->hd", probs, vv)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
        assert (out[i].double() - want).abs().max().item() < tol


def test_other_backends_and_devices_refuse_it_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not read by the triton attention backend"):
        create_attention_backend("triton", torch.device("cpu"), 16, torch.float32, "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is a CPU cache"):
        create_attention_backend("auto", torch.device("cuda"), 16, torch.bfloat16, "int8")


def test_the_same_memory_holds_about_twice_the_tokens():
    """head_dim 64: a row (one token of one KV head) is 68 bytes instead of bfloat16's 128."""
    budget = int(0.05 * 2**30)
    blocks = {}
    for kv, row_bytes in (("auto", 128), ("int8", 64 + SCALE_BYTES)):
        llm = LLM("default", dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory=0.05)
        cfg = llm.engine.executor.hf_config
        assert cfg.hidden_size // cfg.num_attention_heads == 64
        token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * row_bytes  # K and V, every layer
        block_bytes = llm.engine.config.block_size * token_bytes
        blocks[kv] = llm.engine.block_manager.num_blocks
        assert blocks[kv] == budget // block_bytes
        cache = llm.engine.executor.model.model.layers[0].self_attn.attn.k_cache
        assert cache.dtype == (torch.int8 if kv == "int8" else torch.bfloat16)
        llm.shutdown()
    assert blocks["int8"] / blocks["auto"] == pytest.approx(128 / 68, rel=0.01)


@pytest.fixture(scope="module")
def int8_llm():
    llm = LLM("default", dtype="float32", kv_cache_dtype="int8", max_num_seqs=8, max_num_batched_tokens=1024)
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_tokens_do_not_depend_on_chunking_or_prefix_hits(int8_llm):
    """Each token's rows are quantized on their own, and a fresh prompt attends over its K/V as
    the cache holds them: a prompt prefilled in chunks, or partly from the prefix cache, gets the
    same greedy tokens as in one piece."""
    llm, eng = int8_llm, int8_llm.engine
    saved = (eng.config, eng.block_manager, eng.scheduler)
    ids = [llm.tokenizer.encode(p) for p in (PARITY_PROMPTS[3], PARITY_PROMPTS[2], "Once upon a time")]
    try:
        with_control_plane(llm, enable_prefix_caching=False)
        whole = alone(llm, ids)
        with_control_plane(llm, enable_prefix_caching=False, max_num_batched_tokens=24)
        assert alone(llm, ids) == whole  # chunked prefills
        with_control_plane(llm, enable_prefix_caching=True)
        assert alone(llm, ids) == whole
        warm = llm.generate(ids[:2], PARAMS, use_tqdm=False)  # the same prompts again: prefix hits
        assert [o.cached_tokens for o in warm] == [len(i) // 16 * 16 for i in ids[:2]]  # every full block
        assert [o.token_ids for o in warm] == whole[:2]
    finally:
        eng.config, eng.block_manager, eng.scheduler = saved


def test_preempted_and_batched_requests_keep_their_tokens_but_near_ties(int8_llm):
    """Recomputed after preemption, in batches of changing size: the same K/V up to the float
    summation order of other batch shapes, which an int8 rounding step can magnify into a flipped
    near tie; the greedy tokens agree with each request's alone almost everywhere (lost or
    misplaced rows would leave little agreement)."""
    llm, eng = int8_llm, int8_llm.engine
    saved = (eng.config, eng.block_manager, eng.scheduler)
    ids = [llm.tokenizer.encode(p) for p in (PARITY_PROMPTS[2], "Once upon a time", "The weather today")]
    try:
        with_control_plane(llm, enable_prefix_caching=False)
        each = alone(llm, ids)
        with_control_plane(llm, num_kv_blocks=9)  # 144 slots for 58 + 44 + 43 tokens: someone yields
        squeezed = [o.token_ids for o in llm.generate(ids, PARAMS, use_tqdm=False)]
        assert llm.stats().num_preemptions > 0
        assert agreement(each, squeezed) >= 0.9
    finally:
        eng.config, eng.block_manager, eng.scheduler = saved


def alone(llm: LLM, ids: list[list[int]]) -> list[list[int]]:
    return [llm.generate([i], PARAMS, use_tqdm=False)[0].token_ids for i in ids]


def test_greedy_tokens_stay_close_to_the_float_caches(int8_llm):
    """float32 weights: the same tokens as a float32 cache for most of the parity prompts' first
    32 tokens (90% of 64 tokens when measured; a broken scale or row layout gives ~0)."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    int8 = [o.token_ids for o in int8_llm.generate(PARITY_PROMPTS, params, use_tqdm=False)]
    reference = LLM("default", dtype="float32", max_num_seqs=8, max_num_batched_tokens=1024)
    try:
        floats = [o.token_ids for o in reference.generate(PARITY_PROMPTS, params, use_tqdm=False)]
    finally:
        reference.shutdown()
    assert agreement(floats, int8) >= 0.75


def test_a_server_with_an_int8_cache_gives_the_engines_tokens(int8_llm):
    """``kvserve serve --kv-cache-dtype int8``: the engine-core process gets the setting (its KV
    block count is the int8 one; Stats and ModelInfo say int8) and one request's greedy tokens are
    the in-process engine's."""
    prompt = "The three primary colors are"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = int8_llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    memory = int8_llm.engine.config.kv_cache_memory
    with ServerProcess("--dtype", "float32", "--kv-cache-dtype", "int8", "--kv-cache-memory", str(memory),
                       env=TEST_SERVER_ENV) as srv, Client(srv.target, timeout=120) as client:
        got = client.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True)
        stats, info = client.stats(), client.model_info()
    assert (stats["kv_cache_dtype"], info["kv_cache_dtype"]) == ("int8", "int8")
    assert got.token_ids == want
    assert stats["kv_blocks_total"] == int8_llm.engine.block_manager.num_blocks
