"""The torch attention backend: the CPU path and the reference the kernels are tested against.

Per step, ``build_metadata`` plans the work on the host (no device sync later):
- every sequence with query length 1 (decodes, and one-token prefill chunks) joins one decode
  group: their K/V blocks are gathered in one ``index_select`` into a padded [n, L] batch and
  attended with one masked ``scaled_dot_product_attention``, the query heads of each KV head
  laid out as rows so no K/V is repeated;
- every longer chunk is a prefill: with nothing cached before it, it attends causally to its
  own new K/V; otherwise it reads its context back from the cache under an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.engine.layers.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    common_metadata_fields,
)
from kvserve.engine.model_input import ModelInput


@dataclass
class DecodePlan:
    tokens: slice | torch.Tensor  # where the decode queries sit in the flat batch
    gather_blocks: torch.Tensor  # int64 [num_seqs * max_blocks]: block ids, padded with block 0
    mask: torch.Tensor  # bool [num_seqs, 1, 1, max_blocks * block_size]: True = a valid key
    num_seqs: int
    padded_len: int


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
            meta.store_tokens = torch.tensor(keep, dtype=torch.int64, device=device)
            meta.store_slots = meta.slot_mapping.index_select(0, meta.store_tokens)
        starts = meta.query_start_loc.tolist()
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
        tokens = [starts[i] for i in seqs]
        contiguous = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
        lens = [inp.context_lens[i] for i in seqs]
        max_blocks = -(-max(lens) // self.block_size)
        tables = [self._context_blocks(inp, i) for i in seqs]
        flat_blocks = [b for table in tables for b in table + [0] * (max_blocks - len(table))]
        padded_len = max_blocks * self.block_size
        lens_t = torch.tensor(lens, device=device)
        mask = torch.arange(padded_len, device=device)[None, :] < lens_t[:, None]
        return DecodePlan(
            tokens=slice(tokens[0], tokens[0] + len(tokens)) if contiguous
            else torch.tensor(tokens, dtype=torch.int64, device=device),
            gather_blocks=torch.tensor(flat_blocks, dtype=torch.int64, device=device),
            mask=mask.view(len(seqs), 1, 1, padded_len),
            num_seqs=len(seqs),
            padded_len=padded_len,
        )

    def _plan_prefill(self, inp: ModelInput, seq: int, start: int, device: torch.device) -> PrefillPlan:
        q_len, ctx = inp.query_lens[seq], inp.context_lens[seq]
        plan = PrefillPlan(start, start + q_len, ctx, None, None)
        if ctx > q_len:  # earlier tokens (prefix hit or earlier chunk) are only in the cache
            plan.blocks = torch.tensor(self._context_blocks(inp, seq), dtype=torch.int64, device=device)
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
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        self._store(k, v, k_cache, v_cache, meta)
        decode = meta.decode
        if decode is not None and not meta.prefills:
            return self._decode(q[decode.tokens], k_cache, v_cache, decode)
        out = torch.empty_like(q)
        if decode is not None:
            out[decode.tokens] = self._decode(q[decode.tokens], k_cache, v_cache, decode)
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
                plan: DecodePlan) -> torch.Tensor:
        n, length = plan.num_seqs, plan.padded_len
        shape = (n, length, self.num_kv_heads, self.head_dim)
        keys = k_cache.index_select(0, plan.gather_blocks).view(shape).transpose(1, 2)
        values = v_cache.index_select(0, plan.gather_blocks).view(shape).transpose(1, 2)
        # the query heads sharing a KV head become rows of one [group, D] query: no K/V repeat
        grouped = q.reshape(n, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.mask, scale=self.scale)
        return out.reshape(n, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
        if plan.blocks is None:
            keys, values = k[plan.start : plan.end], v[plan.start : plan.end]
        else:
            keys = k_cache.index_select(0, plan.blocks).flatten(0, 1)[: plan.context_len]
            values = v_cache.index_select(0, plan.blocks).flatten(0, 1)[: plan.context_len]
        out = F.scaled_dot_product_attention(
            q[plan.start : plan.end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=plan.mask, is_causal=plan.mask is None, scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return out.transpose(0, 1)
