"""The CPU kernels (kernels/cpu/csrc/): decode attention against a float64 reference and inside the
torch backend against the torch-ops path it replaces; the fused elementwise kernels against the
torch ops they replace; the build, cache and fallback rules."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.benchmarks.attention_cpu import step_input
from kvserve.engine.config import MAX_SPECULATIVE_TOKENS
from kvserve.engine.layers.attention import cpu_backend as cpu_attention
from kvserve.engine.layers.attention.kv_quant import quantize_rows
from kvserve.engine.model_input import ModelInput
from kvserve.kernels.cpu import bindings as cpu_kernels
from kvserve.kernels.cpu import build as cpu_build
from kvserve.kernels.cpu.bindings import CpuKernels, load_kernels
from kvserve.kernels.cpu.build import header_constant

KERNEL = load_kernels()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler here: the torch-ops path serves")


def reference(q, k_cache, v_cache, tables, lens, seq_ids, tokens, scale, ctx_lens=None):
    """Float64 attention of each listed query over its sequence's first ``lens`` cached keys (or
    its own ``ctx_lens`` entry's)."""
    kv_heads, _, block_size, d = k_cache.shape
    group = q.shape[1] // kv_heads
    out = {}
    for i, (seq, token) in enumerate(zip(seq_ids.tolist(), tokens.tolist(), strict=True)):
        n = int(lens[seq] if ctx_lens is None else ctx_lens[i])
        blocks = tables[seq, : -(-n // block_size)].long()
        keys = k_cache[:, blocks].reshape(kv_heads, -1, d)[:, :n].double().repeat_interleave(group, 0)
        values = v_cache[:, blocks].reshape(kv_heads, -1, d)[:, :n].double().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", q[token].double() * scale, keys)
        out[token] = torch.einsum("hn,hnd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (9, 3, 64, 16), (4, 4, 128, 16), (16, 2, 128, 16),  # the AVX-512 path: head dims 64/128, groups <= 8
    (9, 3, 64, 8), (9, 3, 64, 32),  # blocks of half and two of its 16-key groups
    (8, 2, 96, 16), (6, 1, 32, 16), (10, 1, 64, 16),  # the portable path: other head dims, a group of 10
])
def test_kernel_matches_a_float64_reference(dtype, heads, kv_heads, head_dim, block_size):
    """Contexts of 1 token, exactly one block, a partial last block and many blocks; blocks in
    random order; rows of q that are not decodes are left as they were."""
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    num_blocks = 64 * 16 // block_size
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    lens = torch.tensor([1, 16, 33, 250, 7], dtype=torch.int32)
    per_seq = num_blocks // 4
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:per_seq] for _ in lens]).to(torch.int32)
    q = torch.randn(7, heads, head_dim, generator=gen).to(dtype)
    seq_ids = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    tokens = torch.tensor([6, 1, 3, 0], dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    KERNEL.paged_decode(q, k_cache, v_cache, tables, lens, seq_ids, tokens, out, head_dim**-0.5)
    expected = reference(q, k_cache, v_cache, tables, lens, seq_ids, tokens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
    for token, want in expected.items():
        assert (out[token].double() - want).abs().max().item() < tol
    assert torch.all(out[[2, 4, 5]] == 7.0)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (9, 3, 64, 16), (16, 2, 128, 16), (8, 1, 64, 8), (5, 5, 64, 32), (10, 1, 64, 16),  # the last: no tiles
])
def test_prefill_runs_as_tiles_match_the_reference(heads, kv_heads, head_dim, block_size):
    """Runs of PREFILL_TILE_MIN_RUN or more consecutive prompt tokens (from position 0, after
    cached context, ending in a partial tile) go through the bfloat16 tiles; a run as long as the
    longest speculative verification stays one query per item, bit for bit what those tokens give
    as single decodes."""
    assert header_constant("PREFILL_TILE_MIN_RUN") > MAX_SPECULATIVE_TOKENS + 1
    gen = torch.Generator().manual_seed(heads + head_dim + block_size)
    num_blocks = 2048 // block_size
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
                        .to(torch.bfloat16) for _ in range(2))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[: num_blocks // 3] for _ in range(3)])
    verify = MAX_SPECULATIVE_TOKENS + 1
    runs = [(0, 40, 1), (1, 45, 1), (2, 33, 101), (2, verify, 300)]  # (sequence, tokens, first's context)
    seq_ids = torch.tensor([s for s, n, _ in runs for _ in range(n)], dtype=torch.int32)
    ctx = torch.tensor([c + m for _, n, c in runs for m in range(n)], dtype=torch.int32)
    tokens = torch.arange(len(seq_ids), dtype=torch.int32)
    q = torch.randn(len(seq_ids), heads, head_dim, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.tensor([40, 45, 300 + verify], dtype=torch.int32)
    tables = tables.to(torch.int32)
    KERNEL.paged_decode(q, k_cache, v_cache, tables, lens, seq_ids, tokens, out, head_dim**-0.5, ctx_lens=ctx)
    expected = reference(q, k_cache, v_cache, tables, lens, seq_ids, tokens, head_dim**-0.5, ctx_lens=ctx)
    for token, want in expected.items():
        assert (out[token].double() - want).abs().max().item() < 1e-2  # the output's bfloat16 rounding
    last = slice(len(seq_ids) - verify, len(seq_ids))
    alone = torch.empty_like(q)
    for i in range(last.start, last.stop):  # each query as a decode of its own
        one = torch.tensor([i], dtype=torch.int32)
        KERNEL.paged_decode(q, k_cache, v_cache, tables, lens, seq_ids[one.long()], one, alone,
                            head_dim**-0.5, ctx_lens=ctx[one.long()])
    assert torch.equal(out[last], alone[last])


@pytest.mark.parametrize(("head_dim", "dtype"),
                         [(16, torch.float32), (64, torch.float32), (64, torch.bfloat16)])
def test_one_token_context_returns_its_value(head_dim, dtype):
    """Softmax over a single key is 1: the output is that value, exactly (every path)."""
    k_cache = torch.randn(2, 4, 8, head_dim).to(dtype)
    v_cache = torch.randn(2, 4, 8, head_dim).to(dtype)
    tables = torch.tensor([[3]], dtype=torch.int32)
    q = torch.randn(1, 4, head_dim).to(dtype)
    out = torch.empty_like(q)
    one = torch.tensor([0], dtype=torch.int32)
    lens = torch.tensor([1], dtype=torch.int32)
    KERNEL.paged_decode(q, k_cache, v_cache, tables, lens, one, one, out, 0.25)
    assert torch.equal(out[0], v_cache[:, 3, 0].repeat_interleave(2, 0))


def test_kernel_refuses_mismatched_layouts():
    """The checked entries (the engine's per-layer calls skip the checks: its layouts are fixed)."""
    q = torch.randn(2, 4, 16)
    caches = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    one = torch.tensor([0], dtype=torch.int32)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        KERNEL.paged_decode_checked(q, caches[0].transpose(1, 2), caches[1], tables, one + 1, one, one,
                                    torch.empty_like(q), 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        KERNEL.paged_decode_checked(q, *caches, tables, one + 1, one, one,
                                    torch.empty_like(q, dtype=torch.bfloat16), 1.0)
    kv = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="int64 slots"):
        KERNEL.store_kv_checked(kv, kv, *caches, one)
    with pytest.raises(ValueError, match="contiguous caches"):
        KERNEL.store_kv_checked(kv, kv, caches[0].transpose(1, 2), caches[1], one.long())


def mixed_step(block_size: int) -> ModelInput:
    """A step with two decodes (contexts 37 and 5), a prefill chunk after cached context and a
    fresh prompt, over block tables that are not in order."""
    return step_input(block_size, [([9, 2, 14], 36, 1), ([5], 4, 1), ([7, 1, 3], 20, 9), ([11, 12], 0, 6)])


@pytest.mark.parametrize("head_dim", [32, 64])  # the portable and the AVX-512 / AVX2 paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefill_in_kernel", [True, False, "split"])  # AVX-512 / AMX / AVX2-only CPUs
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_torch_backend_layer_gives_the_same_output_with_and_without_the_kernel(
        dtype, head_dim, prefill_in_kernel, kv_cache_dtype, monkeypatch):
    """Decodes go through the kernel, and prefills (after cached context, and fresh) too where the
    backend sends them there, each prefill token over the keys up to its own position; the torch
    ops (SDPA) agree, over a cache in the model's dtype and over an int8 one (which both paths
    store and read the same way)."""
    block_size, heads, kv_heads = 16, 6, 2
    split = prefill_in_kernel == "split"  # the fresh prompt (6 tokens) to the kernel, the chunk (29) to SDPA
    backend = cpu_attention.CpuAttentionBackend(block_size, prefill_in_kernel=split or prefill_in_kernel,
                                                    kv_cache_dtype=kv_cache_dtype)
    backend.kernel_prefill_context = 25 if split else backend.kernel_prefill_context
    impl = backend.create_impl(heads, kv_heads, head_dim, head_dim**-0.5)
    gen = torch.Generator().manual_seed(3)
    inp = mixed_step(block_size)
    q = torch.randn(inp.num_tokens, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(inp.num_tokens, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    filled = [torch.randn(16 * kv_heads * block_size * head_dim, generator=gen).to(dtype)
              .view(kv_heads, 16, block_size, head_dim) for _ in range(2)]
    if kv_cache_dtype == "int8":
        filled = [quantize_rows(c) for c in filled]
    assert filled[0].shape == backend.kv_cache_shape(16, kv_heads, head_dim)

    def run():  # on copies: an int8 store leaves k and v holding what the cache holds
        caches = [c.clone() for c in filled]
        meta = backend.build_metadata(inp, torch.device("cpu"))
        return impl.forward(q, k.clone(), v.clone(), *caches, meta), meta

    with_kernel, meta = run()
    assert not meta.decodes  # the kernel served the decodes: the torch-ops plan was never made
    ctx, left = meta.query_ctx.tolist(), meta.prefills.get((True, None))  # (after the kernel, no window)
    if split:
        assert ctx == [37, 5, 1, 2, 3, 4, 5, 6] and [(p.start, p.end) for p in left] == [(2, 11)]
    elif prefill_in_kernel:
        assert ctx[:2] == [37, 5] and ctx[2:11] == list(range(21, 30)) and len(ctx) == inp.num_tokens
        assert not meta.prefills  # nor the SDPA plans
    else:
        assert ctx == [37, 5] and len(left) == 2
    monkeypatch.setattr(cpu_attention, "kernels_for", lambda *tensors: None)
    without, meta = run()
    assert meta.decodes
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (with_kernel.float() - without.float()).abs().max().item() <= tol


def test_prefills_go_to_the_kernel_by_the_cpu(monkeypatch):
    """None with AMX; all with the AVX-512 path or an int8 cache; short ones with the AVX2 path."""
    backend, every = cpu_attention.CpuAttentionBackend, cpu_attention.EVERY_CONTEXT
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert backend(16).kernel_prefill_context == 0
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    bits = KERNEL.attention_vector_bits  # (the module skips where there are no kernels)
    expected = {512: every, 256: cpu_attention.AVX2_KERNEL_PREFILL_CONTEXT, 0: 0}[bits]
    assert backend(16).kernel_prefill_context == expected
    assert backend(16, kv_cache_dtype="int8").kernel_prefill_context == every


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="kvserve.kernels"):
        assert load_kernels.__wrapped__() is None
    assert "no C compiler" in caplog.text


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert load_kernels.__wrapped__() is None


def test_build_is_cached_per_source_and_cpu(monkeypatch):
    cc = cpu_build.compiler()
    built = cpu_build.build(cc)  # the session's kernels, built (or found) when KERNEL loaded
    assert built == cpu_build.artifact(cc) and built.parent == cpu_build.cache_dir()
    mtime = built.stat().st_mtime_ns
    assert cpu_build.build(cc) == built and built.stat().st_mtime_ns == mtime  # not rebuilt
    assert CpuKernels(built).supports_attention(9, 3, 64)
    assert not CpuKernels.supports_attention(9, 3, 1024)
    with monkeypatch.context() as m:  # another CPU: another file (x86-64-v3 and aarch64 builds: slow tests)
        m.setattr(cpu_build, "cpu_flags", lambda: "flags\t\t: fpu sse2 avx2")
        assert cpu_build.artifact(cc) != built
    edited = cpu_build.sources() + [Path(__file__)]  # another source: another file
    monkeypatch.setattr(cpu_build, "sources", lambda: edited)
    assert cpu_build.artifact(cc) != built


# -- the fused elementwise kernels against the torch ops they replace ------------------------------
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 48, 700])  # 700 x 576 runs on several threads
def test_rms_norm_with_and_without_residual(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype)
    plain = KERNEL.rms_norm(x, weight, 1e-5)
    want = torch.nn.functional.rms_norm(x.float(), (576,), weight.float(), 1e-5)
    assert (plain.float() - want).abs().max().item() < TOL[dtype] * 4
    res = residual.clone()
    fused = KERNEL.rms_norm(x, weight, 1e-5, res)
    summed = residual + x  # rounded to dtype, as the torch path stores it
    assert torch.equal(res, summed)
    want = torch.nn.functional.rms_norm(summed.float(), (576,), weight.float(), 1e-5)
    assert (fused.float() - want).abs().max().item() < TOL[dtype] * 4


def test_rms_norm_per_head_over_a_strided_view():
    """Qwen3's q/k norms: [tokens, heads, D] views into the q|k|v projection."""
    qkv = torch.randn(5, 3 * 4 * 32)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    weight = torch.rand(32)
    out = KERNEL.rms_norm(q, weight, 1e-6)
    assert torch.allclose(out, torch.nn.functional.rms_norm(q, (32,), weight, 1e-6), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = (torch.randn(37, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = KERNEL.silu_and_mul(x).float()
    assert ((got - want).abs() / (want.abs() + 1)).max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_the_torch_formula(dtype):
    from kvserve.engine.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    positions = torch.tensor([0, 5, 511, 17])
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = torch.randn(4, (9 + 3 + 3) * 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    qk = qkv[:, : 12 * 64].view(4, 12, 64)
    want = torch.addcmul(qk.float() * cos.float(), qk.float().roll(32, dims=-1), sin.float())
    v_before = qkv[:, 12 * 64 :].clone()
    got = KERNEL.rotary_(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()
    assert (got.float() - want).abs().max().item() < TOL[dtype] * 4
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # v beside it untouched


def test_store_kv_skips_minus_one_and_refuses_slots_past_the_cache():
    kv_heads, width, num_blocks, block_size = 2, 8, 3, 4
    k_cache = torch.zeros(kv_heads, num_blocks, block_size, width)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(3, (4 + 2 * kv_heads) * width)
    k = qkv[:, 4 * width : 6 * width].view(3, kv_heads, width)
    v = qkv[:, 6 * width :].view(3, kv_heads, width)
    KERNEL.store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 11]))
    flat_k, flat_v = k_cache.view(kv_heads, -1, width), v_cache.view(kv_heads, -1, width)
    assert torch.equal(flat_k[:, 5], k[0]) and torch.equal(flat_v[:, 11], v[2])
    assert int((flat_k.abs().sum(-1) > 0).sum()) == 2 * kv_heads  # token 1 went nowhere
    with pytest.raises(RuntimeError, match="out of range"):
        KERNEL.store_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 12]))


def test_kernels_for_answers_none_where_the_kernels_do_not_apply():
    """float16 and non-CPU tensors keep the torch ops: ``kernels_for`` answers None for them."""
    assert cpu_kernels.kernels_for(torch.zeros(2, 4, dtype=torch.float16)) is None
    assert cpu_kernels.kernels_for(torch.zeros(4, 2).t()) is None  # last dim not contiguous
    assert cpu_kernels.kernels_for(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16)) is None
    assert cpu_kernels.kernels_for(torch.zeros(2, 4, dtype=torch.bfloat16)) is KERNEL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_small_linear_matches_f_linear(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1000, generator=gen).to(dtype)  # 1000: two pieces of the K loop
    weight = torch.randn(777, 1000, generator=gen).to(dtype)
    bias = torch.randn(777, generator=gen).to(dtype)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    got = KERNEL.small_linear(x, weight, bias).float()
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]  # 1000-term sums in another order
    assert ((got - want).abs() / (want.abs() + 1)).max().item() < tol
    no_bias = KERNEL.small_linear(x, weight, None).float()
    assert ((no_bias - (want - bias.float())).abs() / (want.abs() + 1)).max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_linear_over_a_strided_weight_and_an_int8_one(dtype):
    """One row (csrc/linear.c where built for AVX-512): a weight whose rows are further apart
    than its width (a view), row counts not a multiple of the four done at once, widths not a
    multiple of 16 or 32; and int8 weights with row scales and a bias."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(203, 1100, generator=gen).to(dtype)
    weight = wide[:, :1000]
    x = torch.randn(1, 1000, generator=gen).to(dtype)
    want = torch.nn.functional.linear(x.float(), weight.float())
    got = KERNEL.small_linear(x, weight, None).float()
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    assert ((got - want).abs() / (want.abs() + 1)).max().item() < tol
    q = torch.randint(-127, 128, (203, 999), generator=gen, dtype=torch.int8)
    scales = (torch.rand(203, generator=gen) / 100).to(dtype)
    bias = torch.randn(203, generator=gen).to(dtype)
    x = torch.randn(1, 999, generator=gen).to(dtype)
    want = torch.nn.functional.linear(x.float(), q.float() * scales.float()[:, None], bias.float())
    got = KERNEL.small_linear(x, q, bias, scales).float()
    assert ((got - want).abs() / (want.abs() + 1)).max().item() < tol


def test_one_row_linears_of_a_layer_go_through_the_kernel(monkeypatch):
    from kvserve.engine.layers import linear as linear_module

    calls = []
    monkeypatch.setattr(CpuKernels, "small_linear",
                        lambda self, x, w, b: calls.append(x.shape) or torch.nn.functional.linear(x, w, b))
    layer = linear_module.ColumnParallelLinear(16, 32, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer(torch.randn(1, 16))
    layer(torch.randn(5, 16))  # more rows: torch's matmul
    assert calls == [torch.Size([1, 16])]


def test_rows_wider_than_the_kernels_piece_are_taken_whole():
    """Qwen2.5-7B's MLP is 18,944 wide: the fused kernels work in pieces, with no width limit."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 2 * 18_944, generator=gen)
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(KERNEL.silu_and_mul(x), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    rows, residual, weight = torch.randn(3, 18_944, generator=gen), torch.randn(3, 18_944, generator=gen), \
        torch.rand(18_944, generator=gen)
    res = residual.clone()
    got = KERNEL.rms_norm(rows, weight, 1e-6, res)
    assert torch.equal(res, residual + rows)
    want = torch.nn.functional.rms_norm(residual + rows, (18_944,), weight, 1e-6)
    assert torch.allclose(got, want, atol=1e-5)


def test_every_thread_of_the_team_flushes_denormals_once_the_runner_does():
    """torch.set_flush_denormal sets only the calling thread; OpenMP's threads made before keep
    rounding denormals. flush_denormals (the model runner, each step) hands its mode to the team, so
    a row's silu(gate) * up (here ~-1e-39, a denormal) is the same whichever thread computes it.
    In a fresh process: the team is made first, as a test run or a user's process may have made it."""
    if KERNEL is None:
        pytest.skip("no C compiler here")
    code = """
import torch
from kvserve.engine.layers.activation import silu_and_mul
from kvserve.engine.runner.model_runner import flush_denormals
torch.set_num_threads(2)
x = torch.cat([torch.full((512, 2048), -87.0), torch.full((512, 2048), 1e-3)], dim=1).to(torch.bfloat16)
before = int((silu_and_mul(x).float() != 0).sum())  # the team exists now, denormals not flushed in it
flush_denormals(torch.device("cpu"))
print(before, int((silu_and_mul(x).float() != 0).sum()))  # rows split between the two threads
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    out = out.split()
    assert out == [str(512 * 2048), "0"]  # denormal everywhere, then flushed to zero in every thread
