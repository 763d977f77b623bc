"""Qwen2 (and Qwen2.5): the Llama decoder with a bias on the q, k and v projections."""

from __future__ import annotations

from kvserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def qkv_bias(config) -> bool:
        return True

    @staticmethod
    def out_bias(config) -> bool:
        return False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen2Attention


class Qwen2Model(LlamaModel):
    layer_class = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_class = Qwen2Model
