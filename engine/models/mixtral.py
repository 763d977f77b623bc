"""Mixtral: the Llama decoder whose every MLP is a mixture of experts (top-k renormalised).

Its checkpoints call the MoE block ``block_sparse_moe`` and an expert's gate, down and up
projections ``w1``, ``w2`` and ``w3``; ``checkpoint_renames`` and ``expert_names`` tell the
loader. Experts have ``intermediate_size``.
"""

from __future__ import annotations

from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.moe import ExpertNames, SparseMoeBlock
from kvserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvserve.engine.models.registry import register_model


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, parallel: ParallelContext, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
            config.intermediate_size, renormalize=True, parallel=parallel,
        )


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


@register_model
class MixtralForCausalLM(LlamaForCausalLM):
    model_class = MixtralModel
    expert_names = ExpertNames("w1", "w3", "w2")
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}  # checkpoint name -> ours
