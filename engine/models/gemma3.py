"""Gemma 3 (text; ``Gemma3ForCausalLM``): Gemma 2's decoder (``gemma2.py``) with

- five sliding-window layers per full one, as ``layer_types`` lists them;
- QK-norm: Gemma's RMSNorm over each q and k head before the rotary embedding;
- a rotary table per layer type: ``rope_parameters["sliding_attention"]`` (base 10k) on the window
  layers, ``rope_parameters["full_attention"]`` (base 1M, linear scaling on the larger sizes) on
  the full ones;
- no attention logit soft cap (transformers' Gemma 3 passes none to its attention, so a config
  that sets ``attn_logit_softcapping`` is refused rather than served differently); the final
  logits are capped where ``final_logit_softcapping`` is set.
"""

from __future__ import annotations

from kvserve.engine.layers.norm import GemmaRMSNorm
from kvserve.engine.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from kvserve.engine.models.qwen3 import Qwen3Attention
from kvserve.engine.models.registry import register_model


class Gemma3Attention(Gemma2Attention):
    in_decode_row = True  # QK-norm: decode_row.c's q_norm and k_norm
    def __init__(self, config, backend, parallel, layer_idx: int):
        super().__init__(config, backend, parallel, layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    @staticmethod
    def soft_cap_of(config) -> float | None:
        return None

    project_qkv = Qwen3Attention.project_qkv  # q and k normed per head, then rotated


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention
    in_decode_row = True

    @staticmethod
    def rope_kind_of(config, layer_idx: int) -> str:
        return config.layer_types[layer_idx]


class Gemma3Model(Gemma2Model):
    layer_class = Gemma3DecoderLayer

    @staticmethod
    def rope_parameters_by_kind(config) -> dict[str, dict]:
        by_type = {}
        for layer_type in set(config.layer_types):
            params = dict(config.rope_parameters[layer_type])
            params["rope_type"] = params.get("rope_type", params.get("type", "default"))
            by_type[layer_type] = params
        return by_type


@register_model
class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model

    @staticmethod
    def refuse_unsupported(hf_config) -> None:
        Gemma2ForCausalLM.refuse_unsupported(hf_config)
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma3ForCausalLM with attn_logit_softcapping is not supported (transformers' "
                             "Gemma 3 applies no attention soft cap; set it to null)")
