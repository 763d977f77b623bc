"""The compile table: which kernel, at which shape, with which launch configuration.

Every configuration comes from ``kvserve.kernels.triton.launch``, the functions the launchers
call, so the table compiles what the engine would launch. Shapes: head_dim 64, 128 and 256 with
query groups of 1, 2, 3, 4 and 8 heads per KV head (8 KV heads; SmolLM2 is 64/3, Qwen3-0.6B
128/2, Llama-3-8B 128/4, Qwen3-32B 128/8, Llama-2-7B 128/1), the cache block sizes 16 (the
default) and 32, bf16 and fp16 (and fp32 at the default model's shape, which the tests serve in
float32), and the expert shapes of the supported MoE models.

Each case also carries the work of a reference step for its roofline time: a decode of 64
sequences of 2048 keys (split 4 ways when split), a prefill of one 2048-token chunk, the KV store
of 2048 tokens, and the MoE layer at 64 tokens (decode) and 4096 (prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kernels.triton.launch import (
    Launch,
    decode_launch,
    kv_store_launch,
    moe_launch,
    prefill_launch,
    reduce_launch,
)

HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 2, 3, 4, 8)
BLOCK_SIZES = (16, 32)
DTYPES = ("bf16", "fp16")
ESIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
# (model, hidden, expert intermediate size, experts, experts per token)
MOE_MODELS = (
    ("Mixtral-8x7B", 4096, 14336, 8, 2),
    ("Qwen1.5-MoE-A2.7B", 2048, 1408, 60, 4),
    ("Qwen3-30B-A3B", 2048, 768, 128, 8),
)
MOE_TOKENS = (64, 4096)


@dataclass(frozen=True)
class Workload:
    """The step a roofline time is for (and that ``timing`` runs): a decode of ``decode_batch``
    sequences of ``context`` keys, split ``splits`` ways when split; a prefill of one chunk of
    ``context`` tokens; the KV store of ``context`` tokens; over ``kv_heads`` KV heads."""

    decode_batch: int = 64
    context: int = 2048
    splits: int = 4
    kv_heads: int = 8


REFERENCE = Workload()


@dataclass(frozen=True)
class Case:
    kernel: str  # the @triton.jit function's name in kvserve.kernels.triton
    shape: str
    dtype: str
    launch: Launch
    bytes_moved: float
    flops: float
    pointers: dict[str, str] = field(default_factory=dict)  # pointer argument -> element type
    recorded: int = -1  # fla-core's kernels: the index of the launch fla_kernels.record found


def _attention_pointers(dtype: str) -> dict[str, str]:
    return {
        "q_ptr": dtype,
        "k_cache_ptr": dtype,
        "v_cache_ptr": dtype,
        "out_ptr": dtype,
        "part_out_ptr": "fp32",
        "part_max_ptr": "fp32",
        "part_sum_ptr": "fp32",
        "block_tables_ptr": "i32",
        "seq_lens_ptr": "i32",
        "cu_seqlens_q_ptr": "i32",
        "work_ptr": "i32",
        "sinks_ptr": "fp32",
    }


def attention_cases(
    head_dim: int, group: int, block_size: int, dtype: str, w: Workload = REFERENCE
) -> list[Case]:
    """Decode (unsplit, split), its reduce, prefill and the KV store at one shape, in that order."""
    batch, context, splits, kv_heads = w.decode_batch, w.context, w.splits, w.kv_heads
    e, heads = ESIZE[dtype], kv_heads * group
    label = f"d{head_dim} g{group} kv{kv_heads} blk{block_size}"
    ptrs = _attention_pointers(dtype)
    kv_bytes = 2 * context * kv_heads * head_dim * e  # one sequence's K and V
    qo_bytes = 2 * heads * head_dim * e
    attn_flops = 4 * context * heads * head_dim  # q.k and p.v per key and head
    parts = batch * splits * heads * (head_dim + 2) * 4
    cases = [
        Case("_paged_decode_kernel", label, dtype, decode_launch(head_dim, group, block_size, False, True),
             batch * (kv_bytes + qo_bytes), batch * attn_flops, ptrs),
        Case("_paged_decode_kernel", label + " split", dtype,
             decode_launch(head_dim, group, block_size, True, True),
             batch * (kv_bytes + qo_bytes / 2) + parts, batch * attn_flops, ptrs),
        Case("_reduce_splits_kernel", f"d{head_dim} h{heads} splits{splits}", dtype,
             reduce_launch(head_dim),
             parts + batch * heads * head_dim * e, 0.0, ptrs),
        Case("_paged_prefill_kernel", label, dtype, prefill_launch(head_dim, group, block_size, True, e),
             kv_bytes + context * qo_bytes, context * attn_flops / 2, ptrs),
        # the sliding-window variants (their bound on key positions costs registers of its own)
        Case("_paged_decode_kernel", label + " window", dtype,
             decode_launch(head_dim, group, block_size, False, True, windowed=True),
             batch * (kv_bytes + qo_bytes), batch * attn_flops, ptrs),
        Case("_paged_prefill_kernel", label + " window", dtype,
             prefill_launch(head_dim, group, block_size, True, e, windowed=True),
             kv_bytes + context * qo_bytes, context * attn_flops / 2, ptrs),
    ]  # fmt: skip
    # Gemma 2's layers (a window and the soft cap) and gpt-oss's (a window and sinks), at their
    # groups (Gemma 2 2B/9B/27B: 2; gpt-oss: 8) with 16-token blocks in bf16
    variants = (("softcap", {"soft_cap": True}), ("sinks", {"sinks": True}))
    for name, variant in variants if group in (2, 8) and block_size == 16 and dtype == "bf16" else ():
        cases += [
            Case("_paged_decode_kernel", f"{label} window {name}", dtype,
                 decode_launch(head_dim, group, block_size, False, True, windowed=True, **variant),
                 batch * (kv_bytes + qo_bytes), batch * attn_flops, ptrs),
            Case("_paged_decode_kernel", f"{label} window {name} split", dtype,
                 decode_launch(head_dim, group, block_size, True, True, windowed=True, **variant),
                 batch * (kv_bytes + qo_bytes / 2) + parts, batch * attn_flops, ptrs),
            Case("_paged_prefill_kernel", f"{label} window {name}", dtype,
                 prefill_launch(head_dim, group, block_size, True, e, windowed=True, **variant),
                 kv_bytes + context * qo_bytes, context * attn_flops / 2, ptrs),
        ]  # fmt: skip
    cases.append(Case("_store_kv_kernel", f"d{head_dim} kv{kv_heads} blk{block_size}", dtype,
                          kv_store_launch(kv_heads, head_dim, block_size), 2 * kv_bytes, 0.0,
                          {"k_ptr": dtype, "v_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype,
                           "slot_mapping_ptr": "i64"}))  # fmt: skip
    return cases


def moe_cases(
    model: str, hidden: int, inter: int, experts: int, top_k: int, tokens: int, dtype: str
) -> list[Case]:
    """The two grouped GEMMs of one MoE layer (gate|up, then down with the routing weight)."""
    e, entries = ESIZE[dtype], tokens * top_k
    touched = min(experts, entries)
    label = f"{model} T{tokens}"
    out = []
    for name, n, k, kk, mul, c_type in (
        ("gate_up", 2 * inter, hidden, top_k, False, dtype),
        ("down", hidden, inter, 1, True, "fp32"),
    ):
        ptrs = {
            "a_ptr": dtype,
            "w_ptr": dtype,
            "c_ptr": c_type,
            "sorted_ids_ptr": "i64",
            "block_expert_ptr": "i64",
            "weights_ptr": "fp32",
        }
        weight_bytes = touched * n * k * e
        act_bytes = entries * (k * e + n * (4 if c_type == "fp32" else e))
        out.append(Case("_grouped_gemm_kernel", f"{label} {name}", dtype,
                        moe_launch(entries, kk, experts, mul, True), weight_bytes + act_bytes,
                        2.0 * entries * n * k, ptrs))  # fmt: skip
    return out


def full_table() -> list[Case]:
    cases = []
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for group in GROUPS:
                for block_size in BLOCK_SIZES:
                    cases += attention_cases(head_dim, group, block_size, dtype)
        for model in MOE_MODELS:
            for tokens in MOE_TOKENS:
                cases += moe_cases(*model, tokens, dtype)
    cases += attention_cases(64, 3, 16, "fp32")  # the default model (SmolLM2-135M) in float32
    return _unique(cases)


def quick_table() -> list[Case]:
    """The representative subset the default test suite compiles: every kernel at least once,
    the head_dim-128 attention kernels that spilled at four warps, the default model's shape in
    bf16 and fp32."""
    cases = attention_cases(128, 4, 16, "bf16")
    cases += [
        c for c in attention_cases(64, 3, 16, "bf16") if c.shape.endswith("blk16") and "store" not in c.kernel
    ]
    cases += [c for c in attention_cases(64, 3, 16, "fp32") if c.shape.endswith("split")]
    cases += moe_cases(*MOE_MODELS[2], MOE_TOKENS[0], "bf16")[:1]
    return _unique(cases)


def _unique(cases: list[Case]) -> list[Case]:
    """One case per compiled variant (the reduce and the store repeat across the loops)."""
    seen, out = set(), []
    for case in cases:
        key = (case.kernel, case.dtype, tuple(sorted(case.launch.kwargs().items())))
        if key not in seen:
            seen.add(key)
            out.append(case)
    return out
