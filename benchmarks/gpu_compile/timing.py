"""Measured against expected: each kernel the compile table's quick subset holds, run through its
launcher on this machine at the table's reference step, beside its H200 roofline time.

``python -m kvserve.benchmarks.gpu_compile.timing`` (benchmarks/gpu_check.sh's ``timing`` step).
On a GPU the times are ``triton.testing.do_bench``'s; on a CPU (``--smoke``: a small step, Triton's
interpreter) they only show that every launcher runs, the expected column is still the H200's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvserve.benchmarks.gpu_compile.shapes import MOE_MODELS, REFERENCE, Workload, attention_cases
from kvserve.benchmarks.gpu_compile.targets import roofline_us

SMOKE = Workload(decode_batch=2, context=64, splits=2, kv_heads=2)
# (head_dim, group, block_size) of the rows timed: Llama-3-8B's attention and the default model's
ATTENTION = ((128, 4, 16), (64, 3, 16))


def _timer(device):
    """do_bench on a GPU (microseconds); one run on the CPU, where only the plumbing counts."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn) * 1e3

    def once(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    return once


def attention_rows(head_dim, group, block_size, dtype, w: Workload, device) -> list[tuple[str, float, float]]:
    """(label, measured us, roofline us) of decode, split decode (with its reduce), prefill, store."""
    import torch

    from kvserve.kernels import paged_decode_attention, paged_prefill_attention, store_kv_cache

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    heads, blocks_per_seq = w.kv_heads * group, -(-w.context // block_size)
    num_blocks = w.decode_batch * blocks_per_seq
    cache = [torch.randn(num_blocks, block_size, w.kv_heads, head_dim, device=device).to(torch_dtype)
             for _ in range(2)]  # fmt: skip
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(w.decode_batch, blocks_per_seq)
    lens = torch.full((w.decode_batch,), w.context, dtype=torch.int32, device=device)
    q = torch.randn(w.decode_batch, heads, head_dim, device=device).to(torch_dtype)
    q_chunk = torch.randn(w.context, heads, head_dim, device=device).to(torch_dtype)
    cu = torch.tensor([0, w.context], dtype=torch.int32, device=device)
    k_new = torch.randn(w.context, w.kv_heads, head_dim, device=device).to(torch_dtype)
    slots = (tables[0, :, None] * block_size + torch.arange(block_size, device=device)).flatten()[: w.context]
    scale = head_dim**-0.5
    cases = attention_cases(head_dim, group, block_size, dtype, w)
    expected = [roofline_us(c.bytes_moved, c.flops) for c in cases]  # decode, split, reduce, prefill, store
    bench = _timer(device)
    label = cases[0].shape + " " + dtype
    return [
        (f"decode {label}", bench(lambda: paged_decode_attention(q, *cache, tables, lens, scale)),
         expected[0]),
        (f"decode split {w.splits} + reduce {label}",
         bench(lambda: paged_decode_attention(q, *cache, tables, lens, scale, num_splits=w.splits)),
         expected[1] + expected[2]),
        (f"prefill {w.context} {label}",
         bench(lambda: paged_prefill_attention(q_chunk, *cache, cu, lens[:1], tables[:1], scale)),
         expected[3]),
        (f"kv store {w.context} {label}", bench(lambda: store_kv_cache(k_new, k_new, *cache, slots)),
         expected[4]),
    ]  # fmt: skip


def moe_row(tokens: int, dtype: str, device, scale_down: int = 1) -> tuple[str, float, float]:
    """The fused MoE layer of the table's smallest-expert model (both grouped GEMMs)."""
    import torch

    from kvserve.benchmarks.gpu_compile.shapes import moe_cases
    from kvserve.kernels.triton.fused_moe import fused_moe

    model, hidden, inter, experts, top_k = MOE_MODELS[-1]
    hidden, inter, experts = hidden // scale_down, inter // scale_down, max(top_k, experts // scale_down)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    x = torch.randn(tokens, hidden, device=device).to(torch_dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) * 0.02).to(torch_dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) * 0.02).to(torch_dtype)
    weights, ids = torch.rand(tokens, experts, device=device).softmax(-1).topk(top_k, dim=-1)
    expected = sum(roofline_us(c.bytes_moved, c.flops)
                   for c in moe_cases(model, hidden, inter, experts, top_k, tokens, dtype))  # fmt: skip
    measured = _timer(device)(lambda: fused_moe(x, w13, w2, weights, ids))
    return (f"fused MoE {model} H{hidden} I{inter} E{experts} T{tokens} {dtype}", measured, expected)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.benchmarks.gpu_compile.timing", description=__doc__
    )
    parser.add_argument("--smoke", action="store_true", help="a small step under the interpreter (CPU)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        print("no CUDA device: pass --smoke to run the small step on the CPU", file=sys.stderr)
        return 2
    w, dtype = (SMOKE, "fp32") if args.smoke else (REFERENCE, "bf16")
    torch.manual_seed(0)
    rows = []
    for head_dim, group, block_size in ATTENTION[1:] if args.smoke else ATTENTION:
        rows += attention_rows(head_dim, group, block_size, dtype, w, device)
    rows.append(moe_row(8, dtype, device, scale_down=16) if args.smoke else moe_row(64, dtype, device))
    print(f"| kernel ({device.type}) | measured us | expected us (H200 roofline) | measured / expected |")
    print("|---|---|---|---|")
    for label, measured, expected in rows:
        print(f"| {label} | {measured:.1f} | {expected:.2f} | {measured / expected:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
