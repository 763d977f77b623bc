"""Qwen3-MoE (Qwen3-30B-A3B and kin): the Qwen3 decoder whose MLPs are mixtures of experts.

A layer is sparse unless the config lists it in ``mlp_only_layers`` or ``decoder_sparse_step``
skips it (Hugging Face's rule); dense layers keep a Llama MLP of ``intermediate_size``. Experts
have ``moe_intermediate_size``; the top-k weights are renormalised when ``norm_topk_prob``.
"""

from __future__ import annotations

from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.moe import ExpertNames, SparseMoeBlock
from kvserve.engine.models.llama import LlamaModel
from kvserve.engine.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
from kvserve.engine.models.registry import register_model


def is_sparse_layer(config, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class QwenMoeMlps:
    """A decoder-layer mixin: Qwen's sparse layers get a ``SparseMoeBlock``, the others their base
    class's MLP; ``shared_expert`` adds Qwen2-MoE's sigmoid-gated shared expert."""

    shared_expert = False

    def make_mlp(self, config, parallel: ParallelContext, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return super().make_mlp(config, parallel, layer_idx)
        return SparseMoeBlock(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)), parallel=parallel,
            shared_expert_size=config.shared_expert_intermediate_size if self.shared_expert else 0,
        )


class Qwen3MoeDecoderLayer(QwenMoeMlps, Qwen3DecoderLayer):
    pass


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer


@register_model
class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_class = Qwen3MoeModel
    expert_names = ExpertNames()
