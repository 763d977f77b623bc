"""The block manager's KV cache groups: a window group gives back the blocks behind its window,
prefix hits need each group's blocks, forks share what every group still holds; and end to end
on Ministral (window, full and window layers), the counters through a long generation."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.kv_cache.groups import NULL_BLOCK, window_blocks_bound
from kvserve.engine.sampling_params import SamplingParams as Params
from kvserve.engine.sequence import Sequence
from kvserve.testing.random_model import make_config, write_model_dir

BS, W = 4, 8


def admitted(bm: BlockManager, tokens: list[int]) -> Sequence:
    seq = Sequence("r", tokens, Params())
    bm.admit(seq, bm.match_prefix(seq))
    return seq


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """A step computing ``n`` more tokens of ``seq``, then its commit."""
    bm.grow(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)


def test_window_group_gives_back_the_blocks_behind_its_window():
    bm = BlockManager(40, BS, windows=(W, None))
    assert bm.num_blocks == 39  # the null block is reserved
    seq = admitted(bm, list(range(60)))
    compute(bm, seq, 30)  # a prefill chunk: the next token (30) sees keys 23.. -> blocks 5..
    assert seq.block_tables[0][:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in seq.block_tables[0][5:]
    assert bm.blocks_held(seq, 0) == 3 and bm.blocks_held(seq, 1) == 8
    for _ in range(30):
        compute(bm, seq, 1)
        assert bm.blocks_held(seq, 0) <= window_blocks_bound(W, BS)
        bm.check_integrity()
    assert bm.blocks_held(seq, 1) == 15
    bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


def test_a_prefix_hit_needs_only_the_window_s_blocks_of_a_window_group():
    bm = BlockManager(40, BS, windows=(W, None))
    first = admitted(bm, list(range(30)))
    compute(bm, first, 30)
    bm.free(first)
    seq = Sequence("r", list(range(30)) + [7, 7], Params())
    hits = bm.match_prefix(seq)  # 7 full blocks; the window group freed blocks 0..4 but keeps 5, 6
    assert len(hits) == 7 and hits.groups[0][:5] == [NULL_BLOCK] * 5
    assert hits.groups[1] == first_full_table(bm, seq, 7)
    bm.admit(seq, hits)
    assert seq.num_computed_tokens == 28 and bm.blocks_held(seq, 0) == 2
    bm.check_integrity()
    # the window's blocks gone (taken by others) and the hit falls back to what is still whole
    other = Sequence("o", list(range(1000, 1100)), Params())
    bm.grow(other, bm.num_free_blocks // 2 * BS)
    late = Sequence("l", list(range(30)) + [9], Params())
    assert len(bm.match_prefix(late)) <= 7


def first_full_table(bm, seq, n):
    return [bm.hash_tables[1][h] for h in bm.hash_chain(seq, n)]


def test_a_window_group_hit_without_its_window_s_blocks_is_cut_back():
    """The window group lost its last two full blocks' hashes (blocks 5, 6): a hit of 7 or 6 blocks
    would need them, one of 5 needs only blocks 3 and 4, which it freed with their hashes kept."""
    bm = BlockManager(40, BS, windows=(W, None))
    first = admitted(bm, list(range(30)))
    compute(bm, first, 30)
    for bid in first.block_tables[0][5:7]:  # the window group loses the hashes of its blocks 5 and 6
        bm.hash_tables[0].pop(bm.blocks[bid].hash)
    bm.free(first)
    hits = bm.match_prefix(Sequence("r", list(range(30)) + [1], Params()))
    assert len(hits) == 5 and hits.groups[0][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in hits.groups[0][3:]


def test_fork_shares_what_every_group_still_holds():
    bm = BlockManager(40, BS, windows=(W, None))
    parent = admitted(bm, list(range(30)))
    compute(bm, parent, 30)
    shared = bm.shared_prefix(parent, 7)
    assert len(shared) == 7 and shared.groups[0][5:] == parent.block_tables[0][5:7]
    compute(bm, parent, 1)
    for _ in range(12):  # decoding on: the window leaves columns 5 and 6 behind
        compute(bm, parent, 1)
    assert len(bm.shared_prefix(parent, 7)) < 7


@pytest.fixture(scope="module")
def ministral(tmp_path_factory) -> str:
    return str(write_model_dir(make_config("ministral-tiny"), tmp_path_factory.mktemp("ministral"),
                               dtype=torch.float32))


def test_window_layers_hold_their_window_through_a_long_generation_and_give_everything_back(ministral):
    llm = LLM(ministral, dtype="float32", device="cpu", block_size=BS, num_kv_blocks=64,
              max_num_batched_tokens=16, max_num_seqs=4)
    try:
        engine, bm = llm.engine, llm.engine.block_manager
        assert bm.windows == (W, W, None)
        bound = window_blocks_bound(W, BS)
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        engine.add_request("long", list(range(100, 131)), params)
        engine.add_request("aborted", list(range(200, 240)), params)
        steps = 0
        while engine.scheduler.has_unfinished():
            engine.step()
            steps += 1
            for seq in engine.scheduler.running:
                if seq.num_computed_tokens >= seq.num_prompt_tokens:  # decoding
                    assert bm.blocks_held(seq, 0) <= bound and bm.blocks_held(seq, 1) <= bound
                    assert bm.blocks_held(seq, 2) == len(seq.block_tables[2])  # the full group keeps all
            if steps == 10:
                engine.abort("aborted")
            bm.check_integrity()
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.shutdown()
