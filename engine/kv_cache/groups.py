"""Layers grouped by their attention spec (full, or a sliding window of W tokens), in vLLM V1's
manner: one pool of blocks; every group has the same number of layers, so one block id means
the same bytes in whichever group holds it; the i-th layer of every group reads and writes the
i-th of ``num_slots`` shared cache tensors, at the block ids of its own group's table.

A sequence has one block table per group, all as long (a column per ``block_size`` tokens). A
window group frees the blocks wholly behind its window as the sequence moves on; their columns
then hold ``NULL_BLOCK``, which no kernel reads (a window layer reads from the block of its
first visible key on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = 0  # reserved when any group has a window: freed columns of a window group's tables


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # per group: its sliding window in tokens (None: full attention)
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_slots: tuple[int, ...]  # per layer: the cache tensor it uses (its index in its group)
    num_slots: int  # cache tensors per K and V: the layers of the largest group

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def has_window(self) -> bool:
        return any(w is not None for w in self.windows)


class Hits(list):
    """A prefix hit: the first group's blocks, as a list; ``groups``: every group's, as long (a
    window group's start with ``NULL_BLOCK`` behind its window); ``state_key``: with a recurrent
    state (kv_cache/state_slots.py), the key of the state snapshot at the hit's end."""

    def __init__(self, groups: list[list[int]], state_key: int | None = None):
        super().__init__(groups[0])
        self.groups = groups
        self.state_key = state_key


def group_layers(windows: Sequence[int | None]) -> KVCacheGroups:
    """Groups the layers of ``windows`` (each layer's window, None for full attention). Layers of
    one spec are cut into groups of ``size`` layers in layer order, specs in order of first
    appearance; ``size`` is the one (up to the rarest spec's count) that pads fewest slots,
    the largest among equals (fewer groups: fewer tables and metadata per step)."""
    if not windows:
        raise ValueError("a model with no attention layer has no KV cache to group")
    specs: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        specs.setdefault(window, []).append(layer)
    counts = [len(layers) for layers in specs.values()]
    size = min(range(1, min(counts) + 1), key=lambda s: (sum(-(-c // s) * s for c in counts), -s))
    group_windows: list[int | None] = []
    layer_groups, layer_slots = [0] * len(windows), [0] * len(windows)
    for window, layers in specs.items():
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_groups[layer], layer_slots[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVCacheGroups(tuple(group_windows), tuple(layer_groups), tuple(layer_slots), size)


def first_live_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block a sequence with ``num_computed`` tokens cached still needs in a group of
    ``window``: its next query (at position ``num_computed``) sees keys from
    max(0, num_computed - window + 1) on. 0 for full attention."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def window_blocks_bound(window: int, block_size: int) -> int:
    """The most blocks a window group holds for a decoding sequence: ceil(W / block_size) + 1."""
    return -(-window // block_size) + 1


def peak_blocks(windows: Sequence[int | None], num_tokens: int, chunk: int, block_size: int) -> int:
    """Blocks (over every group) a sequence of ``num_tokens`` tokens may hold at once when its
    steps compute up to ``chunk`` tokens: a full group every block; a window group at most the
    blocks of the W - 1 keys before a step and the step's own tokens, plus one for alignment."""
    every = -(-num_tokens // block_size)
    held = 0
    for window in windows:
        held += every if window is None else min(every, -(-(window - 1 + chunk) // block_size) + 1)
    return held
