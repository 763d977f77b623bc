"""The attention variants a layer asks for at ``create_impl``: kept on the impl, or refused there
with the variant's and the backend's names."""

from types import SimpleNamespace

import pytest
import torch

from kvserve.engine.layers.attention import cpu_backend
from kvserve.engine.layers.attention.cpu_backend import CpuAttentionBackend
from kvserve.engine.model_input import ModelInput, slot_of


def test_plain_impl_has_no_variant():
    impl = CpuAttentionBackend(block_size=4).create_impl(4, 2, 8, 0.25)
    assert (impl.sliding_window, impl.logits_soft_cap, impl.has_sinks) == (None, None, False)


def test_unimplemented_variant_is_refused_by_name():
    """flash-attn 2 has no attention sinks (the check its backend runs, with its variants: the
    module itself imports only where flash_attn does)."""
    from kvserve.engine.layers.attention.backend import AttentionBackend

    flash = SimpleNamespace(name="flash-attn", variants=FLASH_VARIANTS)
    with pytest.raises(ValueError, match="sinks is not implemented by the flash-attn"):
        AttentionBackend.check_variants(flash, None, None, True)
    AttentionBackend.check_variants(flash, 8, 50.0, False)


FLASH_VARIANTS = frozenset({"sliding_window", "logits_soft_cap"})


def test_auto_backend_takes_one_that_computes_the_models_variants(monkeypatch):
    from kvserve.engine.layers.attention import backend

    classes = {"flash-attn": SimpleNamespace(variants=FLASH_VARIANTS),
               "triton": SimpleNamespace(variants=FLASH_VARIANTS | {"sinks"})}
    monkeypatch.setattr(backend, "_backend_class", classes.__getitem__)
    cuda = torch.device("cuda")
    assert backend.resolve_backend_name("auto", cuda, 256, torch.bfloat16) == "flash-attn"
    assert backend.resolve_backend_name("auto", cuda, 256, torch.bfloat16, frozenset({"sinks"})) == "triton"


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        CpuAttentionBackend(block_size=4).create_impl(4, 2, 8, 0.25, sliding_window=window)


def window_reference(q, keys, values, first_position, window, scale, group, cap=None, sinks=None):
    """Float64 attention of queries at positions first_position.. over dense keys 0..L-1 under a
    window: the query at p sees keys max(0, p - window + 1) .. p (all up to p with window None);
    ``cap``: scores become cap * tanh(s / cap); ``sinks`` [heads]: a logit per head in the
    softmax's denominator only."""
    positions = torch.arange(first_position, first_position + q.shape[0])[:, None]
    key_pos = torch.arange(keys.shape[0])[None, :]
    visible = (key_pos <= positions) & (key_pos > positions - (window or 1 << 30))
    keys = keys.double().repeat_interleave(group, 1)
    values = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double() * scale, keys)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    sink = sinks.double()[:, None, None].expand(*scores.shape[:2], 1)
    probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, values)


VARIANTS = [(None, None, False), (6, None, False), (6, 5.0, False), (6, None, True), (None, 5.0, True),
            (6, 5.0, True)]


@pytest.mark.parametrize(("window", "cap", "with_sinks"), VARIANTS)
# the kernel's portable loop (8), its vector path (64), and Gemma's 256-dim heads in 2 and 4 heads per KV
# head (in C only: the torch ops do not depend on the head dim)
@pytest.mark.parametrize(("in_c", "head_dim", "kv_heads"),
                         [(True, 8, 2), (True, 64, 2), (True, 256, 2), (True, 256, 1), (False, 8, 2),
                          (False, 64, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_layer_matches_a_reference_and_reads_no_block_behind_the_window(
        in_c, dtype, head_dim, kv_heads, window, cap, with_sinks, monkeypatch):
    """Decodes (context inside the window, past it, on a block edge), a chunk after cached
    context and a fresh prompt longer than the window, in one step, through the C kernel (every
    token a query of its own, the prefill too) and through the torch ops; every block wholly
    behind a sequence's window holds NaN (it stands for a freed block that another sequence
    reuses), so any read of one, even under the mask, would show in the output. With Gemma 2's
    soft cap (small, so that it bends the scores) and gpt-oss's sinks (in C: in the vector paths and
    the portable loop alike)."""
    if not in_c:
        monkeypatch.setattr(cpu_backend, "kernels_for", lambda *tensors: None)
    block_size, heads, num_blocks = 4, 4, 48
    backend = CpuAttentionBackend(block_size, prefill_in_kernel=True)
    impl = backend.create_impl(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window=window,
                               logits_soft_cap=cap, sinks=with_sinks)
    assert (impl.sliding_window, impl.logits_soft_cap, impl.has_sinks) == (window, cap, with_sinks)
    assert impl.attends_in_c == (cpu_backend.load_kernels() is not None)
    gen = torch.Generator().manual_seed(5)
    sinks = torch.randn(heads, generator=gen).mul(2).to(dtype) if with_sinks else None
    k_cache = torch.zeros(backend.kv_cache_shape(num_blocks, kv_heads, head_dim), dtype=dtype)
    v_cache = k_cache.clone()
    free = iter(torch.randperm(num_blocks - 1, generator=gen).add(1).tolist())  # block 0 pads gathers
    inp, dense, firsts = ModelInput(), [], []
    q_rows, k_rows, v_rows = [], [], []
    for cached, new in [(20, 1), (3, 1), (15, 1), (13, 7), (0, 11)]:
        total = cached + new
        keys, values = (torch.randn(total, kv_heads, head_dim, generator=gen) for _ in range(2))
        lowest_seen = max(cached - (window or 1 << 30) + 1, 0)  # the first key any query here sees
        table = [next(free) for _ in range(-(-total // block_size))]
        for b, block in enumerate(table):
            if (b + 1) * block_size <= lowest_seen:
                k_cache[:, block] = v_cache[:, block] = float("nan")
        for p in range(cached):  # the cached context, in the blocks the window still covers
            if (p // block_size + 1) * block_size > lowest_seen:
                slot = slot_of(table, p, block_size)
                k_cache[:, slot // block_size, slot % block_size] = keys[p]
                v_cache[:, slot // block_size, slot % block_size] = values[p]
        positions = list(range(cached, total))
        inp.input_ids += [1] * new
        inp.positions += positions
        inp.slot_mapping += [slot_of(table, p, block_size) for p in positions]
        inp.query_lens.append(new)
        inp.context_lens.append(total)
        inp.block_tables.append(table)
        q_rows.append(torch.randn(new, heads, head_dim, generator=gen))
        k_rows.append(keys[cached:])
        v_rows.append(values[cached:])
        dense.append((keys, values))
        firsts.append(cached)
    q, k, v = (torch.cat(rows).to(dtype) for rows in (q_rows, k_rows, v_rows))
    meta = backend.build_metadata(inp, torch.device("cpu"))
    out = impl.forward(q, k, v, k_cache, v_cache, meta, sinks=sinks)
    kernel = in_c and cpu_backend.load_kernels() is not None
    assert (meta.query_tokens is not None and not meta.decodes) == kernel  # the C kernel took every token
    start = 0
    for (keys, values), first, rows in zip(dense, firsts, q_rows, strict=True):
        expected = window_reference(*(x.to(dtype) for x in (rows, keys, values)), first, window, impl.scale,
                                    heads // kv_heads, cap, sinks)
        got = out[start : start + rows.shape[0]].double()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert torch.allclose(got, expected, atol=tol), (first, (got - expected).abs().max())
        start += rows.shape[0]
