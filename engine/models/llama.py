"""Llama-architecture decoder (SmolLM2, Llama 2/3), the base the Qwen models extend.

Parameter names follow Hugging Face checkpoints except for the fused projections:
``self_attn.qkv_proj`` (q|k|v) and ``mlp.gate_up_proj`` (gate|up); ``packed_modules_mapping``
tells the loader how checkpoint names map onto them. The forward pass takes the step's
``AttentionMetadata`` explicitly: ``model(input_ids, positions, attn_metadata)``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.activation import SiluAndMul
from kvserve.engine.layers.attention.backend import Attention, AttentionBackend, AttentionMetadata
from kvserve.engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from kvserve.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvserve.engine.layers.norm import RMSNorm
from kvserve.engine.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from kvserve.engine.models.decode_row import DecodeRow
from kvserve.engine.models.registry import register_model


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    in_decode_row = True  # decode_row.c computes this class's forward (models/decode_row.py)
    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext, **variant):
        """``variant``: the attention variant's keywords for ``create_impl`` (``sliding_window``, ...)."""
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=self.qkv_bias(config), parallel=parallel,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size,
            bias=self.out_bias(config), parallel=parallel,
        )
        scale = self.scale_of(config)
        impl = backend.create_impl(self.num_heads, self.num_kv_heads, head_dim, scale, **variant)
        # sinks (gpt-oss): the layer owns its heads' logits, from this rank's first head on
        self.attn = Attention(impl, sinks=parallel.rank * self.num_heads if impl.has_sinks else None)

    @staticmethod
    def scale_of(config) -> float:
        """The factor of q.k (Gemma's ``query_pre_attn_scalar`` sets its own)."""
        return head_dim_of(config) ** -0.5

    @staticmethod
    def qkv_bias(config) -> bool:
        return getattr(config, "attention_bias", False)

    @staticmethod
    def out_bias(config) -> bool:
        return getattr(config, "attention_bias", False)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project_qkv(hidden, cos, sin)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))

    def project_qkv(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, heads, D] and k, v [T, kv_heads, D], with rotary applied to q and k."""
        qkv = self.qkv_proj(hidden)
        qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        # q and k sit side by side in qkv: one rotary call turns both
        qk = apply_rotary(qkv[:, :qk_size].view(qkv.shape[0], -1, self.head_dim), cos, sin)
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


class LlamaMLP(nn.Module):
    in_decode_row = True
    def __init__(self, config, parallel: ParallelContext, bias: bool = False):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias, parallel)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, parallel)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.silu_and_mul(x)  # in csrc/gemm.c's tiles, where it takes the call
        if act is None:
            act = self.act(self.gate_up_proj(x))
        return self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention
    in_decode_row = True

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext, layer_idx: int = 0):
        super().__init__()
        self.self_attn = self.make_attention(config, backend, parallel, layer_idx)
        self.mlp = self.make_mlp(config, parallel, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def make_attention(self, config, backend: AttentionBackend, parallel: ParallelContext,
                       layer_idx: int) -> nn.Module:
        """The layer's attention (families whose layers differ, by RoPE or window, choose it per layer)."""
        window = self.sliding_window(config, layer_idx)
        return self.attention_class(config, backend, parallel,
                                    **({} if window is None else {"sliding_window": window}))

    @staticmethod
    def sliding_window(config, layer_idx: int) -> int | None:
        """The layer's attention window in tokens (None: full attention). Llama has none; a family
        with windows says which layers have one (models/mistral.py)."""
        return None

    def make_mlp(self, config, parallel: ParallelContext, layer_idx: int) -> nn.Module:
        """The layer's MLP (mixture-of-experts models choose it per layer)."""
        return LlamaMLP(config, parallel, bias=getattr(config, "mlp_bias", False))


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            self.layer_class(config, backend, parallel, layer_idx=i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            self.rotary_dim(config), config.max_position_embeddings, rope_parameters(config)
        )
        self._decode_row = False  # not decided yet (``decode_row``)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        row = self.decode_row()
        if row is not None and (out := row(hidden, positions, meta)):
            return self.norm(*out)[0]  # a decode step through every layer in one kernel call
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    @staticmethod
    def rotary_dim(config) -> int:
        """How many features of each head turn (Phi-4-mini turns a part)."""
        return head_dim_of(config)

    def decode_row(self):
        """The fused one-token step over these layers (``models/decode_row.py``), or None when
        they do not fit it; decided once."""
        if self._decode_row is False:
            self._decode_row = DecodeRow(self) if DecodeRow.fits(self) else None
        return self._decode_row


@register_model
class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        self.config = config
        self.model = self.model_class(config, backend, parallel)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] (no LM head)."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] on rank 0 (None on other ranks)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
