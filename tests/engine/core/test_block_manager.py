"""Block manager: hash chain, collision guard, reference counts, LRU reuse, the fully cached prompt."""

from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.kv_cache.blocks import CLEARED, REMOVED, STORED, block_hash
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence

BS = 4


def make_seq(tokens, max_tokens=4):
    return Sequence(f"r{tokens[:3]}", list(tokens), SamplingParams(max_tokens=max_tokens))


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit with prefix hits, allocate the rest, pretend the KV got written, publish."""
    hits = bm.match_prefix(seq)
    bm.admit(seq, hits)
    bm.grow(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_hash_chains_over_the_previous_block():
    a = block_hash(None, [1, 2, 3, 4])
    assert block_hash(None, [1, 2, 3, 4]) == a
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(None, [0, 2, 3, 4]), [5, 6, 7, 8])


def test_shared_prefix_hits_and_refcounts():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(10)))
    run_prefill(bm, a)
    assert len(a.block_table) == 3
    b = make_seq(list(range(8)) + [99, 98, 97])
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    bm.admit(b, hits)
    assert b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    bm.check_integrity()
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16
    bm.check_integrity()


def test_hash_published_only_after_commit():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)))
    bm.admit(a, bm.match_prefix(a))
    bm.grow(a, a.num_tokens)
    # KV not written yet: nothing may hit
    assert bm.match_prefix(make_seq(list(range(9)))) == []
    a.num_computed_tokens = 4  # first chunk written
    bm.commit(a)
    assert bm.match_prefix(make_seq(list(range(9)))) == a.block_table[:1]


def test_collision_guard_requires_equal_tokens():
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    # forge a table entry: a different token block claiming the same hash
    h = block_hash(None, [9, 9, 9, 9])
    bm.hash_to_block[h] = a.block_table[0]
    bm.blocks[a.block_table[0]].hash = h
    assert bm.match_prefix(make_seq([9, 9, 9, 9, 1])) == []


def test_fully_cached_prompt_still_computes_one_token():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(8)))  # exactly two full blocks
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq(list(range(8)))
    hits = bm.match_prefix(b)
    assert len(hits) == 1  # the block holding the last token is never matched
    bm.admit(b, hits)
    assert b.num_computed_tokens == 4 < b.num_tokens


def test_freed_blocks_keep_hash_and_are_reused_lru_first():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)))  # 3 blocks
    run_prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)  # freed in reverse: suffix first
    # the hashless partial block goes to the head, the cached blocks to the tail (suffix first)
    assert list(bm.free_ids) == [table[2], 3, table[1], table[0]]
    # still hittable after free
    b = make_seq(list(range(9)))
    assert bm.match_prefix(b) == table[:2]
    # a new unrelated sequence takes a's hashless block, then the never-used one, then the LRU
    c = make_seq([50] * 9)
    bm.admit(c, [])
    bm.grow(c, 9)
    assert c.block_table == [table[2], 3, table[1]]
    # a's prefix block 0 survives: still a hit
    assert bm.match_prefix(make_seq(list(range(5)))) == table[:1]
    bm.check_integrity()


def test_reused_block_drops_stale_hash():
    bm = BlockManager(1, BS)
    a = make_seq([1, 2, 3, 4, 5])
    bm.admit(a, [])
    bm.grow(a, 4)
    a.num_computed_tokens = 4
    bm.commit(a)
    bm.free(a)
    b = make_seq([7, 7, 7, 7, 7])
    bm.admit(b, [])
    bm.grow(b, 1)  # takes the only block, which held a's hash
    assert bm.hash_to_block == {}
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == []
    bm.check_integrity()


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    run_prefill(bm, a)
    assert bm.match_prefix(make_seq(list(range(9)))) == []
    assert bm.hit_rate == 0.0


def test_hit_rate_counts_tokens():
    bm = BlockManager(8, BS)
    run_prefill(bm, make_seq(list(range(9))))
    run_prefill(bm, make_seq(list(range(9))))
    assert bm.query_tokens == 18 and bm.hit_tokens == 8


def test_hit_rate_does_not_count_recomputation_after_preemption():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)))
    run_prefill(bm, a)
    assert (bm.query_tokens, bm.hit_tokens) == (9, 0)
    bm.free(a)  # preempted: the scheduler frees it and counts the preemption
    a.num_preemptions += 1
    hits = bm.match_prefix(a)
    assert len(hits) == 2  # its own blocks are still cached: the recompute is cheap
    bm.admit(a, hits)
    assert (bm.query_tokens, bm.hit_tokens) == (9, 0)  # ...but no client asked for them twice
    assert bm.hit_rate == 0.0


def test_collision_guard_checks_the_parent_hash():
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    c = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])
    run_prefill(bm, a)
    run_prefill(bm, c)
    # forge a collision one level down: c's second-block hash now names a's second block,
    # which holds the same tokens but follows a different first block
    hc0 = block_hash(None, [9, 9, 9, 9])
    bm.hash_to_block[block_hash(hc0, [5, 6, 7, 8])] = a.block_table[1]
    assert bm.match_prefix(make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])) == c.block_table[:1]


def test_surviving_duplicate_block_is_registered_after_eviction():
    bm = BlockManager(6, BS)
    a = make_seq(list(range(9)))
    b = make_seq(list(range(9)))
    for seq in (a, b):  # both admitted before either published: two copies of each block
        bm.admit(seq, bm.match_prefix(seq))
        bm.grow(seq, seq.num_tokens)
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        bm.commit(seq)
    assert bm.match_prefix(make_seq(list(range(9)))) == a.block_table[:2]
    bm.check_integrity()
    a_table = list(a.block_table)
    bm.free(a)
    other = make_seq([50] * 9)
    bm.admit(other, [])
    bm.grow(other, 9)  # takes a's three freed blocks: its copies are evicted
    assert set(other.block_table) == set(a_table)
    bm.check_integrity()
    # b's copies survive and take over the table
    assert bm.match_prefix(make_seq(list(range(9)))) == b.block_table[:2]
    bm.free(b)
    bm.free(other)
    bm.check_integrity()


def test_blocks_with_nothing_cached_are_reused_before_untouched_ones():
    """The KV cache's pages take memory at first touch: a block that held no cacheable prefix
    is reused (most recently freed first) before a never-used one, so the memory touched stays
    at the working set; a block holding a cached prefix is evicted only after both."""
    for caching in (True, False):
        bm = BlockManager(64, BS, enable_prefix_caching=caching)
        touched: set[int] = set()
        for i in range(50):
            seq = make_seq([1000 + i] * 6)  # one full block (cached when caching is on), one partial
            run_prefill(bm, seq)
            touched.update(seq.block_table)
            bm.free(seq)
        # with caching on, each full block is new content that stays cached until needed
        assert len(touched) == (51 if caching else 2), (caching, len(touched))
        bm.check_integrity()


def test_kv_events_follow_the_hash_table():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)))  # two full blocks and a partial one
    run_prefill(bm, a)
    assert bm.take_kv_events() == []  # not collected until enabled
    bm.free(a)
    bm.kv_events = []
    a0 = block_hash(None, tuple(range(4)))
    a1 = block_hash(a0, tuple(range(4, 8)))
    b = make_seq(list(range(100, 109)))
    bm.admit(b, bm.match_prefix(b))
    bm.grow(b, b.num_tokens)
    # the partial block, the unused one, then a's least recently freed cached block: its hash goes
    assert bm.take_kv_events() == [(REMOVED, a1)]
    b.num_computed_tokens = b.num_tokens  # the KV is written: now b's full blocks are published
    bm.commit(b)
    b0 = block_hash(None, tuple(range(100, 104)))
    b1 = block_hash(b0, tuple(range(104, 108)))
    assert bm.take_kv_events() == [(STORED, b0, None, tuple(range(100, 104))),
                                   (STORED, b1, b0, tuple(range(104, 108)))]
    assert not bm.reset_prefix_cache()  # b still holds blocks
    bm.free(b)
    assert bm.reset_prefix_cache() and bm.take_kv_events() == [(CLEARED,)]
    assert bm.match_prefix(make_seq(list(range(100, 109)))) == []
    assert bm.match_prefix(make_seq(list(range(9)))) == []
    bm.check_integrity()


def test_a_duplicate_block_is_not_stored_twice():
    bm = BlockManager(8, BS)
    bm.kv_events = []
    a, b = make_seq(list(range(5))), make_seq(list(range(5)))
    for s in (a, b):  # both computed the same block before either published it
        bm.admit(s, bm.match_prefix(s))
        bm.grow(s, s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.commit(s)
    assert [e[0] for e in bm.take_kv_events()] == [STORED]


def test_cache_salt_shares_blocks_only_within_the_same_salt():
    bm = BlockManager(32, BS)
    tokens = list(range(1, 14))  # three full blocks before the last token's
    salted = Sequence("a", tokens, SamplingParams(max_tokens=4, cache_salt="tenant-a"))
    run_prefill(bm, salted)
    same = Sequence("b", tokens, SamplingParams(max_tokens=4, cache_salt="tenant-a"))
    assert bm.match_prefix(same) == salted.block_table[:3]
    for other in (None, "tenant-b", ""):  # unsalted, another salt, and the empty salt all miss
        assert bm.match_prefix(Sequence("c", tokens, SamplingParams(max_tokens=4, cache_salt=other))) == []
    plain = make_seq(tokens)
    run_prefill(bm, plain)
    assert bm.match_prefix(make_seq(tokens)) == plain.block_table[:3]
    assert bm.match_prefix(Sequence("d", tokens, SamplingParams(max_tokens=4, cache_salt="tenant-b"))) == []
    bm.check_integrity()



def test_a_free_cached_block_zero_counts_as_taken_when_admitted():
    """Without a window group block 0 is an ordinary block: a prefix hit on it while it is free
    takes a free block, so admission counts it (it once did not, and the sequence's next block
    then found the pool empty)."""
    bm = BlockManager(2, BS)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    assert a.block_table[0] == 0
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 6, 7, 8, 9, 10])
    hits = bm.match_prefix(b)
    assert hits == [0] and bm.num_free_blocks == 2
    assert bm.can_admit(b, hits, 4)  # block 0 and one fresh block: two of two
    assert not bm.can_admit(b, hits, 5)  # block 0 and two fresh blocks: three of two
