"""Qwen3-Next (``Qwen3NextForCausalLM``, Qwen3-Next-80B-A3B): Qwen3.5's hybrid decoder
(``qwen3_5.py``: Gated DeltaNet and gated full-attention layers, the same state cache) whose MLPs
are mixtures of experts with a sigmoid-gated shared expert (Qwen2-MoE's, ``qwen3_moe.QwenMoeMlps``),
and whose linear layers project per key head: ``in_proj_qkvz`` holds, for each key head, its q, k,
then the v and z of its value heads; ``in_proj_ba`` its value heads' b then a. ``project`` regroups
them into Qwen3.5's order (q | k | v of all heads), which the conv weights follow. Under tensor
parallelism a rank's rows of both are its key heads' groups (a contiguous range), regrouped the same.
"""

from __future__ import annotations

import torch

from kvserve.engine.layers.linear import MergedColumnParallelLinear
from kvserve.engine.layers.moe import ExpertNames
from kvserve.engine.models.qwen3_5 import (
    GatedDeltaNet,
    Qwen3_5DecoderLayer,
    Qwen3_5ForCausalLM,
    Qwen3_5Model,
    value_dim_of,
)
from kvserve.engine.models.qwen3_moe import QwenMoeMlps
from kvserve.engine.models.registry import register_model


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    def make_in_proj(self, config, parallel) -> MergedColumnParallelLinear:
        """in_proj_qkvz | in_proj_ba, one GEMM. Both are grouped by key head, so a contiguous
        range of rows is whole key heads with their value heads: each splits across ranks as is."""
        key_size, value_size = config.linear_num_key_heads * self.k_dim, value_dim_of(config)
        sizes = [2 * key_size + 2 * value_size, 2 * config.linear_num_value_heads]
        return MergedColumnParallelLinear(config.hidden_size, sizes, False, parallel)

    def project(self, hidden: torch.Tensor):
        tokens, heads, per = hidden.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        qkvz, ba = self.in_proj(hidden).split([self.in_proj.part_sizes[0], 2 * self.num_v_heads], dim=-1)
        q, k, v, z = qkvz.view(tokens, heads, -1).split([self.k_dim, self.k_dim, per * self.v_dim,
                                                         per * self.v_dim], dim=-1)
        b, a = ba.view(tokens, heads, 2 * per).split([per, per], dim=-1)
        mixed = torch.cat([x.reshape(tokens, -1) for x in (q, k, v)], dim=-1)
        return mixed, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)


class Qwen3NextDecoderLayer(QwenMoeMlps, Qwen3_5DecoderLayer):
    linear_class = Qwen3NextGatedDeltaNet
    shared_expert = True


class Qwen3NextModel(Qwen3_5Model):
    layer_class = Qwen3NextDecoderLayer


@register_model
class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    model_class = Qwen3NextModel
    expert_names = ExpertNames()
    packed_modules_mapping = {
        **{k: v for k, v in Qwen3_5ForCausalLM.packed_modules_mapping.items() if not k.startswith("in_proj")},
        "in_proj_qkvz": ("in_proj", 0),
        "in_proj_ba": ("in_proj", 1),
    }
