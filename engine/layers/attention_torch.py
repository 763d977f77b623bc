"""The torch attention backend: the CPU path and the reference the kernels are tested against.

Per step, ``build_metadata`` plans the work on the host (no device sync later):
- every sequence with query length 1 (decodes, and one-token prefill chunks) is a decode. The
  decodes are sorted by context length and cut into a few groups of similar length, so that
  padding stays small; each group gathers its K/V blocks with one ``index_select`` into a
  padded [n, L, kv_heads * D] batch and attends with two batched matmuls (see ``_decode``);
- every longer chunk is a prefill: with nothing cached before it, it attends causally to its
  own new K/V; otherwise it reads its context back from the cache under an offset causal mask.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.engine.layers.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    common_metadata_fields,
    to_device,
)
from kvserve.engine.model_input import ModelInput

# A decode group is cut where a sequence's context is shorter than this share of the group's
# longest: below it, padding would cost more than running one more group.
DECODE_GROUP_MIN_FILL = 0.5


@dataclass
class DecodeGroup:
    tokens: torch.Tensor  # int64 [n]: where the group's queries sit in the flat batch
    gather_blocks: torch.Tensor  # int64 [n * max_blocks]: block ids, padded with block 0
    key_bias: torch.Tensor  # [n, 1, max_blocks * block_size]: 0 for a key, -inf for padding
    num_seqs: int
    padded_len: int


@dataclass
class DecodePlan:
    groups: list[DecodeGroup]
    tokens: torch.Tensor  # int64: every decode query, in group order


@dataclass
class PrefillPlan:
    start: int  # the chunk's tokens are [start, end) of the flat batch
    end: int
    context_len: int
    blocks: torch.Tensor | None  # int64 block ids holding the context; None = no cached context
    mask: torch.Tensor | None  # bool [query_len, context_len]; None = plain causal


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    store_tokens: torch.Tensor | None = None  # tokens whose slot is not -1; None = every token
    store_slots: torch.Tensor | None = None  # their slots (``slot_mapping`` when None above)
    decode: DecodePlan | None = None
    prefills: list[PrefillPlan] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, inp: ModelInput, device: torch.device) -> TorchAttentionMetadata:
        meta = TorchAttentionMetadata(**common_metadata_fields(inp, self.block_size, device))
        if any(slot < 0 for slot in inp.slot_mapping):
            keep = [i for i, slot in enumerate(inp.slot_mapping) if slot >= 0]
            meta.store_tokens = to_device(keep, device)
            meta.store_slots = meta.slot_mapping.index_select(0, meta.store_tokens)
        starts = list(itertools.accumulate(inp.query_lens, initial=0))  # host-side: no device sync
        decode_seqs = [i for i, q in enumerate(inp.query_lens) if q == 1]
        if decode_seqs:
            meta.decode = self._plan_decode(inp, decode_seqs, starts, device)
        meta.prefills = [
            self._plan_prefill(inp, i, starts[i], device) for i, q in enumerate(inp.query_lens) if q > 1
        ]
        return meta

    def create_impl(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> AttentionImpl:
        return TorchAttentionImpl(num_heads, num_kv_heads, head_dim, scale)

    def _plan_decode(self, inp: ModelInput, seqs: list[int], starts: list[int],
                     device: torch.device) -> DecodePlan:
        seqs = sorted(seqs, key=lambda i: -inp.context_lens[i])
        groups, current = [], [seqs[0]]
        for i in seqs[1:]:
            if inp.context_lens[i] < DECODE_GROUP_MIN_FILL * inp.context_lens[current[0]]:
                groups.append(current)
                current = []
            current.append(i)
        groups.append(current)
        planned = [self._plan_decode_group(inp, group, starts, device) for group in groups]
        return DecodePlan(planned, torch.cat([group.tokens for group in planned]))

    def _plan_decode_group(self, inp: ModelInput, seqs: list[int], starts: list[int],
                           device: torch.device) -> DecodeGroup:
        lens = [inp.context_lens[i] for i in seqs]
        max_blocks = -(-max(lens) // self.block_size)
        padded_len = max_blocks * self.block_size
        flat_blocks = []
        for i in seqs:
            table = self._context_blocks(inp, i)
            flat_blocks += table + [0] * (max_blocks - len(table))
        lens_t = to_device(lens, device)
        is_pad = torch.arange(padded_len, device=device)[None, None, :] >= lens_t[:, None, None]
        key_bias = torch.zeros(is_pad.shape, device=device).masked_fill_(is_pad, float("-inf"))
        return DecodeGroup(
            tokens=to_device([starts[i] for i in seqs], device),
            gather_blocks=to_device(flat_blocks, device),
            key_bias=key_bias,
            num_seqs=len(seqs),
            padded_len=padded_len,
        )

    def _plan_prefill(self, inp: ModelInput, seq: int, start: int, device: torch.device) -> PrefillPlan:
        q_len, ctx = inp.query_lens[seq], inp.context_lens[seq]
        plan = PrefillPlan(start, start + q_len, ctx, None, None)
        if ctx > q_len:  # earlier tokens (prefix hit or earlier chunk) are only in the cache
            plan.blocks = to_device(self._context_blocks(inp, seq), device)
            rows = torch.arange(q_len, device=device)[:, None] + (ctx - q_len)
            plan.mask = torch.arange(ctx, device=device)[None, :] <= rows
        return plan

    def _context_blocks(self, inp: ModelInput, seq: int) -> list[int]:
        needed = -(-inp.context_lens[seq] // self.block_size)
        table = inp.block_tables[seq]
        if len(table) < needed:
            raise ValueError(
                f"sequence {seq} has context length {inp.context_lens[seq]} but only {len(table)} "
                f"blocks of {self.block_size} in its block table"
            )
        return table[:needed]


class TorchAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._head_masks: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        self._store(k, v, k_cache, v_cache, meta)
        decode = meta.decode
        out = torch.empty_like(q)
        if decode is not None:
            parts = [self._decode(q.index_select(0, g.tokens), k_cache, v_cache, g) for g in decode.groups]
            out.index_copy_(0, decode.tokens, parts[0] if len(parts) == 1 else torch.cat(parts))
        for plan in meta.prefills:
            out[plan.start : plan.end] = self._prefill(q, k, v, k_cache, v_cache, plan)
        return out

    def _store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: TorchAttentionMetadata) -> None:
        slots = meta.slot_mapping
        if meta.store_tokens is not None:
            k, v, slots = k[meta.store_tokens], v[meta.store_tokens], meta.store_slots
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                group: DecodeGroup) -> torch.Tensor:
        """Attention of n one-token queries over their padded contexts.

        The gathered K/V stay as they lie in the cache, [n, L, kv_heads * D], and each query is
        spread into a block-diagonal [heads, kv_heads * D] (zeros outside its KV head's slice), so
        both products are plain contiguous batched matmuls; the extra multiply-adds by zero cost
        less than making K/V head-major would.
        """
        n, length, width = group.num_seqs, group.padded_len, self.num_kv_heads * self.head_dim
        keys = k_cache.index_select(0, group.gather_blocks).view(n, length, width)
        values = v_cache.index_select(0, group.gather_blocks).view(n, length, width)
        spread = q.repeat(1, 1, self.num_kv_heads) * self._head_mask(q)  # [n, heads, width], scaled
        scores = torch.bmm(spread, keys.transpose(1, 2)) + group.key_bias
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs, values)  # [n, heads, width]: each head's own slice is the answer
        group_size = self.num_heads // self.num_kv_heads
        out = out.view(n, self.num_kv_heads, group_size, self.num_kv_heads, self.head_dim)
        return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, self.num_heads, self.head_dim)

    def _head_mask(self, q: torch.Tensor) -> torch.Tensor:
        """[heads, kv_heads * D]: the softmax scale where query head h meets its KV head
        h // group, else 0."""
        key = (q.dtype, q.device)
        if key not in self._head_masks:
            group_size = self.num_heads // self.num_kv_heads
            kv_of_head = torch.arange(self.num_heads, device=q.device) // group_size
            kv_of_column = torch.arange(self.num_kv_heads * self.head_dim, device=q.device) // self.head_dim
            meets = kv_of_head[:, None] == kv_of_column[None, :]
            self._head_masks[key] = (meets * self.scale).to(q.dtype)
        return self._head_masks[key]

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
        if plan.blocks is None:
            keys, values = k[plan.start : plan.end], v[plan.start : plan.end]
        else:
            keys = k_cache.index_select(0, plan.blocks).flatten(0, 1)[: plan.context_len]
            values = v_cache.index_select(0, plan.blocks).flatten(0, 1)[: plan.context_len]
        # 4-D inputs, or CPU SDPA falls back from its flash kernel to the slow math path
        out = F.scaled_dot_product_attention(
            q[plan.start : plan.end].transpose(0, 1)[None], keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None], attn_mask=plan.mask, is_causal=plan.mask is None,
            scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return out[0].transpose(0, 1)
