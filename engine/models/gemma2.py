"""Gemma 2: a decoder whose layers alternate a sliding window with full attention, and which
differs from Llama in these ways (transformers 5.24's ``models/gemma2``):

- embeddings multiplied by sqrt(hidden_size), that factor rounded to the model's dtype first;
- Gemma's RMSNorm, ``x / rms(x) * (1 + w)`` (``layers/norm.GemmaRMSNorm``), before and after both
  the attention and the MLP (four per layer); the residual adds the post-norms' outputs;
- q.k scaled by ``query_pre_attn_scalar ** -0.5``; attention logits soft-capped
  (``attn_logit_softcapping``: c * tanh(s / c)); the final logits too (``final_logit_softcapping``);
- a GeGLU MLP (``gelu_pytorch_tanh``).

Gemma 3 (``gemma3.py``) keeps all of it and adds QK-norm and a RoPE base per layer type.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.activation import GeluTanhAndMul
from kvserve.engine.layers.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.engine.layers.embed_head import VocabParallelEmbedding
from kvserve.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kvserve.engine.layers.norm import GemmaRMSNorm
from kvserve.engine.layers.rotary import RotaryEmbedding, rope_parameters
from kvserve.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of
from kvserve.engine.models.registry import register_model
from kvserve.engine.models.variants import layer_window

GEGLU_ACTIVATIONS = ("gelu_pytorch_tanh",)


class Gemma2Attention(LlamaAttention):
    """Llama's attention with Gemma's scale, its layer's window and the logit soft cap."""

    in_decode_row = True  # decode_row.c computes this class's forward (models/decode_row.py)

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext, layer_idx: int):
        variant = {}
        if (window := layer_window(config, layer_idx)) is not None:
            variant["sliding_window"] = window
        if (cap := self.soft_cap_of(config)) is not None:
            variant["logits_soft_cap"] = float(cap)
        super().__init__(config, backend, parallel, **variant)

    @staticmethod
    def scale_of(config) -> float:
        return config.query_pre_attn_scalar**-0.5

    @staticmethod
    def soft_cap_of(config) -> float | None:
        return getattr(config, "attn_logit_softcapping", None)


class GemmaMLP(nn.Module):
    in_decode_row = True
    def __init__(self, config, parallel: ParallelContext):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], False, parallel)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, parallel)
        self.act = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma2DecoderLayer(nn.Module):
    attention_class = Gemma2Attention
    in_decode_row = True  # its four norms' order is decode_row.c's Gemma layer: a change there belongs here

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext, layer_idx: int = 0):
        super().__init__()
        self.rope_kind = self.rope_kind_of(config, layer_idx)  # which of the model's rotary tables it takes
        self.self_attn = self.attention_class(config, backend, parallel, layer_idx)
        self.mlp = GemmaMLP(config, parallel)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    @staticmethod
    def rope_kind_of(config, layer_idx: int) -> str:
        return "shared"  # Gemma 2's layers share one table

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's post-MLP output, the residual stream before it): the next layer's input
        norm adds the two, as the final norm does after the last layer."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(nn.Module):
    layer_class = Gemma2DecoderLayer

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        # made in the default dtype, the model's: transformers rounds the factor to it too
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(
            self.layer_class(config, backend, parallel, layer_idx=i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, params)
            for kind, params in self.rope_parameters_by_kind(config).items()
        })
        self._decode_row = False  # not decided yet (``decode_row``)

    @staticmethod
    def rope_parameters_by_kind(config) -> dict[str, dict]:
        """The rotary settings of each table, by the ``rope_kind`` its layers name."""
        return {"shared": rope_parameters(config)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.normalizer
        row = self.decode_row()
        if row is not None and (out := row(hidden, positions, meta)):
            return self.norm(*out)[0]  # a decode step through every layer in one kernel call
        tables = {kind: rotary.cos_sin(positions, hidden.dtype) for kind, rotary in self.rotary.items()}
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, *tables[layer.rope_kind], meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    decode_row = LlamaModel.decode_row  # the fused one-token step (models/decode_row.py), decided once


@register_model
class Gemma2ForCausalLM(LlamaForCausalLM):
    model_class = Gemma2Model
    supports_sliding_window = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    @staticmethod
    def refuse_unsupported(hf_config) -> None:
        name = hf_config.architectures[0]
        if hf_config.hidden_activation not in GEGLU_ACTIVATIONS:
            raise ValueError(f"{name} with hidden_activation {hf_config.hidden_activation!r} is not "
                             f"supported; supported: {list(GEGLU_ACTIVATIONS)}")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(f"{name} with use_bidirectional_attention (an encoder) is not supported")
