"""What a checkpoint of a model looks like, from its config alone: every weight's Hugging Face name
and full shape (``checkpoint_shapes``), and seeded random weights under those names
(``random_weights``; ``init_random_weights`` loads them through the same ``weight_loader`` path a
real checkpoint takes). So a small config is enough to test any supported architecture (and
tensor-parallel shards agree) with no download.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.attention.backend import create_attention_backend
from kvserve.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from kvserve.engine.layers.moe import FusedExperts
from kvserve.engine.model_loader.weights import load_named_weights
from kvserve.engine.models.registry import model_class_for


def checkpoint_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Checkpoint (Hugging Face) weight names and full shapes of the config's model."""
    backend = create_attention_backend("torch", torch.device("meta"), block_size=16)
    with torch.device("meta"):
        model = model_class_for(hf_config)(hf_config, backend, ParallelContext())
    unpacked = {}
    for packed_name, param in model.named_parameters():
        module = model.get_submodule(packed_name.rsplit(".", 1)[0])
        if isinstance(module, FusedExperts):
            unpacked.update(module.checkpoint_parts(packed_name, model.expert_names))
            continue
        parts = _packed_parts(model, packed_name, module)
        if not parts:
            unpacked[packed_name] = tuple(param.shape)
        for name, rows in parts:
            unpacked[name] = (rows, *param.shape[1:])
    return {_checkpoint_name(model, name): shape for name, shape in unpacked.items()}


def _checkpoint_name(model: nn.Module, name: str) -> str:
    """Undo the model's ``checkpoint_renames`` (Mixtral's block_sparse_moe is our mlp)."""
    for checkpoint, ours in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(ours, checkpoint)
    return name


def _packed_parts(model: nn.Module, packed_name: str, module: nn.Module) -> list[tuple[str, int]]:
    """For a fused parameter, its checkpoint parts as (name, rows); [] for a plain one."""
    if not isinstance(module, QKVParallelLinear | MergedColumnParallelLinear):
        return []
    parts = []
    for source, (target, shard_id) in model.packed_modules_mapping.items():
        if f".{target}." in packed_name:
            rows = (module.shard_offsets[shard_id][1] if isinstance(module, QKVParallelLinear)
                    else module.part_sizes[shard_id])
            parts.append((packed_name.replace(f".{target}.", f".{source}."), rows))
    return parts


def random_weights(hf_config, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded float32 weights under checkpoint names: norms near 1, the rest N(0, 0.02)."""
    for name, shape in checkpoint_shapes(hf_config).items():
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        values = torch.randn(shape, generator=generator) * 0.02
        if "norm" in name:
            values += 1.0
        yield name, values


def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill ``model`` (any tensor-parallel rank) with the weights of ``random_weights``."""
    load_named_weights(model, random_weights(model.config, seed))
