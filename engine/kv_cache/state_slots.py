"""The control plane of the state cache (engine/runner/state_cache.py) that models with linear-attention
layers keep beside the paged KV: a sequence holds one slot (its conv window and recurrent state in
every linear layer) from admission until it finishes, is aborted or preempted. Plain Python.

A slot needs no clearing when it changes hands: a sequence's first chunk starts at position 0,
and the model starts such a chunk from a zero state. So preemption (by recompute) gives the slot
back and the sequence rebuilds its state on readmission.
"""

from __future__ import annotations

import logging

from kvserve.engine.config import EngineConfig

log = logging.getLogger("kvserve.engine")


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a state cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._copies: list[list[int]] = []  # [from, to]: states to copy before the next step

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq) -> None:
        """Give ``seq`` a slot (it must have none; ``num_free`` says whether one is left)."""
        assert seq.state_slot is None, seq
        if not self._free:
            raise RuntimeError(f"out of state slots: all {self.num_slots} are held")
        seq.state_slot = self._free.pop()

    def release(self, seq) -> None:
        """Take back ``seq``'s slot, if it holds one."""
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None

    def copy(self, parent, child) -> None:
        """Have ``child``'s slot take ``parent``'s state before the next step runs (a fork)."""
        self._copies.append([parent.state_slot, child.state_slot])

    def take_copies(self) -> list[list[int]]:
        copies, self._copies = self._copies, []
        return copies

    def check_integrity(self, holders) -> None:
        """Every slot is free or held by exactly one of ``holders`` (the sequences that hold one)."""
        held = [seq.state_slot for seq in holders if seq.state_slot is not None]
        assert sorted(held + self._free) == list(range(self.num_slots)), (held, self._free)


def hybrid_config(config: EngineConfig, hf_config) -> EngineConfig:
    """A model with a recurrent state: speculation refused, prefix caching off (as vLLM), with reasons."""
    name = (getattr(hf_config, "architectures", None) or ["this model"])[0]
    if config.speculative != "off":
        raise ValueError(f"speculative={config.speculative!r} is not supported for {name}: verifying "
                         "drafts through its linear-attention layers needs their state at every kept "
                         "position, which kvserve does not keep yet; serve it with speculative='off'")
    if config.enable_prefix_caching:
        log.warning("prefix caching is off for %s: a hit needs the linear-attention layers' state at "
                    "the hit's end, and kvserve keeps no state snapshots yet", name)
    return config.replace(enable_prefix_caching=False)


def state_stats(slots: StateSlots | None, executor) -> dict:
    """EngineStats' state fields (none for a model without a state cache)."""
    if slots is None:
        return {}
    return dict(state_slots_total=slots.num_slots, state_slots_free=slots.num_free,
                state_cache_bytes=executor.state_cache_bytes)
