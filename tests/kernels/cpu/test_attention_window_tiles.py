"""csrc/attention.c's prefill tiles (runs of PREFILL_TILE_MIN_RUN or more consecutive prompt
tokens of one sequence, bfloat16, head dims 64/128) under a sliding window: each token's lane
attends to its own last ``window`` keys, read from the block of the run's first token's window on,
against a float64 reference; the same tokens one query at a time (the portable path a window took
before) agree to the output's bfloat16 rounding."""

import pytest
import torch

from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.kernels.cpu.build import header_constant

KERNEL = load_kernels()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler here: the torch-ops path serves")


def reference(q, k_cache, v_cache, table, ctx, window, scale):
    """Float64 attention of q[i] over keys max(0, ctx[i] - window) .. ctx[i] - 1 of ``table``."""
    kv_heads, _, block_size, d = k_cache.shape
    group = q.shape[1] // kv_heads
    keys = k_cache[:, table.long()].reshape(kv_heads, -1, d).double().repeat_interleave(group, 0)
    values = v_cache[:, table.long()].reshape(kv_heads, -1, d).double().repeat_interleave(group, 0)
    out = []
    for i, n in enumerate(ctx.tolist()):
        lo = max(n - window, 0)
        scores = torch.einsum("hd,hnd->hn", q[i].double() * scale, keys[:, lo:n])
        out.append(torch.einsum("hn,hnd->hd", scores.softmax(-1), values[:, lo:n]))
    return torch.stack(out)


@pytest.mark.parametrize("window", [5, 37, 200])  # narrower than a tile, wider, past the run
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (16, 2, 128, 16), (8, 1, 64, 8)])
def test_window_prefill_tiles_match_the_reference(window, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(window + heads + head_dim)
    num_blocks = 1024 // block_size
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
                        .to(torch.bfloat16) for _ in range(2))
    table = torch.randperm(num_blocks, generator=gen)[: num_blocks // 2].to(torch.int32)
    run = header_constant("PREFILL_TILE_MIN_RUN") + 13  # a run after 61 cached tokens, a partial last tile
    ctx = torch.arange(62, 62 + run, dtype=torch.int32)
    first_block = (62 - window) // block_size if window < 62 else 0
    k_cache[:, table[:first_block].long()] = v_cache[:, table[:first_block].long()] = float("nan")  # freed
    q = torch.randn(run, heads, head_dim, generator=gen).to(torch.bfloat16)
    seq_ids, tokens = torch.zeros(run, dtype=torch.int32), torch.arange(run, dtype=torch.int32)
    lens = ctx[-1:].clone()
    out, alone = torch.empty_like(q), torch.empty_like(q)
    KERNEL.paged_decode(q, k_cache, v_cache, table[None], lens, seq_ids, tokens, out, head_dim**-0.5,
                        ctx_lens=ctx, window=window)
    want = reference(q, k_cache, v_cache, table, ctx, window, head_dim**-0.5)
    assert (out.double() - want).abs().max().item() < 1e-2  # the output's bfloat16 rounding
    for i in range(0, run, 4):  # every fourth token alone: one query per item
        one = tokens[i : i + 1]
        KERNEL.paged_decode(q, k_cache, v_cache, table[None], lens, seq_ids[:1], one, alone, head_dim**-0.5,
                            ctx_lens=ctx[i : i + 1], window=window)
    assert (out[::4].float() - alone[::4].float()).abs().max().item() < 2e-2
