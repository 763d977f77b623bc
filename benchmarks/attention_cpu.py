"""The CPU attention kernel against torch's own CPU attention, one layer at a time.

Decode: ``--batch`` sequences of ``--context`` cached tokens, one query each, over ``--layers``
layers' caches (so that, as in a real step, the keys and values come from memory, not from
cache), the kernel (``kernels/csrc/attention.c``) next to the torch-ops decode it replaced (one
gather of the blocks per cache, batched matmuls). Prefill: prompts of the given lengths, every
token a query over the keys up to its own position, the kernel next to
``F.scaled_dot_product_attention`` (torch's CPU flash kernel, causal, grouped-query), one call
per prompt as the torch backend makes them. The model's attention shape by default (the bundled
model: 9 query heads, 3 KV heads, head dim 64); each figure is the fastest of ``--repeats``; the
largest difference between the two outputs is printed beside the ratio.

    python -m kvserve.benchmarks.attention_cpu [--dtype bfloat16] [--prefill 7x300 1x2048 1x4096]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvserve.benchmarks import write_json
from kvserve.kernels.cpu_kernels import DTYPES, load_kernels


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _torch_decode(q, k_cache, v_cache, tables, ctx: int, scale: float) -> torch.Tensor:
    """The torch-ops decode over sequences of equal length: gather, two batched matmuls."""
    kv_heads, _, block_size, d = k_cache.shape
    n, heads = q.shape[0], q.shape[1]
    rows = k_cache.view(-1, block_size * d)
    index = (torch.arange(kv_heads)[:, None, None] * k_cache.shape[1] + tables.long()[None]).reshape(-1)
    keys = rows.index_select(0, index).view(kv_heads * n, -1, d)[:, :ctx]
    values = v_cache.view(-1, block_size * d).index_select(0, index).view(kv_heads * n, -1, d)[:, :ctx]
    group = heads // kv_heads
    qs = (q * scale).view(n, kv_heads, group, d).transpose(0, 1).reshape(kv_heads * n, group, d)
    probs = torch.softmax(torch.bmm(qs, keys.transpose(1, 2)), dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, values).view(kv_heads, n, group, d)
    return out.transpose(0, 1).reshape(n, heads, d)


def bench_decode(kernels, args, dtype) -> dict:
    heads, kv_heads, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    n, ctx = args.batch, args.context
    per_seq = -(-ctx // bs)
    blocks = n * per_seq
    gen = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(kv_heads, blocks, bs, d, generator=gen).to(dtype) for _ in range(2))
              for _ in range(args.layers)]
    tables = torch.arange(blocks, dtype=torch.int32).view(n, per_seq)
    lens = torch.full((n,), ctx, dtype=torch.int32)
    seqs = torch.arange(n, dtype=torch.int32)
    q = torch.randn(n, heads, d, generator=gen).to(dtype)
    out = torch.empty_like(q)
    scale = d**-0.5

    def kernel():
        for k_cache, v_cache in caches:
            kernels.paged_decode(q, k_cache, v_cache, tables, lens, seqs, seqs, out, scale)

    def reference():
        return [_torch_decode(q, k_cache, v_cache, tables, ctx, scale) for k_cache, v_cache in caches]

    kernel_s, torch_s = _best(kernel, args.repeats), _best(reference, args.repeats)
    kernel()
    diff = (out.float() - reference()[-1].float()).abs().max().item()
    kv_bytes = 2 * args.layers * n * ctx * kv_heads * d * q.element_size()
    return {"batch": n, "context": ctx, "layers": args.layers, "kernel_ms": kernel_s * 1e3,
            "torch_ms": torch_s * 1e3, "speedup": torch_s / kernel_s, "max_abs_diff": diff,
            "kernel_kv_gb_per_s": kv_bytes / kernel_s / 1e9}


def bench_prefill(kernels, args, dtype, prompts: int, length: int) -> dict:
    heads, kv_heads, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    per_seq = -(-length // bs)
    blocks = prompts * per_seq
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(kv_heads, blocks, bs, d, generator=gen).to(dtype) for _ in range(2))
    tables = torch.arange(blocks, dtype=torch.int32).view(prompts, per_seq)
    tokens = prompts * length

    def flat(cache):  # the new tokens' K or V, [tokens, kv_heads, D], as the layer computed them
        per_prompt = cache.view(kv_heads, prompts, per_seq * bs, d)[:, :, :length]
        return per_prompt.permute(1, 2, 0, 3).reshape(tokens, kv_heads, d).contiguous()

    k, v = flat(k_cache), flat(v_cache)
    q = torch.randn(tokens, heads, d, generator=gen).to(dtype)
    lens = torch.full((prompts,), length, dtype=torch.int32)
    seqs = torch.arange(prompts, dtype=torch.int32).repeat_interleave(length)
    ctx = (torch.arange(length, dtype=torch.int32) + 1).repeat(prompts)
    rows = torch.arange(tokens, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = d**-0.5

    def kernel():
        kernels.paged_decode(q, k_cache, v_cache, tables, lens, seqs, rows, out, scale, ctx_lens=ctx)

    def sdpa():
        parts = []
        for p in range(prompts):
            span = slice(p * length, (p + 1) * length)
            o = F.scaled_dot_product_attention(
                q[span].transpose(0, 1)[None], k[span].transpose(0, 1)[None], v[span].transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=kv_heads != heads)
            parts.append(o[0].transpose(0, 1))
        return torch.cat(parts)

    kernel_s, sdpa_s = _best(kernel, args.repeats), _best(sdpa, args.repeats)
    kernel()
    diff = (out.float() - sdpa().float()).abs().max().item()
    return {"prompts": prompts, "length": length, "kernel_ms": kernel_s * 1e3, "sdpa_ms": sdpa_s * 1e3,
            "speedup": sdpa_s / kernel_s, "max_abs_diff": diff}


def _shape(text: str) -> tuple[int, int]:
    prompts, _, length = text.partition("x")
    return int(prompts), int(length)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=48, help="decode: sequences")
    ap.add_argument("--context", type=int, default=300, help="decode: cached tokens per sequence")
    ap.add_argument("--layers", type=int, default=30, help="decode: layers' caches read per timed call")
    ap.add_argument("--prefill", nargs="*", default=["7x300", "2x1024", "1x2048"], metavar="NxLEN",
                    help="prefill shapes: N prompts of LEN tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here (no compiler, or KVSERVE_CPU_KERNELS=0)")
    dtype = getattr(torch, args.dtype)
    assert dtype in DTYPES
    result = {"dtype": args.dtype, "threads": torch.get_num_threads(),
              "decode": bench_decode(kernels, args, dtype),
              "prefill": [bench_prefill(kernels, args, dtype, *_shape(s)) for s in args.prefill]}
    d = result["decode"]
    print(f"dtype={args.dtype} threads={result['threads']} heads={args.heads} kv_heads={args.kv_heads} "
          f"head_dim={args.head_dim}")
    print(f"decode, batch {d['batch']} x {d['context']} tokens, {d['layers']} layers: "
          f"kernel {d['kernel_ms']:.2f} ms "
          f"({d['kernel_kv_gb_per_s']:.1f} GB/s of K/V), torch ops {d['torch_ms']:.2f} ms: "
          f"{d['speedup']:.2f}x (max |diff| {d['max_abs_diff']:.4f})")
    for p in result["prefill"]:
        print(f"prefill, {p['prompts']} x {p['length']} tokens, one layer: kernel {p['kernel_ms']:.2f} ms, "
              f"torch SDPA {p['sdpa_ms']:.2f} ms: {p['speedup']:.2f}x (max |diff| {p['max_abs_diff']:.4f})")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
