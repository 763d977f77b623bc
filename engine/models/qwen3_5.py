"""Qwen3.5 (text; ``Qwen3_5ForCausalLM``): a hybrid of Gated DeltaNet (linear attention) layers and
full-attention layers, as ``layer_types`` lists them (three linear per full one by default).

- Gated DeltaNet: one projection gives the conv channels (q | k | v), the output gate z and the
  per-head beta and decay inputs; a causal depthwise conv (kernel ``linear_conv_kernel_dim``) then
  the gated delta rule (``layers/gated_delta.py``) mix the tokens, an RMSNorm gated by SiLU(z)
  and ``out_proj`` close the layer. Each sequence keeps a conv window and a recurrent state in a
  *state slot*: the runner binds each layer to its rows of the state cache (``bind_state``) and
  gives each step's slots in ``AttentionMetadata.state_slots``. A chunk starting at position 0
  begins from a zero state, so a slot needs no clearing between sequences. Rows of one token of
  sequences under way (decodes, and a verification's rows: its last token then each draft, all on
  one slot) run as decode steps, a slot's rows in turn; a verification keeps the state before it
  and its rows' inputs, so that ``roll_back`` can step the state through the rows kept only.
  On CUDA with fla-core the rule runs its kernels (``layers/gated_delta_gpu.py``); a captured
  decode graph gives the slots as a static device tensor (``AttentionMetadata.state_index``).
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

from kvserve.engine.distributed.parallel import ParallelContext, divide
from kvserve.engine.layers import gated_delta_gpu as gpu_rules
from kvserve.engine.layers.attention.backend import Attention, AttentionBackend, AttentionMetadata
from kvserve.engine.layers.embed_head import VocabParallelEmbedding
from kvserve.engine.layers.gated_delta import (
    causal_conv,
    causal_conv_step,
    cpu_kernels,
    delta_rule_chunked,
    delta_rule_recurrent,
    gates,
    row_waves,
)
from kvserve.engine.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    copy_weight,
    rank_pieces,
)
from kvserve.engine.layers.norm import GemmaRMSNorm
from kvserve.engine.layers.rotary import RotaryEmbedding, rope_parameters
from kvserve.engine.models.decode_row_hybrid import HybridDecodeRow
from kvserve.engine.models.llama import LlamaForCausalLM, LlamaMLP
from kvserve.engine.models.phi3 import rotary_dim_of
from kvserve.engine.models.qwen3_5_attention import GatedAttention
from kvserve.engine.models.registry import register_model

LINEAR, FULL = "linear_attention", "full_attention"


def state_shapes(config, tp_size: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per sequence and linear layer, on one of ``tp_size`` ranks: the conv window [channels,
    K - 1] and the recurrent state [value heads, key dim, value dim] of the rank's heads."""
    key_heads = divide(config.linear_num_key_heads, tp_size, "linear_num_key_heads")
    value_heads = config.linear_num_value_heads // tp_size
    channels = 2 * key_heads * config.linear_key_head_dim + value_heads * config.linear_value_head_dim
    return ((channels, config.linear_conv_kernel_dim - 1),
            (value_heads, config.linear_key_head_dim, config.linear_value_head_dim))


def value_dim_of(config) -> int:
    return config.linear_num_value_heads * config.linear_value_head_dim


def _load_rank_pieces(pieces: list[int], parallel: ParallelContext):
    """A weight loader copying the rank's rows of ``pieces`` (``rank_pieces``) into the parameter."""
    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param.data, rank_pieces(loaded, pieces, parallel))
    return load


class CausalConv1d(nn.Module):
    """Holds the depthwise kernel as the checkpoint stores it: [channels, 1, K], this rank's
    channels (``pieces``: q | k | v, each split across ranks by head)."""

    def __init__(self, pieces: list[int], kernel: int, parallel: ParallelContext):
        super().__init__()
        channels = sum(pieces) // parallel.size
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel), requires_grad=False)
        self.weight.weight_loader = _load_rank_pieces(pieces, parallel)


class GatedDeltaNet(nn.Module):
    """Under tensor parallelism each rank holds ``1 / size`` of the key heads and the value heads
    that go with them (value head j reads key head j // (value heads / key heads), so contiguous
    ranges stay aligned): its rows of the in-projections and conv channels, its A_log and dt_bias,
    its heads' state; the gated norm is per head, so rank-local; ``out_proj`` is row-parallel, its
    partial sums all-reduced as attention's ``o_proj``."""

    in_decode_row = True  # its decode: csrc/decode_row.c decode_row_hybrid (models/decode_row_hybrid.py)

    def __init__(self, config, parallel: ParallelContext):
        super().__init__()
        num_k_heads, num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_k_heads})")
        self.num_k_heads = divide(num_k_heads, parallel.size, "linear_num_key_heads")
        self.num_v_heads = num_v_heads // parallel.size
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_size, value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_size = 2 * key_size + value_size
        self.splits = [self.conv_size, value_size, self.num_v_heads, self.num_v_heads]
        self.in_proj = self.make_in_proj(config, parallel)
        full_key = num_k_heads * self.k_dim
        self.conv1d = CausalConv1d([full_key, full_key, value_dim_of(config)], config.linear_conv_kernel_dim,
                                   parallel)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        for param in (self.dt_bias, self.A_log):  # by value head
            param.weight_loader = _load_rank_pieces([num_v_heads], parallel)
        self.norm_weight = nn.Parameter(torch.ones(self.v_dim), requires_grad=False)
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(value_dim_of(config), config.hidden_size, False, parallel)
        self.conv_states = torch.empty(0)  # [slots, channels, K - 1], bound by the runner
        self.recurrent_states = torch.empty(0)  # [slots, value heads, key dim, value dim], float32
        # the last step's verifications: (their slots, conv windows and states before the step,
        # per slot its rows' mixed, g and beta), for ``roll_back``
        self._verified: tuple | None = None

    def make_in_proj(self, config, parallel: ParallelContext) -> MergedColumnParallelLinear:
        """in_proj_qkv | in_proj_z | in_proj_b | in_proj_a, one GEMM; in_proj_qkv's q, k and v
        split across ranks each by head."""
        full_key, full_value = config.linear_num_key_heads * self.k_dim, value_dim_of(config)
        heads = config.linear_num_value_heads
        sections = [[full_key, full_key, full_value], [full_value], [heads], [heads]]
        return MergedColumnParallelLinear(config.hidden_size, [sum(pieces) for pieces in sections], False,
                                          parallel, sections=sections)

    def bind_state(self, conv_states: torch.Tensor, recurrent_states: torch.Tensor) -> None:
        self.conv_states, self.recurrent_states = conv_states, recurrent_states

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        slots = meta.state_slots
        if meta.state_index is None and (slots is None or len(slots) != meta.num_seqs):
            raise RuntimeError("a Gated DeltaNet layer needs one state slot per sequence of the step "
                               "(AttentionMetadata.state_slots)")
        mixed, z, b, a = self.project(hidden)
        g, beta = gates(b, a, self.A_log, self.dt_bias, self._kernels(mixed))
        self._verified = None
        if meta.state_index is not None:  # a decode step of a captured graph: its static slot index
            out = self._decode(mixed, g, beta, meta.state_index)
        elif meta.max_query_len == 1:
            out = self._decode_rows(mixed, g, beta, slots)
        else:
            out = self._mixed_step(mixed, g, beta, meta, slots)
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

    def _mixed_step(self, mixed, g, beta, meta: AttentionMetadata, slots: list[int]) -> torch.Tensor:
        """A step with chunks of several tokens: each chunk on its own (``_sequence``), the rows of
        one token of sequences under way together (``_decode_rows``), as in a decode step."""
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32,
                          device=mixed.device)
        rows, row_slots = [], []
        for s, e, slot, fresh in self._spans(meta, slots):
            if e - s == 1 and not fresh:
                rows.append(s)
                row_slots.append(slot)
            else:
                out[s:e] = self._sequence(mixed[s:e], g[s:e], beta[s:e], slot, fresh)
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=mixed.device)
            out[index] = self._decode_rows(mixed[index], g[index], beta[index], row_slots)
        return out

    def _decode_rows(self, mixed, g, beta, slots: list[int]) -> torch.Tensor:
        """Rows of one token each; the rows of a slot that comes more than once (a verification's)
        step it in turn, and its state before them and their inputs are kept (``roll_back``)."""
        if len(set(slots)) == len(slots):
            return self._decode(mixed, g, beta, slots)
        waves = row_waves(slots)
        verifying = sorted({slots[i] for i in waves[1]})
        index = torch.tensor(verifying, dtype=torch.long, device=mixed.device)
        inputs = {}
        for slot in verifying:
            rows = torch.tensor([i for i, s in enumerate(slots) if s == slot], device=mixed.device)
            inputs[slot] = (mixed[rows], g[rows], beta[rows])
        self._verified = (verifying, self.conv_states.index_select(0, index),
                          self.recurrent_states.index_select(0, index), inputs)
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32,
                          device=mixed.device)
        for wave in waves:
            rows = torch.tensor(wave, dtype=torch.long, device=mixed.device)
            out[rows] = self._decode(mixed[rows], g[rows], beta[rows], [slots[i] for i in wave])
        return out

    def roll_back(self, rollbacks: list[list[int]]) -> None:
        """Each [slot, kept] of the last step's verifications: the slot takes back its state from
        before the step and steps through its first ``kept`` rows again, as decode steps (the
        arithmetic of plain decoding: the state is the one plain decoding reaches)."""
        if self._verified is None:
            raise RuntimeError("a state rollback without a verification in the step before")
        verifying, conv, recurrent, inputs = self._verified
        self._verified = None
        for slot, _ in rollbacks:
            i = verifying.index(slot)
            self.conv_states[slot] = conv[i]
            self.recurrent_states[slot] = recurrent[i]
        for j in range(max(kept for _, kept in rollbacks)):
            wave = [slot for slot, kept in rollbacks if kept > j]
            mixed, g, beta = (torch.stack([inputs[slot][part][j] for slot in wave]) for part in range(3))
            self._decode(mixed, g, beta, wave)

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
        if gpu_rules.takes(mixed):  # CUDA with fla-core: its kernels (layers/gated_delta_gpu.py)
            return gpu_rules.prefill(mixed, self.conv1d.weight[:, 0], conv_state, state, g, beta, self._qkv)
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

    def _decode(self, mixed, g, beta, slots: list[int] | torch.Tensor) -> torch.Tensor:
        """One token of each sequence at distinct ``slots`` (a list, or an index tensor on the device):
        on the CPU the C step on the slots' rows in place; with fla-core on CUDA its kernels; else
        their states gathered, stepped and written back."""
        index = slots if isinstance(slots, torch.Tensor) else torch.tensor(slots, dtype=torch.long,
                                                                          device=mixed.device)
        weight = self.conv1d.weight[:, 0]
        kernels = self._kernels(mixed)
        if kernels is not None:
            return kernels.decode(mixed, weight, self.conv_states, self.recurrent_states, index, g, beta,
                                  self.num_k_heads, self.k_dim)
        if gpu_rules.takes(mixed):
            return gpu_rules.decode(mixed, weight, self.conv_states, self.recurrent_states, index, g, beta,
                                    self._qkv)
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


class Qwen3_5DecoderLayer(nn.Module):
    linear_class = GatedDeltaNet
    in_decode_row = True

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
        self._decode_row = False  # not decided yet (``decode_row``)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if (row := self.decode_row()) is not None and (out := row(hidden, positions, meta)):
            return self.norm(*out)[0]  # a decode step through every layer in one kernel call
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        return self.norm(hidden, residual)[0]

    def decode_row(self):
        """The fused one-token step (``models/decode_row_hybrid.py``), or None; decided once."""
        if self._decode_row is False:
            self._decode_row = HybridDecodeRow(self) if HybridDecodeRow.fits(self) else None
        return self._decode_row


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
        """This rank's (its heads of the linear layers: ``state_shapes(config, tp_size)``)."""
        layer = self.state_layers()[0]
        window = layer.conv1d.weight.shape[-1] - 1
        return ((layer.conv_size, window), (layer.num_v_heads, layer.k_dim, layer.v_dim))
