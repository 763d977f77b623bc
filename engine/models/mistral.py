"""Mistral and Ministral: the Llama decoder with sliding-window attention.

Mistral puts its ``sliding_window`` on every layer (none when the config's is null); Ministral
says per layer in ``layer_types`` ("sliding_attention" layers get the window, "full_attention"
layers none), as transformers 5.24's modeling_mistral / modeling_ministral do.
"""

from __future__ import annotations

from kvserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvserve.engine.models.registry import register_model


class MistralDecoderLayer(LlamaDecoderLayer):
    in_decode_row = True  # the Llama forward; decode_row.c reads each layer's window

    @staticmethod
    def sliding_window(config, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)


class MistralModel(LlamaModel):
    layer_class = MistralDecoderLayer


@register_model
class MistralForCausalLM(LlamaForCausalLM):
    model_class = MistralModel
    supports_sliding_window = True  # the registry lets its configs' windows through


class MinistralDecoderLayer(LlamaDecoderLayer):
    in_decode_row = True

    @staticmethod
    def sliding_window(config, layer_idx: int) -> int | None:
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:  # (transformers fills them in from sliding_window)
            return getattr(config, "sliding_window", None)
        return config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None


class MinistralModel(LlamaModel):
    layer_class = MinistralDecoderLayer


@register_model
class MinistralForCausalLM(LlamaForCausalLM):
    model_class = MinistralModel
    supports_sliding_window = True
