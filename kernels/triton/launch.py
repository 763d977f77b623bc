"""Launch configurations of the Triton kernels: tile sizes, ``num_warps`` and ``num_stages``.

One function per kernel, read both by its launcher (``paged_attention``, ``kv_store``,
``fused_moe``) and by the compile check (``python -m kvserve.benchmarks.gpu_compile``), which
compiles every configuration for sm_80, sm_89 and sm_90 and fails on a register spill or on too
much shared memory; the two cannot drift apart. Pure Python: no torch, no Triton.

``on_gpu`` False is the CPU interpreter's configuration: small tiles keep it fast at test shapes,
and tl.dot runs in float32 there (the interpreter multiplies bfloat16 operands of tl.dot as raw
16-bit integers, triton 3.9). On a GPU every tl.dot dimension is at least 16.

The choices come from the compile table (docs/performance/gpu_compile.md), which is spill-free on
every target with them: 8 warps from head_dim 128 on (4 spilled in prefill, and in every kernel
compiled without the JIT's alignment specialization); prefill keeps 2 stages from head_dim 128
on, decode from 256 on (3 spilled on sm_89, or overflowed its shared memory); 32-key tiles from
head_dim 256 on and in float32 prefill (whose tl.dot runs on FMA units).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SPLITS = 16  # decode splits per sequence at most; also the reduce kernel's split tile


@dataclass(frozen=True)
class Launch:
    """A kernel's compile-time arguments and its launch options."""

    constexprs: dict[str, int | bool] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3  # Triton's default on CUDA

    def options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def kwargs(self) -> dict[str, int | bool]:
        """Keywords for ``kernel[grid](..., **launch.kwargs())``."""
        return {**self.constexprs, **self.options()}


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def d_pad(head_dim: int) -> int:
    """The head dimension padded to a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(head_dim))


def attention_block_n(head_dim: int, on_gpu: bool) -> int:
    """Keys per tile of the attention kernels (independent of the cache's block size): 64 on a
    GPU, 32 from head_dim 256 on (64 x 256 tiles spill and overflow sm_89's shared memory)."""
    if not on_gpu:
        return 16
    return 32 if d_pad(head_dim) >= 256 else 64


def attention_stages(head_dim: int, prefill: bool) -> int:
    """Software-pipelining depth of the key loop (K/V tiles in flight in shared memory): 2 from
    head_dim 256 on, and for prefill from 128 on (3 spilled 16 B on sm_89), else 3."""
    return 2 if d_pad(head_dim) >= (128 if prefill else 256) else 3


def attention_warps(head_dim: int, on_gpu: bool) -> int:
    """Four warps up to head_dim 64; eight from 128 on, where four spill (see the module doc)."""
    return 8 if on_gpu and d_pad(head_dim) >= 128 else 4


def prefill_tile(on_gpu: bool, group: int) -> dict[str, int]:
    """A prefill tile's rows (query tokens x the group's heads, padded to a power of two) and the
    tokens it covers. Bigger tiles pay on a GPU, smaller ones keep the interpreter fast."""
    group_pad = next_power_of_2(group)
    block_m = max(64 if on_gpu else 16, group_pad)
    return {"GROUP_PAD": group_pad, "TOKENS_PER_TILE": block_m // group_pad, "BLOCK_M": block_m}


def decode_launch(head_dim: int, group: int, block_size: int, split: bool, on_gpu: bool,
                  windowed: bool = False, soft_cap: bool = False, sinks: bool = False) -> Launch:
    """``_paged_decode_kernel``: rows are the group's query heads (padded to >= 16); ``windowed``,
    ``soft_cap``, ``sinks``: the variants (each a constexpr)."""
    return Launch(
        constexprs={
            "GROUP": group, "BLOCK_M": max(16, next_power_of_2(group)),
            "BLOCK_N": attention_block_n(head_dim, on_gpu), "BLOCK_SIZE": block_size, "HEAD_DIM": head_dim,
            "D_PAD": d_pad(head_dim), "SPLIT": split, "UPCAST_DOT": not on_gpu, "WINDOWED": windowed,
            "SOFTCAP": soft_cap, "SINKS": sinks,
        },
        num_warps=attention_warps(head_dim, on_gpu),
        num_stages=attention_stages(head_dim, prefill=False),
    )  # fmt: skip


def reduce_launch(head_dim: int) -> Launch:
    """``_reduce_splits_kernel``: one program per (sequence, head) over ``MAX_SPLITS`` partials."""
    return Launch(
        constexprs={"HEAD_DIM": head_dim, "D_PAD": d_pad(head_dim), "SPLITS_PAD": MAX_SPLITS},
        num_warps=4,
        num_stages=1,
    )


def prefill_launch(head_dim: int, group: int, block_size: int, on_gpu: bool,
                   element_bytes: int = 2, windowed: bool = False, soft_cap: bool = False,
                   sinks: bool = False) -> Launch:
    """``_paged_prefill_kernel``: a tile of (query token, group head) rows per program. In float32
    (``element_bytes`` 4) tl.dot runs on FMA units, not tensor cores, and 4 warps over 64-key tiles
    spilled kilobytes: 8 warps over 32-key tiles."""
    fp32 = on_gpu and element_bytes >= 4
    # the window's bound on key positions: 64-key tiles of head_dim 128 spilled 8 B on sm_89
    narrow = fp32 or (on_gpu and windowed and d_pad(head_dim) >= 128)
    return Launch(
        constexprs={
            "GROUP": group, **prefill_tile(on_gpu, group),
            "BLOCK_N": 32 if narrow else attention_block_n(head_dim, on_gpu),
            "BLOCK_SIZE": block_size, "HEAD_DIM": head_dim, "D_PAD": d_pad(head_dim),
            "UPCAST_DOT": not on_gpu, "WINDOWED": windowed, "SOFTCAP": soft_cap, "SINKS": sinks,
        },
        num_warps=8 if fp32 else attention_warps(head_dim, on_gpu),
        num_stages=attention_stages(head_dim, prefill=True),
    )  # fmt: skip


def kv_store_launch(kv_heads: int, head_dim: int, block_size: int) -> Launch:
    """``_store_kv_kernel``: one token's ``kv_heads * head_dim`` values per program."""
    width = kv_heads * head_dim
    width_pad = next_power_of_2(width)
    return Launch(
        constexprs={"BLOCK_SIZE": block_size, "WIDTH": width, "WIDTH_PAD": width_pad},
        num_warps=4,
        num_stages=1,
    )


def moe_launch(num_entries: int, top_k: int, num_experts: int, mul_weight: bool, on_gpu: bool) -> Launch:
    """``_grouped_gemm_kernel``: bigger row blocks pay once an expert has many entries (prefill);
    decode keeps them small so that little of a block is padding."""
    if on_gpu:
        tile = {"BLOCK_M": 64 if num_entries >= 1024 else 16, "BLOCK_N": 64, "BLOCK_K": 64}
    else:
        tile = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
    return Launch(
        constexprs={"TOP_K": top_k, "NUM_EXPERTS": num_experts, "MUL_WEIGHT": mul_weight,
                    "UPCAST_DOT": not on_gpu, **tile},
        num_warps=4,
        num_stages=3,
    )  # fmt: skip
