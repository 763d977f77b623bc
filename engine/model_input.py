"""What one engine step asks of the model runner, as plain integers.

The scheduler decides *which* tokens run; ``build_model_input`` lays them out as the flat,
mixed batch the runner executes: prefill chunks and decode tokens side by side. Being plain
lists, a ``ModelInput`` travels to tensor-parallel workers without pickling engine objects
(``to_bytes`` / ``from_bytes`` use JSON, never pickle).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass
class ModelInput:
    input_ids: list[int]  # flattened new tokens of every scheduled sequence, batch order
    positions: list[int]  # position of each of those tokens in its sequence
    query_lens: list[int]  # per sequence: tokens computed this step
    context_lens: list[int]  # per sequence: KV length after this step (cached + new)
    block_tables: list[list[int]]  # per sequence: its KV block ids
    slot_mapping: list[int]  # per token: block_id * block_size + offset where its K/V goes; -1 = skip
    logits_indices: list[int]  # flat token indices whose logits are wanted (last token of sampling seqs)

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
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ModelInput:
        return cls(**json.loads(data))


def build_model_input(scheduled: list, block_size: int) -> ModelInput:
    """Lay out a scheduler step (``ScheduledSeq`` items, batch order) as one flat batch."""
    inp = ModelInput([], [], [], [], [], [], [])
    for s in scheduled:
        seq, n = s.seq, s.num_tokens
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        table = seq.block_table
        inp.input_ids.extend(seq.token_ids[start:end])
        inp.positions.extend(range(start, end))
        inp.slot_mapping.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        inp.query_lens.append(n)
        inp.context_lens.append(end)
        inp.block_tables.append(list(table))
        if end == seq.num_tokens:
            inp.logits_indices.append(len(inp.input_ids) - 1)
    return inp
