"""What the fair policy's preemptions cost in recomputed tokens, counted in a deterministic scheduler
simulation of the tenants benchmark's workload (benchmarks/tenants: a flood of long same-prompt choices
filling every slot, an interactive tenant sending short requests one after another), no timing.

With prefix caching a preempted sequence's full blocks (its prompt and the tokens it generated,
published as they filled) stay in the cache, and its re-admission hits them: it recomputes only its
last, partial block, at most ``block_size`` tokens, under either policy and also when blocks run
short. docs/performance/tenants.md has the counts."""

from collections import Counter

import pytest

from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence, Tenancy
from kvserve.engine.tenancy.shares import TenantShares

BS, PROMPT, TOKENS, SEQS, INTERACTIVE = 4, 64, 64, 16, 10


def simulate(policy: str, num_blocks: int, caching: bool = True) -> tuple[int, Counter, Counter]:
    """(preemptions, tokens recomputed per tenant, tokens computed per tenant) of the whole workload.
    A token is recomputed when a step computes a position of a sequence that an earlier step computed."""
    s = Scheduler(BlockManager(num_blocks, BS, caching), SEQS, 128, PROMPT + TOKENS + 8, [0],
                  shares=TenantShares(policy))
    prompt = list(range(1000, 1000 + PROMPT))  # one prompt, as the n choices of a flood call share
    for i in range(SEQS):
        s.add(Sequence(f"flood-{i}", list(prompt), SamplingParams(max_tokens=TOKENS, ignore_eos=True),
                       Tenancy("flood")))
    reached: dict[int, int] = {}
    recomputed, computed = Counter(), Counter()
    sent, current, steps = 0, None, 0
    while s.has_unfinished():
        if steps >= 16 and sent < INTERACTIVE and (current is None or current.is_finished):
            current = Sequence(f"interactive-{sent}", [5, 6, 7, 8] * 6,
                               SamplingParams(max_tokens=8, ignore_eos=True), Tenancy("interactive"))
            s.add(current)
            sent += 1
        out = s.schedule()
        for x in out.scheduled:
            seq, start = x.seq, x.seq.num_computed_tokens
            before = reached.get(seq.seq_id, 0)
            recomputed[seq.tenancy.tenant] += max(0, min(start + x.num_tokens, before) - start)
            computed[seq.tenancy.tenant] += x.num_tokens
            reached[seq.seq_id] = max(before, start + x.num_tokens)
        s.postprocess(out, [7] * len(out.sampling_seqs))
        steps += 1
    s.bm.check_integrity()
    assert s.bm.num_free_blocks == num_blocks
    return s.num_preemptions, recomputed, computed


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
@pytest.mark.parametrize("num_blocks", [1024, 200])  # ample; short (preemptions for blocks)
def test_a_preempted_sequence_recomputes_at_most_its_last_partial_block(policy, num_blocks):
    preemptions, recomputed, computed = simulate(policy, num_blocks)
    if policy == "fair" or num_blocks < 1024:
        assert preemptions >= 1  # the interactive tenant's request, or the blocks, made one give way
    assert recomputed["flood"] <= preemptions * BS, (preemptions, recomputed)
    assert recomputed["interactive"] == 0
    assert computed["interactive"] > 0


def test_without_prefix_caching_a_preempted_flood_sequence_recomputes_its_whole_prompt():
    preemptions, recomputed, _ = simulate("fair", 1024, caching=False)
    assert preemptions >= 1 and recomputed["flood"] >= preemptions * PROMPT
