"""How attention heads are shared among tensor-parallel ranks (no processes needed)."""

import pytest

from kvserve.engine.distributed.parallel import divide, kv_head_shard


def test_kv_heads_are_split_when_there_are_enough():
    assert [kv_head_shard(6, r, 3) for r in range(3)] == [(2, 0), (2, 2), (2, 4)]
    assert [kv_head_shard(3, r, 3) for r in range(3)] == [(1, 0), (1, 1), (1, 2)]


def test_fewer_kv_heads_than_ranks_are_replicated_to_the_ranks_whose_queries_use_them():
    # 2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 hold head 1
    assert [kv_head_shard(2, r, 4) for r in range(4)] == [(1, 0), (1, 0), (1, 1), (1, 1)]


def test_shards_that_do_not_fit_are_refused_naming_the_sizes():
    with pytest.raises(
        ValueError, match=r"num_key_value_heads \(4\) must be divisible by tensor_parallel_size \(3\)"
    ):
        kv_head_shard(4, 0, 3)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(4\) must be a multiple of num_key_value_heads \(3\)"
    ):
        kv_head_shard(3, 0, 4)
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\)"):
        divide(9, 2, "num_attention_heads")
