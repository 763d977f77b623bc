"""A step's ``ModelInput`` as the device tensors and attention metadata of an eager pass
(``prepare_inputs``); the model runner (engine/runner/model_runner.py) runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.layers.attention.backend import AttentionBackend, AttentionMetadata, to_device
from kvserve.engine.model_input import ModelInput, step_block_tables
from kvserve.engine.runner.kv_groups import build_group_metadata


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    logits_indices: torch.Tensor  # int64 [num_logits]
    attn_metadata: AttentionMetadata


def prepare_inputs(inp: ModelInput, backend: AttentionBackend, device: torch.device,
                   group_views: list[ModelInput] | None = None) -> PreparedBatch:
    """One step's ``ModelInput`` as device tensors plus the backend's attention metadata (of every
    KV cache group: ``group_views`` is the step as the groups after the first see it)."""
    assert len(inp.input_ids) == len(inp.positions) == len(inp.slot_mapping) == sum(inp.query_lens)
    assert len(inp.query_lens) == len(inp.context_lens) == len(step_block_tables(inp))
    return PreparedBatch(
        input_ids=to_device(inp.input_ids, device),
        positions=to_device(inp.positions, device),
        logits_indices=to_device(inp.logits_indices, device),
        attn_metadata=build_group_metadata(inp, group_views or [], backend, device),
    )
