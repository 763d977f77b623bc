"""The launch configurations (kernels/triton/launch.py): what the launchers pass, and the GPU
configurations themselves run under the interpreter (the GPU's key tiles, row tiles, warps), so
the tiles the compile check passes are also right, not only spill-free."""

import dataclasses
import inspect
import os

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (the dev and gpu extras bring it)")

from kvserve.kernels.triton import launch, paged_attention  # noqa: E402
from kvserve.kernels.triton.paged_attention import paged_decode_attention, paged_prefill_attention  # noqa: E402


def test_head_dims_from_128_launch_eight_warps_and_256_smaller_key_tiles():
    small, mid, big = (launch.decode_launch(d, 2, 16, False, True) for d in (64, 128, 256))
    assert (small.num_warps, mid.num_warps, big.num_warps) == (4, 8, 8)
    assert (small.constexprs["BLOCK_N"], mid.constexprs["BLOCK_N"], big.constexprs["BLOCK_N"]) == (64, 64, 32)
    assert big.num_stages == 2 and launch.prefill_launch(256, 8, 16, True).num_stages == 2
    assert mid.num_stages == 3 and launch.prefill_launch(128, 8, 16, True).num_stages == 2
    fp32 = launch.prefill_launch(64, 3, 16, True, element_bytes=4)
    assert (fp32.num_warps, fp32.constexprs["BLOCK_N"]) == (8, 32)
    cpu = launch.prefill_launch(128, 3, 16, False)
    assert cpu.constexprs["BLOCK_N"] == 16 and cpu.constexprs["UPCAST_DOT"]
    assert cpu.constexprs["TOKENS_PER_TILE"] * cpu.constexprs["GROUP_PAD"] == cpu.constexprs["BLOCK_M"]
    assert launch.d_pad(80) == 128 and launch.d_pad(8) == 16


def _on_gpu_tiles(make):
    """``make``'s GPU configuration, with tl.dot in float32 (the interpreter's bf16 dot is wrong)."""

    def gpu(*args, **kwargs):
        bound = inspect.signature(make).bind(*args, **kwargs)
        bound.arguments["on_gpu"] = True
        cfg = make(*bound.args, **bound.kwargs)
        return dataclasses.replace(cfg, constexprs={**cfg.constexprs, "UPCAST_DOT": True})

    return gpu


def _reference(q, keys, values, scale, causal_offset=None):
    """Float64 attention of q [T, H, D] over keys/values [N, KV, D], causal from ``causal_offset``."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    s = torch.einsum("thd,nhd->htn", q.double() * scale, k)
    if causal_offset is not None:
        pos = torch.arange(q.shape[0])[:, None] + causal_offset
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    return torch.einsum("htn,nhd->thd", s.softmax(-1), v)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_gpu_configurations_give_the_reference_attention_under_the_interpreter(head_dim, monkeypatch):
    """On a GPU the same configurations run compiled (tl.dot in float32 there too)."""
    monkeypatch.setattr(paged_attention, "decode_launch", _on_gpu_tiles(launch.decode_launch))
    monkeypatch.setattr(paged_attention, "prefill_launch", _on_gpu_tiles(launch.prefill_launch))
    gen = torch.Generator().manual_seed(head_dim)
    kv_heads, group, block_size, context, new = 1, 2, 16, 70, 5
    blocks = torch.tensor([[3, 0, 4, 1, 2]], dtype=torch.int32)  # out of order
    caches = [torch.randn(6, block_size, kv_heads, head_dim, generator=gen) for _ in range(2)]
    flat = [c[blocks[0].long()].reshape(-1, kv_heads, head_dim)[:context] for c in caches]
    scale = head_dim**-0.5
    lens = torch.tensor([context], dtype=torch.int32)
    q = torch.randn(1, kv_heads * group, head_dim, generator=gen)
    want = _reference(q, *flat, scale)
    on = [t.to(DEVICE) for t in (*caches, blocks, lens)]
    for splits in (1, 3):
        got = paged_decode_attention(q.to(DEVICE), *on, scale, num_splits=splits)
        torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)
    q_new = torch.randn(new, kv_heads * group, head_dim, generator=gen)
    cu = torch.tensor([0, new], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache, blocks_on, lens_on = on
    got = paged_prefill_attention(q_new.to(DEVICE), k_cache, v_cache, cu, lens_on, blocks_on, scale)
    torch.testing.assert_close(
        got.cpu().double(), _reference(q_new, *flat, scale, context - new), atol=1e-5, rtol=1e-5
    )
