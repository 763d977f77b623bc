"""The control plane of the state cache (engine/runner/state_cache.py) that models with linear-attention
layers keep beside the paged KV: a sequence holds one slot (its conv window and recurrent state in
every linear layer) from admission until it finishes, is aborted or preempted. Plain Python.

A slot needs no clearing when it changes hands: a sequence's first chunk starts at position 0,
and the model starts such a chunk from a zero state. So preemption (by recompute) gives the slot
back and the sequence rebuilds its state on readmission.

Prefix caching needs, besides the full-attention blocks, the state at the hit's end. A prompt's
prefill stops once at its *checkpoint* (``Sequence.checkpoint_at``: the end of its last full
block before its last token), and the state there is copied into a *snapshot* row, keyed by the
hash chain of the blocks before it; snapshots are reused LRU-first. A later prompt's hit is cut
back to the longest cached prefix ending where a snapshot is (``find``), and its slot takes a copy
(``restore``). Forked choices (n > 1) copy their parent's slot at the same point. The copies are
queued here and run on the device before the next step's model (``take_copies``), in order.

Speculation: a verification step runs a sequence's last token and its k drafts through the linear
layers one row after another, so its slot then holds the state after all k + 1; when the step
keeps only j + 1 of those rows (j drafts accepted), ``rollback`` queues (slot, j + 1) and the runner,
before the next step's model and before any copy, puts back the state from before the
verification and steps it through the kept rows again (engine/runner/state_cache.py). A slot given
back drops its pending rollback, so snapshots and forks only ever copy committed states.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int = 0):
        if num_slots < 1:
            raise ValueError(f"a state cache needs at least one slot, got {num_slots}")
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._copies: list[list[int]] = []  # [from, to]: states to copy before the next step
        self._rollbacks: list[list[int]] = []  # [slot, rows kept]: verifications to cut back first
        # the rows after the slots: a block hash -> its snapshot's row, least recently used first
        self._snapshots: OrderedDict[int, int] = OrderedDict()
        self._free_rows = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self.hits = 0  # admissions that restored a snapshot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq, snapshot: int | None = None) -> None:
        """Give ``seq`` a slot (it must have none; ``num_free`` says whether one is left), which
        takes the state of the ``snapshot`` key (a prefix hit) before the next step runs."""
        assert seq.state_slot is None, seq
        if not self._free:
            raise RuntimeError(f"out of state slots: all {self.num_slots} are held")
        seq.state_slot = self._free.pop()
        if snapshot is not None:
            self._snapshots.move_to_end(snapshot)
            self._copies.append([self._snapshots[snapshot], seq.state_slot])
            self.hits += 1

    def release(self, seq) -> None:
        """Take back ``seq``'s slot, if it holds one."""
        if seq.state_slot is not None:
            self._rollbacks = [r for r in self._rollbacks if r[0] != seq.state_slot]
            self._free.append(seq.state_slot)
            seq.state_slot = None

    def rollback(self, seq, kept: int) -> None:
        """``seq``'s last step verified drafts and kept only its first ``kept`` rows (its last token
        and the drafts accepted): its slot goes back to the state after them before the next step."""
        if seq.state_slot is not None:
            self._rollbacks.append([seq.state_slot, kept])

    def copy(self, parent, child) -> None:
        """Have ``child``'s slot take ``parent``'s state before the next step runs (a fork)."""
        self._copies.append([parent.state_slot, child.state_slot])

    def checkpoint(self, seq, key: int) -> None:
        """``seq``'s computed tokens are at its checkpoint: keep its state there as the snapshot of
        ``key`` (the hash of its blocks up to there), in a free row or the least recently used."""
        if seq.state_slot is None:
            return
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        row = self._free_rows.pop() if self._free_rows else self._snapshots.popitem(last=False)[1]
        self._snapshots[key] = row
        self._copies.append([seq.state_slot, row])

    def find(self, hashes: list[int], limit: int) -> int:
        """The most of the first ``limit`` blocks of ``hashes`` whose end has a snapshot (0: none)."""
        return next((n for n in range(limit, 0, -1) if hashes[n - 1] in self._snapshots), 0)

    def clear_snapshots(self) -> None:
        self._free_rows.extend(self._snapshots.values())
        self._snapshots.clear()

    @property
    def num_cached(self) -> int:
        return len(self._snapshots)

    def take_copies(self) -> list[list[int]]:
        copies, self._copies = self._copies, []
        return copies

    def take_rollbacks(self) -> list[list[int]]:
        rollbacks, self._rollbacks = self._rollbacks, []
        return rollbacks

    def check_integrity(self, holders) -> None:
        """Every slot is free or held by exactly one of ``holders`` (the sequences that hold one)."""
        held = [seq.state_slot for seq in holders if seq.state_slot is not None]
        assert sorted(held + self._free) == list(range(self.num_slots)), (held, self._free)


def turn_checkpoints(ids: list[int], turn_ends, block_size: int, checkpoint: int) -> tuple[int, ...]:
    """The chat-turn boundaries of a prompt (``ids``) before its own ``checkpoint`` where its state is
    also kept as a snapshot, at the end of the last full block before each: after its first turn
    (a system prompt other conversations share) and after its last whole turn but one (the history
    a regenerated or branched reply shares). A turn ends after a token of ``turn_ends`` (the model's
    end-of-generation ids: ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``</s>``), whether a
    chat template rendered the prompt here or a gateway sent it as token ids. A prompt without
    them (a plain completion) has none: its one checkpoint is its own."""
    ends = [i + 1 for i, token in enumerate(ids) if token in turn_ends]
    picked = {ends[0], ends[-2] if len(ends) > 1 else ends[0]} if ends else set()
    aligned = {end // block_size * block_size for end in picked}
    return tuple(sorted(at for at in aligned if 0 < at < checkpoint))


def has_linear_attention(hf_config) -> bool:
    """Whether the config's layers include linear-attention ones (a recurrent state per sequence)."""
    return "linear_attention" in (getattr(hf_config, "layer_types", None) or [])


def refuse_linear_heads(tp_size: int, hf_config) -> None:
    """Before any process starts: a tensor-parallel size that does not divide the linear-attention
    layers' key heads (each rank takes whole key heads with their value heads)."""
    if not has_linear_attention(hf_config) or tp_size == 1:
        return
    key_heads, value_heads = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    if key_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not fit the model's linear-attention heads "
                         f"(linear_num_key_heads={key_heads}, linear_num_value_heads={value_heads}): each "
                         f"rank takes whole key heads with their value heads, so linear_num_key_heads "
                         f"must be divisible by tensor_parallel_size")


def state_stats(slots: StateSlots | None, executor) -> dict:
    """EngineStats' state fields (none for a model without a state cache)."""
    if slots is None:
        return {}
    return dict(state_slots_total=slots.num_slots, state_slots_free=slots.num_free,
                state_snapshots_total=slots.num_snapshots, state_snapshots_cached=slots.num_cached,
                state_snapshot_hits=slots.hits, state_cache_bytes=executor.state_cache_bytes)
