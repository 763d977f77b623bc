"""The mixture-of-experts layer: routing, the grouped CPU path and the Triton kernel against a
per-token reference written here, and the loading of per-expert checkpoint tensors (also the
tensor-parallel slices).

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET before kvserve.kernels is imported); on a GPU the same tests run it compiled.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.moe import (
    ExpertNames,
    FusedExperts,
    SparseMoeBlock,
    grouped_experts,
    select_experts,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
E, H, INTER = 8, 32, 24  # experts, hidden, expert intermediate size


def reference_moe(x, w13, w2, topk_weights, topk_ids):
    """Token by token, expert by expert, in float32: what the layer must compute."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for weight, expert in zip(topk_weights[t].tolist(), topk_ids[t].tolist(), strict=True):
            gate, up = (w13[expert].float() @ x[t].float()).chunk(2)
            out[t] += weight * (w2[expert].float() @ (torch.nn.functional.silu(gate) * up))
    return out


def expert_weights(dtype, seed=0, num_experts=E):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, H, generator=gen) * 0.2
    w2 = torch.randn(num_experts, H, INTER, generator=gen) * 0.2
    return w13.to(dtype), w2.to(dtype)


def routing(case: str, num_tokens: int, top_k: int, seed=0):
    """(weights, ids) [T, top_k]: random, every token on the same experts, or experts 5..7 unused."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, E, generator=gen)
    if case == "all_same":
        logits[:, 3] += 100.0
        logits[:, 6] += 50.0
    elif case == "some_unused":
        logits[:, 5:] -= 100.0
    weights, ids = select_experts(logits, top_k, renormalize=True)
    if case == "all_same":
        assert (ids[:, 0] == 3).all() and (top_k == 1 or (ids[:, 1] == 6).all())
    if case == "some_unused":
        assert ids.max() < 5
    return weights, ids


CASES = ["random", "all_same", "some_unused"]


def test_top_k_weights_are_renormalised_only_when_the_checkpoint_says_so():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.5, 0.0, 3.0, 0.0]])
    probs = logits.softmax(-1)
    raw, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 2], [2, 0]]
    torch.testing.assert_close(raw[0], probs[0, [0, 2]])
    normed, same_ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(ids, same_ids) and raw.dtype == normed.dtype == torch.float32
    torch.testing.assert_close(normed.sum(-1), torch.ones(2))
    torch.testing.assert_close(normed[0], raw[0] / raw[0].sum())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_grouped_cpu_path_matches_the_per_token_reference(case, top_k):
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(1))
    w13, w2 = expert_weights(torch.float32)
    weights, ids = routing(case, 13, top_k)
    got = grouped_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, reference_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_experts_without_tokens_are_never_computed():
    """Unused experts hold NaN: a dense every-expert-on-every-token path would spread it."""
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    w13, w2 = expert_weights(torch.float32)
    weights, ids = routing("some_unused", 9, 2)
    want = reference_moe(x, w13, w2, weights, ids)
    w13[5:], w2[5:] = float("nan"), float("nan")
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)


def test_moe_block_with_every_token_routed_to_one_expert_is_that_experts_mlp():
    block = SparseMoeBlock(H, E, top_k=1, intermediate_size=INTER, renormalize=True,
                           parallel=ParallelContext())
    w13, w2 = expert_weights(torch.float32)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[4] = 1.0  # positive inputs: expert 4's logit is their sum, the others 0
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
        block.experts.gate_up_proj[:4] = float("nan")
        block.experts.gate_up_proj[5:] = float("nan")
    x = torch.rand(6, H, generator=torch.Generator().manual_seed(3)) + 0.1
    gate, up = (x @ w13[4].T).chunk(2, dim=-1)
    torch.testing.assert_close(block(x), (torch.nn.functional.silu(gate) * up) @ w2[4].T)


# ---------------------------------------------------------------- the Triton kernel

triton = pytest.importorskip("triton", reason="triton is not installed (the dev and gpu extras bring it)")


def test_alignment_gives_each_block_one_expert_and_every_entry_one_row():
    from kvserve.kernels.triton.fused_moe import align_by_expert

    ids = torch.tensor([[3, 1], [3, 0], [1, 3], [7, 3]])
    sorted_ids, block_expert = align_by_expert(ids, num_experts=8, block_m=4)
    n = ids.numel()
    assert sorted_ids.numel() % 4 == 0 and block_expert.numel() == sorted_ids.numel() // 4
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))
    flat = ids.flatten()
    for block, expert in enumerate(block_expert.tolist()):
        rows = sorted_ids[block * 4 : (block + 1) * 4]
        rows = rows[rows < n]
        if expert < 8:
            assert (flat[rows] == expert).all()
        else:
            assert rows.numel() == 0  # past the padded end
    assert block_expert.tolist()[:5] == [0, 1, 3, 7, 8]  # expert 3 has four entries: one full block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_tokens", [1, 21])
def test_triton_kernel_matches_the_grouped_cpu_path(dtype, case, num_tokens):
    from kvserve.kernels.triton.fused_moe import fused_moe

    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(4)).to(dtype)
    w13, w2 = expert_weights(dtype)
    weights, ids = routing(case, num_tokens, 2)
    want = grouped_experts(x, w13, w2, weights, ids)
    got = fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids))).cpu()
    assert got.dtype == dtype and got.shape == (num_tokens, H)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_triton_kernel_refuses_mismatched_shapes():
    from kvserve.kernels.triton.fused_moe import fused_moe

    w13, w2 = expert_weights(torch.float32)
    weights, ids = routing("random", 3, 2)
    with pytest.raises(ValueError, match=r"w2 must be \[8, 32, 24\]"):
        fused_moe(torch.zeros(3, H), w13, w2[:, :, :5], weights, ids)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 32\]"):
        fused_moe(torch.zeros(3, 7), w13, w2, weights, ids)


# ---------------------------------------------------------------- loading expert weights


def per_expert_checkpoint(w13, w2, prefix="layers.0.mlp.experts", names=ExpertNames()):
    """Checkpoint-named tensors of each expert, as Hugging Face Hub checkpoints store them."""
    gate, up = w13.chunk(2, dim=1)
    for e in range(w13.shape[0]):
        yield names.route(f"{prefix}.{e}.{names.gate}.weight")[0], (e, "gate"), gate[e]
        yield names.route(f"{prefix}.{e}.{names.up}.weight")[0], (e, "up"), up[e]
        yield names.route(f"{prefix}.{e}.{names.down}.weight")[0], (e, "down"), w2[e]


def test_expert_names_route_checkpoint_tensors_onto_the_fused_parameters():
    mixtral = ExpertNames("w1", "w3", "w2")
    fused = "model.layers.2.mlp.experts"
    assert mixtral.route(f"{fused}.7.w3.weight") == (f"{fused}.gate_up_proj", (7, "up"))
    assert mixtral.route(f"{fused}.0.w2.weight") == (f"{fused}.down_proj", (0, "down"))
    assert mixtral.route("model.layers.2.mlp.gate.weight") is None
    assert ExpertNames().route("model.layers.0.mlp.gate_proj.weight") is None  # a dense MLP
    assert mixtral.checkpoint_name("model.layers.2.mlp.experts.down_proj", 5, "down") == \
        "model.layers.2.mlp.experts.5.w2.weight"


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_holds_every_experts_slice_of_the_intermediate_dim(rank):
    w13, w2 = expert_weights(torch.float32)
    experts = FusedExperts(E, H, INTER, ParallelContext(rank=rank, size=2))
    for _, shard, tensor in per_expert_checkpoint(w13, w2):
        param = experts.down_proj if shard[1] == "down" else experts.gate_up_proj
        param.weight_loader(param, tensor, shard)
    half = slice(rank * INTER // 2, (rank + 1) * INTER // 2)
    gate, up = w13.chunk(2, dim=1)
    assert torch.equal(experts.gate_up_proj, torch.cat([gate[:, half], up[:, half]], dim=1))
    assert torch.equal(experts.down_proj, w2[:, :, half])


def test_tensor_parallel_partial_sums_add_up_to_the_unsharded_layer():
    w13, w2 = expert_weights(torch.float32)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(6))
    weights, ids = routing("random", 7, 2)
    total = torch.zeros(7, H)
    for rank in range(2):
        experts = FusedExperts(E, H, INTER, ParallelContext(rank=rank, size=2))
        for _, shard, tensor in per_expert_checkpoint(w13, w2):
            param = experts.down_proj if shard[1] == "down" else experts.gate_up_proj
            param.weight_loader(param, tensor, shard)
        total += experts(x, weights, ids)
    torch.testing.assert_close(total, reference_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_an_intermediate_size_that_tensor_parallel_cannot_split_is_refused():
    with pytest.raises(ValueError, match=r"moe intermediate size \(24\) must be divisible by "
                                         r"tensor_parallel_size \(5\)"):
        FusedExperts(E, H, INTER, ParallelContext(rank=0, size=5))
