"""Qwen2 (and Qwen2.5): the Llama decoder with a bias on the q, k and v projections."""

from __future__ import annotations

from kvserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvserve.engine.models.registry import register_model


class Qwen2Attention(LlamaAttention):
    in_decode_row = True  # the Llama forward, with biases that decode_row.c takes
    @staticmethod
    def qkv_bias(config) -> bool:
        return True

    @staticmethod
    def out_bias(config) -> bool:
        return False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen2Attention
    in_decode_row = True


class Qwen2Model(LlamaModel):
    layer_class = Qwen2DecoderLayer


@register_model
class Qwen2ForCausalLM(LlamaForCausalLM):
    model_class = Qwen2Model
