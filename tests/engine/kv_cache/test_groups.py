"""How layers form KV cache groups, and the window arithmetic of their blocks."""

import pytest

from kvserve.engine.kv_cache.groups import first_live_block, group_layers, peak_blocks, window_blocks_bound


def gemma3_windows(layers=26, window=512, every=6):
    return [None if (i + 1) % every == 0 else window for i in range(layers)]


def test_one_spec_is_one_group_of_every_layer():
    groups = group_layers([None] * 5)
    assert groups.windows == (None,) and groups.num_slots == 5
    assert groups.layer_groups == (0,) * 5 and groups.layer_slots == (0, 1, 2, 3, 4)
    assert not groups.has_window and group_layers([8, 8]).windows == (8,)


def test_gemma3_layers_form_equal_groups_without_padding():
    """4 global and 22 window layers: groups of 2 layers (4 would pad 2 slots), 2 + 11 groups."""
    groups = group_layers(gemma3_windows())
    assert groups.num_slots == 2
    assert groups.windows == (512,) * 11 + (None,) * 2
    assert [groups.layer_groups[i] for i in (5, 11, 17, 23)] == [11, 11, 12, 12]
    assert [groups.layer_slots[i] for i in (5, 11, 17, 23)] == [0, 1, 0, 1]
    slots = list(zip(groups.layer_groups, groups.layer_slots, strict=True))
    assert sorted(slots) == [(g, s) for g in range(13) for s in (0, 1)]  # each group fills its 2 slots


def test_interleaved_window_and_full_layers():
    groups = group_layers([8, None, 8])
    assert groups.windows == (8, 8, None)  # specs in order of first appearance
    assert groups.num_slots == 1 and groups.layer_groups == (0, 2, 1)


def test_a_model_without_attention_layers_is_refused():
    with pytest.raises(ValueError, match="no attention layer"):
        group_layers([])


@pytest.mark.parametrize(("computed", "want"), [(0, 0), (7, 0), (8, 0), (9, 0), (11, 1), (12, 1), (40, 8)])
def test_first_live_block_is_that_of_the_next_query_s_first_key(computed, want):
    assert first_live_block(computed, 8, 4) == want  # window 8, blocks of 4
    assert first_live_block(computed, None, 4) == 0


def test_peak_blocks_counts_full_groups_whole_and_window_groups_to_their_window():
    assert window_blocks_bound(8, 4) == 3 and window_blocks_bound(9, 4) == 4
    assert peak_blocks([None], 100, 16, 4) == 25
    assert peak_blocks([8], 100, 1, 4) == 3  # decoding: the bound
    assert peak_blocks([8, None], 100, 16, 4) == 25 + 7  # a 16-token chunk after 7 keys: 23 tokens
    assert peak_blocks([8], 6, 16, 4) == 2  # never more than the sequence's own blocks
