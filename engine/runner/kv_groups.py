"""The runner's side of the KV cache groups (engine/kv_cache/groups.py): each layer's spec read
from its attention impl, the layers bound to the group's shared cache tensors, and a step's
attention metadata made once per group.

Every group has the same number of layers (``num_slots``), and the i-th layer of each group uses
the i-th cache tensor, at its own group's block ids: a block is one group's at a time, so no two
layers write the same bytes. The first group's metadata is the step's; with more groups it
carries them all (``AttentionMetadata.group_metadata``) and each ``Attention`` module takes its
own group's.
"""

from __future__ import annotations

import dataclasses

import torch

from kvserve.engine.kv_cache.groups import KVCacheGroups, group_layers
from kvserve.engine.layers.attention.backend import Attention, AttentionBackend, AttentionMetadata
from kvserve.engine.model_input import BlockTableArray, ModelInput, pad_block_tables


def model_kv_groups(layers: list[Attention]) -> KVCacheGroups:
    """The groups of a model's attention layers, by the window each layer's impl was made with."""
    return group_layers([layer.impl.sliding_window for layer in layers])


def bind_groups(layers: list[Attention], groups: KVCacheGroups, kv_cache: torch.Tensor) -> None:
    """Bind each layer to its slot of ``kv_cache`` [2, num_slots, ...] and tell it its group."""
    for i, layer in enumerate(layers):
        slot = groups.layer_slots[i]
        layer.bind_kv_cache(kv_cache[0, slot], kv_cache[1, slot], group=groups.layer_groups[i])


class GroupTables:
    """The persistent block tables of the groups after the first (one ``BlockTableArray`` each,
    rows shared with the first group's)."""

    def __init__(self, groups: KVCacheGroups, num_rows: int, width: int):
        self.arrays = [BlockTableArray(num_rows, width) for _ in range(groups.num_groups - 1)]

    def views(self, inp: ModelInput, block_size: int) -> list[ModelInput]:
        """The step as each group after the first sees it: its slots and block tables. An input
        with no group data (a measurement or warm-up step with no request behind it, whose K/V is
        never read back) uses the first group's for every group."""
        if not self.arrays:
            return []
        if not inp.group_slot_mappings:
            return [inp] * len(self.arrays)
        views = []
        for g, array in enumerate(self.arrays):
            if inp.seq_rows:
                tables = array.take(inp, block_size, inp.group_table_updates[g])
            else:
                tables = pad_block_tables(inp.group_block_tables[g])
            views.append(dataclasses.replace(inp, slot_mapping=inp.group_slot_mappings[g],
                                             block_table_array=tables, block_tables=[]))
        return views


def build_group_metadata(inp: ModelInput, views: list[ModelInput], backend: AttentionBackend,
                         device: torch.device) -> AttentionMetadata:
    """The step's metadata: the first group's, carrying every group's when there are more."""
    meta = backend.build_metadata(inp, device)
    if views:
        meta.group_metadata = [meta, *(backend.build_metadata(view, device) for view in views)]
    return meta
