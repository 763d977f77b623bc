"""Checkpoint-named tensors into a model's parameters: ``load_named_weights`` routes each tensor
to its parameter's ``weight_loader``, through the model's ``packed_modules_mapping`` for the
fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj), its ``fused_checkpoint_parts``
where the checkpoint itself stores them fused (Phi-3), and its ``expert_names`` for the experts of
a mixture. Real checkpoints (``loader``) and seeded random weights (``models``) both
load through here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import torch
from torch import nn

from kvserve.engine.layers.linear import copy_weight


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Route checkpoint-named tensors to the model's parameters; every parameter must be filled."""
    params = dict(model.named_parameters())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    expected = _expected_loads(model, params)
    loaded = set()
    if hasattr(model, "transform_checkpoint"):  # tensors stored as something else (gpt-oss's MXFP4)
        weights = model.transform_checkpoint(weights)
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        for target, shard_id, part in _parts(model, name, tensor):
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
            param = params[target]
            loader = getattr(param, "weight_loader", _default_weight_loader)
            with torch.no_grad():
                if shard_id is None:
                    loader(param, part)
                else:
                    loader(param, part, shard_id)
            loaded.add((target, shard_id))
    missing = sorted(f"{t}[{s}]" if s is not None else t for t, s in expected - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weight(s), e.g. {missing[:5]}")
    for module in model.modules():  # layers that got GGUF blocks keep them as stored (gguf_linear.py)
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    return_freed_heap()


def return_freed_heap() -> None:
    """Hand the allocator's free heap back to the kernel after loading: the transient copies of a
    load (float parameters replaced, a repack's buffers) leave free blocks the C heap keeps
    resident (glibc's ``malloc_trim``: 55-65 MB of a 1.7B Q4_K_M file's load, measured); nothing
    where the C library has no such call."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _parts(model: nn.Module, name: str, tensor: torch.Tensor) -> list[tuple[str, object, torch.Tensor]]:
    """(parameter name, shard id, tensor) for each part of a checkpoint tensor: one, unless the
    checkpoint stores a fused projection (Phi-3's ``qkv_proj``, ``gate_up_proj``) that the model's
    ``fused_checkpoint_parts`` cuts into the shards its layer loads one by one."""
    fused = _fused_parts(model, name)
    if fused is None:
        return [(*_route(model, name), tensor)]
    if tensor.shape[0] != sum(rows for _, rows in fused):
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; its parts "
                         f"{[shard for shard, _ in fused]} need {sum(rows for _, rows in fused)}")
    pieces = tensor.split([rows for _, rows in fused])
    return [(name, shard, piece) for (shard, _), piece in zip(fused, pieces, strict=True)]


def _fused_parts(model: nn.Module, name: str) -> list[tuple[object, int]] | None:
    """The model's (shard id, full rows) list for the fused module ``name`` belongs to, or None."""
    parts = getattr(model, "fused_checkpoint_parts", None)
    if parts is None:
        return None
    return next((shards for module, shards in parts().items() if f".{module}." in name), None)


def _route(model: nn.Module, name: str) -> tuple[str, object]:
    """(parameter name, shard id or None) for the checkpoint tensor ``name``: a per-expert tensor
    of a mixture-of-experts model goes to its layer's fused experts with shard (expert, part)."""
    for checkpoint, ours in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(checkpoint, ours)
    expert_names = getattr(model, "expert_names", None)
    routed = expert_names.route(name) if expert_names else None
    if routed:
        return routed
    for source, (target, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{source}." in name:
            return name.replace(f".{source}.", f".{target}."), shard_id
    return name, None


def _expected_loads(model: nn.Module, params: dict[str, nn.Parameter]) -> set[tuple[str, object]]:
    packed = getattr(model, "packed_modules_mapping", {})
    expected = set()
    for name, param in params.items():
        if hasattr(param, "checkpoint_shards"):  # fused experts: every (expert, part)
            expected |= {(name, shard) for shard in param.checkpoint_shards}
            continue
        shards = [shard for target, shard in packed.values() if f".{target}." in name]
        shards += [shard for shard, _ in _fused_parts(model, name) or []]
        expected |= {(name, shard) for shard in shards} if shards else {(name, None)}
    return expected


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    copy_weight(param.data, loaded)
