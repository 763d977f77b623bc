"""Qwen3.5 (text; ``Qwen3_5ForCausalLM``): a hybrid of Gated DeltaNet (linear attention) layers and
full-attention layers, as ``layer_types`` lists them (three linear per full one by default).

- Gated DeltaNet: one projection gives the conv channels (q | k | v), the output gate z and the
  per-head beta and decay inputs; a causal depthwise conv (kernel ``linear_conv_kernel_dim``) then
  the gated delta rule (``layers/gated_delta.py``) mix the tokens, an RMSNorm gated by SiLU(z)
  and ``out_proj`` close the layer. Each sequence keeps a conv window and a recurrent state in a
  *state slot*: the runner binds each layer to its rows of the state cache (``bind_state``) and
  gives each step's slots in ``AttentionMetadata.state_slots``. A chunk starting at position 0
  begins from a zero state, so a slot needs no clearing between sequences.
- Full attention: q and an output gate per head from ``q_proj``, QK-norm, rotary over the first
  ``partial_rotary_factor`` of each head, output multiplied by sigmoid(gate).
- Norms are zero-centred (``x / rms(x) * (1 + w)``, Gemma's), but the gated one of the linear
  layers, which multiplies by ``w``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.attention.backend import Attention, AttentionBackend, AttentionMetadata
from kvserve.engine.layers.embed_head import VocabParallelEmbedding
from kvserve.engine.layers.gated_delta import (
    causal_conv,
    causal_conv_step,
    cpu_kernels,
    delta_rule_chunked,
    delta_rule_recurrent,
)
from kvserve.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvserve.engine.layers.norm import GemmaRMSNorm
from kvserve.engine.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from kvserve.engine.models.llama import LlamaForCausalLM, LlamaMLP, head_dim_of
from kvserve.engine.models.phi3 import rotary_dim_of
from kvserve.engine.models.registry import register_model

LINEAR, FULL = "linear_attention", "full_attention"


def state_shapes(config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per sequence and linear layer: the conv window [channels, K - 1] and the recurrent state
    [value heads, key dim, value dim]."""
    channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + value_dim_of(config)
    return ((channels, config.linear_conv_kernel_dim - 1),
            (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim))


def value_dim_of(config) -> int:
    return config.linear_num_value_heads * config.linear_value_head_dim


class CausalConv1d(nn.Module):
    """Holds the depthwise kernel as the checkpoint stores it: [channels, 1, K]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(nn.Module):
    def __init__(self, config, parallel: ParallelContext):
        super().__init__()
        if parallel.size > 1:
            raise ValueError("Qwen3.5's Gated DeltaNet layers do not run with tensor parallelism yet "
                             "(tensor_parallel_size must be 1)")
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_k_heads})")
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_size, value_size = self.num_k_heads * self.k_dim, value_dim_of(config)
        self.conv_size = 2 * key_size + value_size
        self.splits = [self.conv_size, value_size, self.num_v_heads, self.num_v_heads]
        self.in_proj = self.make_in_proj(config, parallel)
        self.conv1d = CausalConv1d(self.conv_size, config.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(self.v_dim), requires_grad=False)
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(value_size, config.hidden_size, False, parallel)
        self.conv_states = torch.empty(0)  # [slots, channels, K - 1], bound by the runner
        self.recurrent_states = torch.empty(0)  # [slots, value heads, key dim, value dim], float32

    def make_in_proj(self, config, parallel: ParallelContext) -> MergedColumnParallelLinear:
        """in_proj_qkv | in_proj_z | in_proj_b | in_proj_a, one GEMM."""
        return MergedColumnParallelLinear(config.hidden_size, self.splits, False, parallel)

    def bind_state(self, conv_states: torch.Tensor, recurrent_states: torch.Tensor) -> None:
        self.conv_states, self.recurrent_states = conv_states, recurrent_states

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        slots = meta.state_slots
        if slots is None or len(slots) != meta.num_seqs:
            raise RuntimeError("a Gated DeltaNet layer needs one state slot per sequence of the step "
                               "(AttentionMetadata.state_slots)")
        mixed, z, b, a = self.project(hidden)
        beta = b.sigmoid()
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        if meta.max_query_len == 1:
            out = self._decode(mixed, g, beta, slots)
        else:
            outs = [self._sequence(mixed[s:e], g[s:e], beta[s:e], slot, fresh)
                    for s, e, slot, fresh in self._spans(meta, slots)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.out_proj(self._normed(out, z, mixed))

    def project(self, hidden: torch.Tensor):
        """The conv channels (q | k | v), z, b and a of each token."""
        return self.in_proj(hidden).split(self.splits, dim=-1)

    @staticmethod
    def _spans(meta: AttentionMetadata, slots: list[int]):
        """(first token, end, slot, whether the chunk starts the sequence) per sequence."""
        start = 0
        for n, total, slot in zip(meta.query_lens_host, meta.seq_lens_host, slots, strict=True):
            yield start, start + n, slot, total == n
            start += n

    def _qkv(self, mixed: torch.Tensor):
        key_size = self.num_k_heads * self.k_dim
        q, k, v = mixed.split([key_size, key_size, self.conv_size - 2 * key_size], dim=-1)
        shape = mixed.shape[:-1]
        return (q.reshape(*shape, self.num_k_heads, self.k_dim),
                k.reshape(*shape, self.num_k_heads, self.k_dim),
                v.reshape(*shape, self.num_v_heads, self.v_dim))

    def _sequence(self, mixed, g, beta, slot: int, fresh: bool) -> torch.Tensor:
        """One sequence's chunk (any length), from its slot's state (zero when ``fresh``)."""
        conv_state, state = self.conv_states[slot], self.recurrent_states[slot]
        if fresh:
            conv_state.zero_()
            state.zero_()
        kernels = self._kernels(mixed)
        if kernels is not None:
            rows = kernels.conv(mixed, self.conv1d.weight[:, 0], conv_state)
            return kernels.prefill(rows, g, beta, state, self.num_k_heads, self.k_dim)
        mixed = causal_conv(mixed, self.conv1d.weight[:, 0], conv_state)
        q, k, v = self._qkv(mixed)
        if mixed.shape[0] == 1:
            return delta_rule_recurrent(q, k, v, g, beta, state.unsqueeze(0))
        return delta_rule_chunked(q, k, v, g, beta, state)

    def _kernels(self, mixed: torch.Tensor):
        """csrc/gated_delta.c's kernels where they take this step (the CPU; the conv's weight and
        windows of mixed's dtype), else None."""
        if not mixed.dtype == self.conv1d.weight.dtype == self.conv_states.dtype:
            return None
        return cpu_kernels(mixed, self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim)

    def _decode(self, mixed, g, beta, slots: list[int]) -> torch.Tensor:
        """One token of each sequence: on the CPU the C step on the slots' rows in place; else
        their states gathered, stepped and written back."""
        index = torch.tensor(slots, dtype=torch.long, device=mixed.device)
        weight = self.conv1d.weight[:, 0]
        kernels = self._kernels(mixed)
        if kernels is not None:
            return kernels.decode(mixed, weight, self.conv_states, self.recurrent_states, index, g, beta,
                                  self.num_k_heads, self.k_dim)
        conv_states = self.conv_states.index_select(0, index)
        states = self.recurrent_states.index_select(0, index)
        mixed = causal_conv_step(mixed, weight, conv_states)
        q, k, v = self._qkv(mixed)
        out = delta_rule_recurrent(q, k, v, g, beta, states)
        self.conv_states.index_copy_(0, index, conv_states)
        self.recurrent_states.index_copy_(0, index, states)
        return out

    def _normed(self, out: torch.Tensor, z: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """The rule's output [T, H, dv] normed and gated by z [T, H dv], as [T, H dv] of z's dtype:
        in C where the kernels take the step (one pass over the values), else ``_gated_norm``."""
        kernels = self._kernels(mixed)
        if (kernels is not None and out.dtype == torch.float32 and out.is_contiguous() and z.dim() == 2
                and z.stride(-1) == 1 and self.norm_weight.dtype == z.dtype == mixed.dtype):
            return kernels.gated_norm(out, z, self.norm_weight, self.eps)
        out = self._gated_norm(out.to(z.dtype), z.reshape(-1, self.num_v_heads, self.v_dim))
        return out.reshape(z.shape[0], -1)

    def _gated_norm(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's values (float32), times w, times SiLU(z)."""
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight * normed.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention with an output gate per head (the second half of each head of ``q_proj``)."""

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext):
        super().__init__()
        self.head_dim = head_dim = head_dim_of(config)
        # q_proj holds [q | gate] per head: as 2 x heads "heads" of head_dim its rows load unchanged
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, parallel)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=config.attention_bias, parallel=parallel)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_dim = rotary_dim_of(config)
        impl = backend.create_impl(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)
        self.attn = Attention(impl)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        tokens, d = hidden.shape[0], self.head_dim
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        q_gate, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q_gate = q_gate.reshape(tokens, self.num_heads, 2 * d)
        q, gate = self.q_norm(q_gate[..., :d].contiguous()), q_gate[..., d:]
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, d))
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        out = self.attn(q, k, v.reshape(tokens, self.num_kv_heads, d), meta).reshape(tokens, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The first ``rotary_dim`` of each head of ``x`` (the norm's fresh output) rotated in place:
        the CPU kernel rotates the strided view itself, the torch form's result is copied back."""
        part = x[..., : self.rotary_dim]
        turned = apply_rotary(part, cos, sin)
        if turned is not part:
            part.copy_(turned)
        return x


class Qwen3_5DecoderLayer(nn.Module):
    linear_class = GatedDeltaNet

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = self.linear_class(config, parallel)
        else:
            self.self_attn = GatedAttention(config, backend, parallel)
        self.mlp = self.make_mlp(config, parallel, layer_idx)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, meta):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.layer_type == LINEAR:
            hidden = self.linear_attn(hidden, meta)
        else:
            hidden = self.self_attn(hidden, cos, sin, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def make_mlp(self, config, parallel: ParallelContext, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, parallel)


class Qwen3_5Model(nn.Module):
    layer_class = Qwen3_5DecoderLayer

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(self.layer_class(config, backend, parallel, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(rotary_dim_of(config), config.max_position_embeddings,
                                          rope_parameters(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        return self.norm(hidden, residual)[0]


@register_model
class Qwen3_5ForCausalLM(LlamaForCausalLM):  # its head, tying, forward and logits
    model_class = Qwen3_5Model
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }
    checkpoint_renames = {"linear_attn.norm.weight": "linear_attn.norm_weight"}
    # a fixed-size state per sequence in the linear layers: the runner keeps a state cache
    has_recurrent_state = True
    # checkpoint tensors not loaded: the multi-token-prediction head (transformers skips it too)
    skipped_prefixes: tuple[str, ...] = ("mtp.",)

    @staticmethod
    def refuse_unsupported(hf_config) -> None:
        kinds = set(hf_config.layer_types)
        if not kinds <= {LINEAR, FULL} or FULL not in kinds:
            raise ValueError(f"Qwen3_5ForCausalLM needs layer_types of {LINEAR!r} and at least one {FULL!r}, "
                             f"got {sorted(kinds)}")

    def transform_checkpoint(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        return ((name, tensor) for name, tensor in weights if not name.startswith(self.skipped_prefixes))

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if layer.layer_type == FULL]

    def state_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.layer_type == LINEAR]

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return state_shapes(self.config)
