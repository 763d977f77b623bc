"""The CPU decode-attention kernel (kernels/csrc/paged_decode.c): against a plain float64 reference,
inside the torch backend against the torch-ops path it replaces, and its build/fallback rules."""

import logging

import pytest
import torch

from kvserve.engine.layers import attention_torch
from kvserve.engine.layers.attention import create_attention_backend
from kvserve.engine.model_input import ModelInput
from kvserve.kernels import cpu_attention
from kvserve.kernels.cpu_attention import PagedDecodeKernel, load_kernel

KERNEL = load_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler here: the torch-ops path serves")


def reference(q, k_cache, v_cache, tables, lens, seq_ids, tokens, scale):
    """Float64 attention of each listed query over its sequence's first ``lens`` cached keys."""
    kv_heads, _, block_size, d = k_cache.shape
    group = q.shape[1] // kv_heads
    out = {}
    for seq, token in zip(seq_ids.tolist(), tokens.tolist(), strict=True):
        n = int(lens[seq])
        blocks = tables[seq, : -(-n // block_size)].long()
        keys = k_cache[:, blocks].reshape(kv_heads, -1, d)[:, :n].double().repeat_interleave(group, 0)
        values = v_cache[:, blocks].reshape(kv_heads, -1, d)[:, :n].double().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", q[token].double() * scale, keys)
        out[token] = torch.einsum("hn,hnd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 96), (6, 1, 32)])
def test_kernel_matches_a_float64_reference(dtype, heads, kv_heads, head_dim):
    """Contexts of 1 token, exactly one block, a partial last block and many blocks; blocks in
    random order; rows of q that are not decodes are left as they were."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    block_size, num_blocks = 16, 64
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    lens = torch.tensor([1, 16, 33, 250, 7], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:16] for _ in lens]).to(torch.int32)
    q = torch.randn(7, heads, head_dim, generator=gen).to(dtype)
    seq_ids = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    tokens = torch.tensor([6, 1, 3, 0], dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    KERNEL.run(q, k_cache, v_cache, tables, lens, seq_ids, tokens, out, head_dim**-0.5)
    expected = reference(q, k_cache, v_cache, tables, lens, seq_ids, tokens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
    for token, want in expected.items():
        assert (out[token].double() - want).abs().max().item() < tol
    assert torch.all(out[[2, 4, 5]] == 7.0)


def test_one_token_context_returns_its_value():
    """Softmax over a single key is 1: the output is that value, exactly."""
    k_cache = torch.randn(2, 4, 8, 16)
    v_cache = torch.randn(2, 4, 8, 16)
    tables = torch.tensor([[3]], dtype=torch.int32)
    q = torch.randn(1, 4, 16)
    out = torch.empty_like(q)
    one = torch.tensor([0], dtype=torch.int32)
    KERNEL.run(q, k_cache, v_cache, tables, torch.tensor([1], dtype=torch.int32), one, one, out, 0.25)
    assert torch.equal(out[0], v_cache[:, 3, 0].repeat_interleave(2, 0))


def test_kernel_refuses_mismatched_layouts():
    q = torch.randn(2, 4, 16)
    caches = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    one = torch.tensor([0], dtype=torch.int32)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        KERNEL.run(q, caches[0].transpose(1, 2), caches[1], tables, one + 1, one, one,
                   torch.empty_like(q), 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        KERNEL.run(q, *caches, tables, one + 1, one, one, torch.empty_like(q, dtype=torch.bfloat16), 1.0)


def mixed_step(block_size: int) -> ModelInput:
    """A step with two decodes (contexts 37 and 5), a prefill chunk after cached context and a
    fresh prompt, over block tables that are not in order."""
    inp = ModelInput([], [], [], [], [], [], [])
    seqs = [([9, 2, 14], 36, 1), ([5], 4, 1), ([7, 1, 3], 20, 9), ([11, 12], 0, 6)]
    for blocks, cached, n in seqs:
        positions = list(range(cached, cached + n))
        inp.input_ids += [1] * n
        inp.positions += positions
        inp.slot_mapping += [blocks[p // block_size] * block_size + p % block_size for p in positions]
        inp.query_lens.append(n)
        inp.context_lens.append(cached + n)
        inp.block_tables.append(blocks[: -(-(cached + n) // block_size)])
        inp.logits_indices.append(len(inp.input_ids) - 1)
    return inp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_layer_gives_the_same_output_with_and_without_the_kernel(dtype, monkeypatch):
    block_size, heads, kv_heads, head_dim = 16, 6, 2, 32
    backend = create_attention_backend("torch", torch.device("cpu"), block_size)
    impl = backend.create_impl(heads, kv_heads, head_dim, head_dim**-0.5)
    gen = torch.Generator().manual_seed(3)
    inp = mixed_step(block_size)
    q = torch.randn(inp.num_tokens, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(inp.num_tokens, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    filled = [torch.randn(backend.kv_cache_shape(16, kv_heads, head_dim), generator=gen).to(dtype)
              for _ in range(2)]

    def run():
        caches = [c.clone() for c in filled]
        meta = backend.build_metadata(inp, torch.device("cpu"))
        return impl.forward(q, k, v, *caches, meta), meta

    with_kernel, meta = run()
    assert meta.decode is None  # the kernel served: the torch-ops plan was never made
    monkeypatch.setattr(attention_torch, "load_kernel", lambda: None)
    without, meta = run()
    assert meta.decode is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (with_kernel.float() - without.float()).abs().max().item() <= tol


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="kvserve.kernels"):
        assert load_kernel.__wrapped__() is None
    assert "no C compiler" in caplog.text


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "0")
    assert load_kernel.__wrapped__() is None


def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    cc = cpu_attention._compiler()
    first = cpu_attention.build(cc)
    assert first.parent == tmp_path / "kernels"
    mtime = first.stat().st_mtime_ns
    assert cpu_attention.build(cc) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert PagedDecodeKernel(first).supports(torch.bfloat16, 9, 3, 64)
    assert not PagedDecodeKernel.supports(torch.float16, 9, 3, 64)
