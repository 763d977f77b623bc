"""The state cache of models whose linear-attention layers keep a fixed-size state per sequence
(Qwen3.5's Gated DeltaNet): for every such layer a conv-window tensor (model dtype) and a
recurrent-state tensor (float32, as the gated delta rule computes), each of ``num_slots`` rows.
Row i of every layer is one sequence's: the block manager hands slots out (kv_cache/state_slots.py)
and each step's ``ModelInput.state_slots`` says which sequence has which.

The slots come out of the KV cache's memory: one per sequence that may run (``max_num_seqs``), or
on the CPU, where ``kv_cache_memory`` is the budget, as many as half of it holds when that is
fewer; the KV blocks get the rest. With prefix caching, as many rows again hold state snapshots
(the states at prompts' checkpoints, reused LRU-first: kv_cache/state_slots.py) out of the same
half. On CUDA the cache is allocated before the free memory is measured, so the blocks are sized
around it.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("kvserve.engine.runner.state_cache")


def has_recurrent_state(model) -> bool:
    return bool(getattr(model, "has_recurrent_state", False))


def slot_bytes(model, dtype: torch.dtype) -> int:
    """Bytes one sequence's state takes over every linear layer."""
    conv_shape, state_shape = model.state_shapes()
    per_layer = math.prod(conv_shape) * dtype.itemsize + math.prod(state_shape) * 4
    return per_layer * len(model.state_layers())


def count_state_slots(model, dtype: torch.dtype, max_num_seqs: int, budget: int | None,
                      snapshots: bool = False) -> int:
    """Slots for ``max_num_seqs`` sequences, fewer when ``budget`` (bytes, None: unbounded) cannot
    give half of itself to them (and with ``snapshots`` as many snapshot rows); refuses a budget
    that holds none."""
    per_slot = slot_bytes(model, dtype) * (2 if snapshots else 1)
    if budget is None or per_slot * max_num_seqs <= budget // 2:
        return max_num_seqs
    slots = budget // 2 // per_slot
    if slots < 1:
        raise ValueError(f"kv_cache_memory ({budget / 2**30:.3f} GiB) cannot hold the recurrent state of one "
                         f"sequence ({per_slot / 2**20:.1f} MiB{', with its snapshot' if snapshots else ''}) "
                         "in half of it; raise kv_cache_memory")
    log.warning("kv_cache_memory holds the recurrent state of %d sequences (%.1f MiB each%s), fewer than "
                "max_num_seqs (%d): at most %d run at once", slots, per_slot / 2**20,
                ", with a snapshot" if snapshots else "", max_num_seqs, slots)
    return slots


class StateCache:
    def __init__(self, model, num_slots: int, dtype: torch.dtype, device: torch.device,
                 num_snapshots: int = 0, scratch_row: bool = False):
        """Rows 0..num_slots-1: the slots; the ``num_snapshots`` rows after them: snapshots; with
        ``scratch_row`` one more, last, that no sequence holds: the rows a decode graph pads a
        batch with step it (``pad_row``)."""
        conv_shape, state_shape = model.state_shapes()
        layers = model.state_layers()
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        rows = num_slots + num_snapshots + int(scratch_row)
        self.pad_row = rows - 1 if scratch_row else None
        self.conv = torch.zeros(len(layers), rows, *conv_shape, dtype=dtype, device=device)
        self.recurrent = torch.zeros(len(layers), rows, *state_shape, dtype=torch.float32, device=device)
        for i, layer in enumerate(layers):
            layer.bind_state(self.conv[i], self.recurrent[i])
        self.layers = layers

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def copy(self, copies: list[list[int]]) -> None:
        for src, dst in copies:
            self.conv[:, dst] = self.conv[:, src]
            self.recurrent[:, dst] = self.recurrent[:, src]

    def roll_back(self, rollbacks: list[list[int]]) -> None:
        """[slot, rows kept] of the last step's verifications that rejected drafts: each slot's state
        becomes the one after its kept rows (kv_cache/state_slots.py), in every linear layer."""
        for layer in self.layers:
            layer.roll_back(rollbacks)

    def step_slots(self, state_slots: list[int], num_seqs: int) -> list[int]:
        """The step's slots; an input with no request behind it (a warm-up) uses the first ones."""
        if state_slots:
            return state_slots
        if num_seqs > self.num_slots:
            raise RuntimeError(f"a synthetic step of {num_seqs} sequences exceeds the "
                               f"{self.num_slots} state slots")
        return list(range(num_seqs))


def create_state_cache(model, config, dtype: torch.dtype, device: torch.device,
                       scratch_row: bool = False) -> StateCache | None:
    """The linear layers' state slots (and snapshot rows with prefix caching) for ``config`` (an
    EngineConfig), and a scratch row for decode graphs' padding when ``scratch_row``; None for
    other models. The CPU's ``kv_cache_memory`` budgets them unless ``num_kv_blocks`` is set."""
    if not has_recurrent_state(model):
        return None
    cpu_budget = device.type == "cpu" and config.num_kv_blocks is None
    budget = int(config.kv_cache_memory * (1 << 30)) if cpu_budget else None
    snapshots = config.enable_prefix_caching
    slots = count_state_slots(model, dtype, config.max_num_seqs, budget, snapshots)
    return StateCache(model, slots, dtype, device, slots if snapshots else 0, scratch_row)
