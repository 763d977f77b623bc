"""What one engine step asks of the model runner, as plain integers, and the block table that
every runner keeps between steps.

The scheduler decides *which* tokens run; ``build_model_input`` lays them out as the flat,
mixed batch the runner executes: prefill chunks and decode tokens side by side. Being plain
lists, a ``ModelInput`` travels to tensor-parallel workers without pickling engine objects
(``to_bytes`` / ``from_bytes`` use JSON, never pickle).

Block tables persist across steps: every runner (each tensor-parallel rank) holds a
``BlockTableArray``, an int32 array with one row per running sequence, and the engine's
``BlockTableWriter`` decides which row each sequence has and which of its blocks the runners do
not hold yet. A step carries only those new blocks (``table_updates``) and each sequence's row
(``seq_rows``); a decode step usually adds no block at all. The runner then cuts the step's
block tables out of its array in one gather (``BlockTableArray.take``), and that one int32 array,
padded with block 0, is what every consumer reads (attention metadata, the torch backend's
planning, CUDA-graph inputs): no per-sequence lists. Inputs built by hand (tests, the runner's
warm-up) may give ``block_tables`` as lists instead; ``step_block_tables`` pads them into the
same array.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


@dataclass
class ModelInput:
    input_ids: list[int] = field(default_factory=list)  # flattened new tokens of every scheduled sequence
    positions: list[int] = field(default_factory=list)  # position of each of those tokens in its sequence
    query_lens: list[int] = field(default_factory=list)  # per sequence: tokens computed this step
    context_lens: list[int] = field(default_factory=list)  # per sequence: KV length after this step
    # per sequence: its KV block ids, in inputs built by hand only
    block_tables: list[list[int]] = field(default_factory=list)
    # per token: block_id * block_size + offset where its K/V goes (``slot_of``); -1 = skip
    slot_mapping: list[int] = field(default_factory=list)
    # flat token indices whose logits are wanted (the last token of sampling sequences)
    logits_indices: list[int] = field(default_factory=list)
    # per sequence: its row in the runners' persistent block table; [] = use block_tables alone
    seq_rows: list[int] = field(default_factory=list)
    table_updates: list[list[int]] = field(default_factory=list)  # [row, first column, *block ids]
    # the step's block tables, int32 [num_seqs, blocks for the longest context], padded with block 0;
    # set by the runner (cut from its persistent array), or by ``step_block_tables`` from the lists
    block_table_array: Any = field(default=None, repr=False, compare=False)
    # KV cache groups after the first (engine/kv_cache/groups.py), each with its own blocks: per
    # group, the tokens' slots, and the table updates (or, built by hand, the block tables) as above;
    # empty for a model of one group
    group_slot_mappings: list[list[int]] = field(default_factory=list)
    group_table_updates: list[list[list[int]]] = field(default_factory=list)
    group_block_tables: list[list[list[int]]] = field(default_factory=list)
    # per sequence: its state slot, for models with a recurrent state (engine/runner/state_cache.py)
    state_slots: list[int] = field(default_factory=list)
    state_copies: list[list[int]] = field(default_factory=list)  # [from slot, to slot], before the step
    # [slot, rows kept] of the last step's verifications that rejected drafts, before the copies
    state_rollbacks: list[list[int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    def to_bytes(self) -> bytes:
        """JSON for a worker: with ``seq_rows`` the block tables travel as updates only."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "block_table_array"}
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ModelInput:
        return cls(**json.loads(data))


class BlockTableWriter:
    """The engine's side of the persistent block table: a row per running sequence (rows of
    sequences that stopped running are reused) and how many of its blocks the runners hold, per
    KV cache group (the row is the same in every group's array)."""

    def __init__(self, num_rows: int, width: int):
        self.width = width
        self._free = list(range(num_rows - 1, -1, -1))  # pop() hands out row 0 first
        self._rows: dict[int, list] = {}  # seq_id -> [row, blocks the runners hold, per group]

    def retain(self, seq_ids) -> None:
        """Free the rows of every sequence not in ``seq_ids`` (finished, aborted or preempted)."""
        keep = set(seq_ids)
        for seq_id in [s for s in self._rows if s not in keep]:
            self._free.append(self._rows.pop(seq_id)[0])

    def place(self, seq_id: int, table: list[int], group: int = 0) -> tuple[int, list[int] | None]:
        """(row, update): the sequence's row, and ``[row, first column, *new block ids]`` for the
        blocks the runners do not hold yet in ``group`` (None when they hold them all). Columns a
        window group freed keep their old ids there: no kernel reads behind a window."""
        if len(table) > self.width:
            raise ValueError(f"a block table of {len(table)} blocks exceeds the width {self.width} "
                             "(max_model_len / block_size)")  # fmt: skip
        entry = self._rows.get(seq_id)
        if entry is None:
            if not self._free:
                raise RuntimeError("more running sequences than block-table rows (max_num_seqs)")
            entry = self._rows[seq_id] = [self._free.pop(), 0]
        while len(entry) <= group + 1:
            entry.append(0)
        row, held = entry[0], entry[group + 1]
        if held > len(table):  # tables only grow while a sequence runs; rewrite if not
            held = 0
        entry[group + 1] = len(table)
        return row, ([row, held, *table[held:]] if held < len(table) else None)

    def hold_at_most(self, seq_id: int, num_blocks: int) -> None:
        """Count only the first ``num_blocks`` of the sequence's placed blocks as held: the rest may
        be given back after the step (a verification's blocks for drafts it rejects, which another
        sequence may then take) and the table regrown with other blocks at those columns, so the
        next ``place`` sends them again rather than trusting a count."""
        entry = self._rows[seq_id]
        entry[1:] = [min(held, num_blocks) for held in entry[1:]]


class BlockTableArray:
    """A runner's persistent block table: int32 ``[rows, width]``, changed only by updates."""

    def __init__(self, num_rows: int, width: int):
        self.array = np.zeros((num_rows, width), dtype=np.int32)

    def apply(self, updates: list[list[int]]) -> None:
        for row, start, *blocks in updates:
            self.array[row, start : start + len(blocks)] = blocks

    def gather(self, rows: list[int], num_blocks: int) -> np.ndarray:
        """The first ``num_blocks`` columns of ``rows``, as a new array (one C-level copy)."""
        return self.array[np.asarray(rows, dtype=np.intp), :num_blocks]

    def take(self, inp: ModelInput, block_size: int, updates: list[list[int]] | None = None) -> np.ndarray:
        """Apply the step's updates (``updates``: another KV cache group's); return its block
        tables: its rows, as many columns as the longest context needs, and block 0 past each
        sequence's own context (a reused row may hold an earlier sequence's blocks there)."""
        self.apply(inp.table_updates if updates is None else updates)
        needed = blocks_for(np.asarray(inp.context_lens, dtype=np.int64), block_size)
        tables = self.gather(inp.seq_rows, int(needed.max(initial=0)))
        tables[np.arange(tables.shape[1]) >= needed[:, None]] = 0
        return tables


def blocks_for(num_tokens, block_size: int):
    """Blocks holding ``num_tokens`` tokens (an int, or a numpy array elementwise)."""
    return -(-num_tokens // block_size)


block_table_width = blocks_for  # columns a block table needs for a sequence of that many tokens


def slot_of(table: list[int], pos: int, block_size: int) -> int:
    """The cache slot of position ``pos`` in a sequence whose blocks are ``table``."""
    return table[pos // block_size] * block_size + pos % block_size


def synthetic_input(spans: list[tuple[int, int]], tables: list[list[int]], block_size: int) -> ModelInput:
    """Token-0 inputs with no request behind them (start-up measurements, warm-up): per span
    (first position, tokens) one sequence over its block table in ``tables``, computing those
    positions with its context ending at the last, the logits of its last token wanted."""
    inp = ModelInput()
    for (start, n), table in zip(spans, tables, strict=True):
        end = start + n
        inp.input_ids += [0] * n
        inp.positions += range(start, end)
        inp.slot_mapping += [slot_of(table, p, block_size) for p in range(start, end)]
        inp.query_lens.append(n)
        inp.context_lens.append(end)
        inp.block_tables.append(list(table))
        inp.logits_indices.append(len(inp.input_ids) - 1)
    return inp


def pad_block_tables(tables: list[list[int]]) -> np.ndarray:
    """Lists of block ids as one int32 array, each padded with block 0 to the longest."""
    width = max(map(len, tables), default=0)
    padded = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in zip(padded, tables, strict=True):
        row[: len(table)] = table
    return padded


def step_block_tables(inp: ModelInput) -> np.ndarray:
    """The step's block-table array (see ``ModelInput.block_table_array``), made from the lists of
    a hand-built input on first use."""
    if inp.block_table_array is None:
        if len(inp.block_tables) != len(inp.query_lens):
            raise ValueError(f"{len(inp.query_lens)} sequences but {len(inp.block_tables)} block tables")
        inp.block_table_array = pad_block_tables(inp.block_tables)
    return inp.block_table_array


def build_model_input(scheduled: list, block_size: int, tables: BlockTableWriter | None = None,
                      state_copies: list[list[int]] | None = None,
                      state_rollbacks: list[list[int]] | None = None) -> ModelInput:
    """Lay out a scheduler step (``ScheduledSeq`` items, batch order) as one flat batch; with
    ``tables``, each sequence's row in the runners' block table and the blocks they lack instead
    of its whole block table."""
    inp = ModelInput(state_copies=state_copies or [], state_rollbacks=state_rollbacks or [])
    input_ids, positions, slots, query_lens = inp.input_ids, inp.positions, inp.slot_mapping, inp.query_lens
    for s in scheduled:
        seq, n = s.seq, s.num_tokens
        start = seq.num_computed_tokens
        if s.drafts:
            _add_verification_rows(inp, s, block_size, tables)
            continue
        end = start + n
        table = seq.block_table
        if n == 1:  # a decode: the common case, kept to a few operations
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(slot_of(table, start, block_size))
        else:
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(slot_of(table, p, block_size) for p in range(start, end))
        query_lens.append(n)
        inp.context_lens.append(end)
        if seq.state_slot is not None:
            inp.state_slots.append(seq.state_slot)
        if end == len(seq.token_ids):
            inp.logits_indices.append(len(input_ids) - 1)
        if len(seq.block_tables) > 1:
            _add_group_rows(inp, seq, range(start, end), block_size, tables)
        if tables is None:
            inp.block_tables.append(list(table))
            continue
        row, update = tables.place(seq.seq_id, table)
        inp.seq_rows.append(row)
        if update is not None:
            inp.table_updates.append(update)
    return inp


def _add_group_rows(inp: ModelInput, seq, positions, block_size: int, tables: BlockTableWriter | None,
                    rows: int = 1) -> None:
    """The slots of ``positions`` and the block tables (``rows`` rows of them: a verification's
    decode rows share one) of ``seq`` in each KV cache group after the first."""
    if not inp.group_slot_mappings:
        groups = len(seq.block_tables) - 1
        inp.group_slot_mappings = [[] for _ in range(groups)]
        inp.group_table_updates = [[] for _ in range(groups)]
        inp.group_block_tables = [[] for _ in range(groups)]
    for g, table in enumerate(seq.block_tables[1:]):
        inp.group_slot_mappings[g].extend(slot_of(table, p, block_size) for p in positions)
        if tables is None:
            inp.group_block_tables[g].extend(list(table) for _ in range(rows))
            continue
        _, update = tables.place(seq.seq_id, table, group=g + 1)
        if update is not None:
            inp.group_table_updates[g].append(update)


def _add_verification_rows(inp: ModelInput, s, block_size: int, tables: BlockTableWriter | None) -> None:
    """A sequence verifying drafts, as one decode row per query token (its last token, then each
    draft) over the same block table, each row's context ending at its own position. The rows
    write their K/V before any of them attends (every backend stores a layer's new K/V first), so
    row j sees the drafts before it. Computed as decode rows, each row's logits are those a plain
    decode step of that one token gives: on the CPU, up to MAX_FUSED_ROWS rows in all, bit for
    bit (the fused decode step computes each row on its own)."""
    seq = s.seq
    start = seq.num_computed_tokens
    table = seq.block_table
    row = None
    if len(seq.block_tables) > 1:
        _add_group_rows(inp, seq, range(start, start + 1 + len(s.drafts)), block_size, tables,
                        rows=1 + len(s.drafts))
    if tables is not None:
        row, update = tables.place(seq.seq_id, table)
        if update is not None:
            inp.table_updates.append(update)
        # the blocks up to its last token stay; those past it held drafts and may go back
        tables.hold_at_most(seq.seq_id, blocks_for(start + 1, block_size))
    for j, token in enumerate([seq.token_ids[start], *s.drafts]):
        pos = start + j
        inp.input_ids.append(token)
        inp.positions.append(pos)
        inp.slot_mapping.append(slot_of(table, pos, block_size))
        inp.query_lens.append(1)
        inp.context_lens.append(pos + 1)
        inp.logits_indices.append(len(inp.input_ids) - 1)
        if seq.state_slot is not None:  # every row on the one slot: the linear layers step them in turn
            inp.state_slots.append(seq.state_slot)
        if row is None:
            inp.block_tables.append(list(table))
        else:
            inp.seq_rows.append(row)
