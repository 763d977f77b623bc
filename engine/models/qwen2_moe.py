"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder with mixture-of-experts MLPs
that add a sigmoid-gated shared expert to the routed ones.

Sparse and dense layers follow Qwen3-MoE's rule (``mlp_only_layers``, ``decoder_sparse_step``);
the q/k/v bias follows ``qkv_bias``.
"""

from __future__ import annotations

from kvserve.engine.layers.moe import ExpertNames
from kvserve.engine.models.llama import LlamaModel
from kvserve.engine.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM
from kvserve.engine.models.qwen3_moe import QwenMoeMlps
from kvserve.engine.models.registry import register_model


class Qwen2MoeAttention(Qwen2Attention):
    @staticmethod
    def qkv_bias(config) -> bool:
        return bool(getattr(config, "qkv_bias", True))


class Qwen2MoeDecoderLayer(QwenMoeMlps, Qwen2DecoderLayer):
    attention_class = Qwen2MoeAttention
    shared_expert = True


class Qwen2MoeModel(LlamaModel):
    layer_class = Qwen2MoeDecoderLayer


@register_model
class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    model_class = Qwen2MoeModel
    expert_names = ExpertNames()
