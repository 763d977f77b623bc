"""The CPU attention kernel against torch's own CPU attention, one layer at a time.

Both run through the torch backend's attention layer (``engine/layers/attention/cpu_backend.py``), once
with the kernel and once as torch ops (what runs without a C compiler): decode is the row gather
plus batched matmuls, prefill ``F.scaled_dot_product_attention`` (torch's CPU flash kernel,
causal, grouped-query). Decode: ``--batch`` sequences of ``--context`` cached tokens, one new
token each, over ``--layers`` layers' caches (so that, as in a real step, the keys and values come
from memory, not from cache). Prefill: fresh prompts of the given lengths. The model's attention
shape by default (the bundled model: 9 query heads, 3 KV heads, head dim 64); each figure is the
fastest of ``--repeats``; the largest difference between the two outputs is printed beside the
ratio. (The engine sends prefills to the kernel only on CPUs without AMX; the kernel figure
here is the kernel's wherever it runs, and the line after the shapes says which one the engine
takes on this CPU.) ``--kv-cache-dtype int8`` reads an int8 cache (engine/layers/attention/kv_quant.py)
on both paths.

    python -m kvserve.benchmarks.attention_cpu [--dtype bfloat16] [--kv-cache-dtype int8]
        [--prefill 7x300 1x2048 1x4096]
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments.ceiling import best_time
from kvserve.engine.config import KV_CACHE_DTYPES
from kvserve.engine.layers.attention import cpu_backend as cpu_attention
from kvserve.engine.layers.attention.kv_quant import quantize_rows
from kvserve.engine.model_input import ModelInput, blocks_for, slot_of
from kvserve.kernels.cpu.bindings import load_kernels

CPU = torch.device("cpu")


def step_input(block_size: int, seqs: list[tuple[list[int], int, int]]) -> ModelInput:
    """A step over hand-made block tables: per sequence (its blocks, tokens already cached, new
    tokens), the new tokens' positions and cache slots."""
    inp = ModelInput()
    for blocks, cached, n in seqs:
        positions = list(range(cached, cached + n))
        inp.input_ids += [1] * n
        inp.positions += positions
        inp.slot_mapping += [slot_of(blocks, p, block_size) for p in positions]
        inp.query_lens.append(n)
        inp.context_lens.append(cached + n)
        inp.block_tables.append(blocks[: blocks_for(cached + n, block_size)])
        inp.logits_indices.append(len(inp.input_ids) - 1)
    return inp


class _Layer:
    """One attention layer of the torch backend over ``layers`` caches, run with or without the
    kernel, for the step ``inp``."""

    def __init__(self, args, dtype, inp: ModelInput, num_blocks: int, layers: int, seed: int):
        backend = cpu_attention.CpuAttentionBackend(args.block_size, prefill_in_kernel=True,
                                                        kv_cache_dtype=args.kv_cache_dtype)
        self.impl = backend.create_impl(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
        self.meta = backend.build_metadata(inp, CPU)
        gen = torch.Generator().manual_seed(seed)
        shape = (args.kv_heads, num_blocks, args.block_size, args.head_dim)

        def cache() -> torch.Tensor:
            values = torch.randn(shape, generator=gen).to(dtype)
            return quantize_rows(values) if args.kv_cache_dtype == "int8" else values

        self.caches = [(cache(), cache()) for _ in range(layers)]
        tokens = inp.num_tokens
        self.q = torch.randn(tokens, args.heads, args.head_dim, generator=gen).to(dtype)
        self.k, self.v = (torch.randn(tokens, args.kv_heads, args.head_dim, generator=gen).to(dtype)
                          for _ in range(2))

    def run(self, kernel: bool) -> torch.Tensor:
        """The last layer's output; every layer's cache read."""
        with mock.patch.object(cpu_attention, "kernels_for", cpu_attention.kernels_for if kernel
                               else lambda *tensors: None):
            for k_cache, v_cache in self.caches:
                out = self.impl.forward(self.q, self.k, self.v, k_cache, v_cache, self.meta)
        return out

    def compare(self, repeats: int) -> dict:
        kernel_s = best_time(lambda: self.run(True), CPU, repeats)
        torch_s = best_time(lambda: self.run(False), CPU, repeats)
        diff = (self.run(True).float() - self.run(False).float()).abs().max().item()
        return {"kernel_ms": kernel_s * 1e3, "torch_ms": torch_s * 1e3, "speedup": torch_s / kernel_s,
                "max_abs_diff": diff}


def bench_decode(args, dtype) -> dict:
    n, ctx, bs = args.batch, args.context, args.block_size
    per_seq = blocks_for(ctx, bs)
    seqs = [(list(range(i * per_seq, (i + 1) * per_seq)), ctx - 1, 1) for i in range(n)]
    layer = _Layer(args, dtype, step_input(bs, seqs), n * per_seq, args.layers, seed=0)
    result = {"batch": n, "context": ctx, "layers": args.layers, **layer.compare(args.repeats)}
    row = layer.caches[0][0]
    kv_bytes = 2 * args.layers * n * ctx * args.kv_heads * row.shape[-1] * row.element_size()
    result["kernel_kv_gb_per_s"] = kv_bytes / result["kernel_ms"] * 1e3 / 1e9
    return result


def bench_prefill(args, dtype, prompts: int, length: int) -> dict:
    per_seq = blocks_for(length, args.block_size)
    seqs = [(list(range(i * per_seq, (i + 1) * per_seq)), 0, length) for i in range(prompts)]
    layer = _Layer(args, dtype, step_input(args.block_size, seqs), prompts * per_seq, 1, seed=1)
    return {"prompts": prompts, "length": length, **layer.compare(args.repeats)}


def _shape(text: str) -> tuple[int, int]:
    prompts, _, length = text.partition("x")
    return int(prompts), int(length)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
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
    if load_kernels() is None:
        raise SystemExit("the CPU kernels are not available here (no compiler, or KVSERVE_CPU_KERNELS=0)")
    dtype = getattr(torch, args.dtype)
    result = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "threads": torch.get_num_threads(),
              "decode": bench_decode(args, dtype),
              "prefill": [bench_prefill(args, dtype, *_shape(s)) for s in args.prefill]}
    d = result["decode"]
    print(f"dtype={args.dtype} kv_cache_dtype={args.kv_cache_dtype} threads={result['threads']} "
          f"heads={args.heads} kv_heads={args.kv_heads} "
          f"head_dim={args.head_dim}")
    print(f"decode, batch {d['batch']} x {d['context']} tokens, {d['layers']} layers: "
          f"kernel {d['kernel_ms']:.2f} ms "
          f"({d['kernel_kv_gb_per_s']:.1f} GB/s of K/V), torch ops {d['torch_ms']:.2f} ms: "
          f"{d['speedup']:.2f}x (max |diff| {d['max_abs_diff']:.4f})")
    for p in result["prefill"]:
        print(f"prefill, {p['prompts']} x {p['length']} tokens, one layer: kernel {p['kernel_ms']:.2f} ms, "
              f"torch SDPA {p['torch_ms']:.2f} ms: {p['speedup']:.2f}x (max |diff| {p['max_abs_diff']:.4f})")
    limit = cpu_attention.kernel_prefill_context(args.kv_cache_dtype)
    result["engine_prefill"] = ("kernel" if limit == cpu_attention.EVERY_CONTEXT else "SDPA" if limit == 0
                                else f"kernel up to {limit} tokens of context, SDPA beyond")
    print(f"the engine's prefill attention on this CPU: {result['engine_prefill']}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
