"""How many tokens the KV cache holds with KV cache groups, against the same cache with every
layer full attention (docs/performance/kv_cache_groups.md). A count, not a timing: the engine's
own grouping (``group_layers``) sizes the blocks, and its block manager fills the cache with
sequences of one length, prefilled in chunks and committed as a step does, until the next chunk
no longer fits.

    python -m kvserve.benchmarks.instruments.kv_capacity          # a Gemma-3-1B-shaped cache

A block's bytes are the runner's (``ModelRunner.kv_block_bytes``): K and V of ``block_size``
tokens in each layer of a group, bfloat16 by default.
"""

from __future__ import annotations

import argparse

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.kv_cache.groups import group_layers
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence

GiB = 1 << 30


def layer_windows(layers: int, window: int | None, every: int) -> list[int | None]:
    """Gemma 3's pattern: every ``every``-th layer global, the others windowed (None: all full)."""
    return [None if window is None or (i + 1) % every == 0 else window for i in range(layers)]


def cache_blocks(windows: list[int | None], budget_bytes: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype_bytes: int) -> int:
    slots = group_layers(windows).num_slots
    return budget_bytes // (2 * slots * block_size * kv_heads * head_dim * dtype_bytes)


def fill(windows: list[int | None], num_blocks: int, block_size: int, length: int, chunk: int) -> int:
    """Sequences of ``length`` tokens the block manager holds at once (each prefilled in chunks of
    ``chunk`` tokens after the others are in)."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False,
                      windows=group_layers(windows).windows)
    held = 0
    while True:
        seq = Sequence(f"s{held}", [1] * length, SamplingParams())
        bm.admit(seq, bm.match_prefix(seq))  # (prefix caching off: no hit, a table per group)
        while seq.num_computed_tokens < length:
            n = min(chunk, length - seq.num_computed_tokens)
            if not bm.can_grow(seq, n):
                return held
            bm.grow(seq, n)
            seq.num_computed_tokens += n
            bm.commit(seq)
        held += 1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--every", type=int, default=6, help="every N-th layer is global (Gemma 3: 6)")
    ap.add_argument("--kv-cache-memory", type=float, default=EngineConfig.kv_cache_memory, help="GiB")
    ap.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    ap.add_argument("--dtype-bytes", type=int, default=2, help="2: bfloat16")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 32768])
    args = ap.parse_args(argv)
    budget = int(args.kv_cache_memory * GiB)
    shapes = {"groups": layer_windows(args.layers, args.window, args.every),
              "every layer full": layer_windows(args.layers, None, args.every)}
    blocks = {name: cache_blocks(w, budget, args.block_size, args.kv_heads, args.head_dim, args.dtype_bytes)
              for name, w in shapes.items()}
    print(f"{args.kv_cache_memory:g} GiB, {args.layers} layers, window {args.window} on all but every "
          f"{args.every}th, {args.kv_heads} KV head(s) of {args.head_dim}, blocks of {args.block_size}: "
          + ", ".join(f"{name} {n} blocks" for name, n in blocks.items()))
    print("| tokens per sequence | sequences (groups) | sequences (every layer full) | tokens held, ratio |")
    print("|---:|---:|---:|---:|")
    for length in args.lengths:
        held = {name: fill(windows, blocks[name], args.block_size, length, args.chunk)
                for name, windows in shapes.items()}
        ratio = held["groups"] / held["every layer full"] if held["every layer full"] else float("inf")
        print(f"| {length} | {held['groups']} | {held['every layer full']} | "
              f"{held['groups'] * length} vs {held['every layer full'] * length}, {ratio:.2f}x |")


if __name__ == "__main__":
    main()
