"""The torch-ops plans of the CPU attention backend (``cpu_backend``): a step's shape as numpy
arrays, and from it the decode groups and prefill chunks its layers attend over, made on the
host once per step (and per sliding window: a window layer reads only the blocks that hold keys
inside its window, so its plans differ from a full layer's).

A window of W tokens lets the query at position p see keys max(0, p - W + 1) .. p
(``backend``'s docstring). A plan for it starts each sequence's gather at the block holding its
first visible key, so blocks wholly behind the window are never read: the cache manager frees
them as the sequence moves on, and they may hold another sequence's keys by then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvserve.engine.layers.attention.backend import to_device
from kvserve.engine.model_input import ModelInput, blocks_for, step_block_tables

# A decode group is cut where a sequence's context is shorter than this share of the group's
# longest: below it, padding would cost more than running one more group.
DECODE_GROUP_MIN_FILL = 0.5


@dataclass
class DecodeGroup:
    tokens: torch.Tensor  # int64 [n]: where the group's queries sit in the flat batch
    gather_blocks: torch.Tensor  # int64 [n * max_blocks]: block ids, padded with block 0
    key_bias: torch.Tensor | None  # [1, n, 1, max_blocks * block_size]: 0 for a key, -inf otherwise
    num_seqs: int
    padded_len: int
    cache_rows: torch.Tensor | None = None  # gather_blocks as rows of the [kv_heads * blocks, ...] view

    def rows_in(self, cache: torch.Tensor) -> torch.Tensor:
        """int64 [kv_heads * n * max_blocks]: for each KV head in turn, this group's blocks as
        rows of ``cache`` [kv_heads, blocks, block_size, W] seen as [kv_heads * blocks, block_size * W]
        (W: D, or D + 4 in an int8 cache)
        (computed by the first layer of the step, reused by the others)."""
        if self.cache_rows is None:
            kv_heads, num_blocks = cache.shape[:2]
            heads = torch.arange(kv_heads, device=cache.device)[:, None] * num_blocks
            self.cache_rows = (heads + self.gather_blocks[None, :]).view(-1)
        return self.cache_rows


@dataclass
class DecodePlan:
    groups: list[DecodeGroup]
    tokens: torch.Tensor  # int64: every decode query, in group order


@dataclass
class PrefillPlan:
    start: int  # the chunk's tokens are [start, end) of the flat batch
    end: int
    context_len: int  # keys read: positions [key_start, key_start + context_len)
    blocks: torch.Tensor | None  # int64 block ids holding the context, when they must be gathered
    block_range: tuple[int, int] | None  # [first, last) block ids when they are consecutive: a view
    mask: torch.Tensor | None  # bool [query_len, context_len]; None = plain causal over new K/V
    from_cache: bool = False  # keys from the cache (earlier tokens are there only); else the new K/V
    key_start: int = 0  # position of the first key read (a window's first block)


class HostStep(NamedTuple):
    """A step's shape as numpy arrays, for planning."""

    query_lens: np.ndarray  # int64 [num_seqs]
    context_lens: np.ndarray  # int64 [num_seqs]
    starts: np.ndarray  # int64 [num_seqs + 1]: where each sequence's tokens begin in the flat batch
    tables: np.ndarray  # int32 [num_seqs, blocks]: the step's block tables, block 0 past each context


def host_step(inp: ModelInput, block_size: int) -> HostStep:
    query_lens = np.asarray(inp.query_lens, dtype=np.int64)
    context_lens = np.asarray(inp.context_lens, dtype=np.int64)
    starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=starts[1:])
    tables = step_block_tables(inp)
    if inp.block_tables:  # lists built by hand: they may be short, or longer than their context
        needed = blocks_for(context_lens, block_size)
        have = np.fromiter(map(len, inp.block_tables), dtype=np.int64, count=len(inp.block_tables))
        short = np.flatnonzero(have < needed)
        if short.size:
            i = int(short[0])
            raise ValueError(f"sequence {i} has context length {inp.context_lens[i]} but only {have[i]} "
                             f"blocks of {block_size} in its block table")
        tables = np.where(np.arange(tables.shape[1]) < needed[:, None], tables, 0).astype(np.int32)
    return HostStep(query_lens, context_lens, starts, tables)


def first_block(lowest_position, window: int | None, block_size: int):
    """The block holding the first key a query at ``lowest_position`` sees (0 without a window);
    an int, or a numpy array elementwise."""
    if window is None:
        return lowest_position * 0
    return np.maximum(lowest_position - window + 1, 0) // block_size


def plan_decode(step: HostStep, seqs: np.ndarray, block_size: int, window: int | None,
                device: torch.device) -> DecodePlan:
    contexts = step.context_lens[seqs]
    skipped = first_block(contexts - 1, window, block_size) * block_size  # keys before the first block read
    lens = contexts - skipped  # keys from the first block read to the query
    order = np.argsort(-lens, kind="stable")  # longest first
    seqs, falling = seqs[order], -lens[order]  # ``falling``: ascending negated lengths
    groups, first = [], 0
    while first < len(seqs):  # a group ends before the first context below its fill threshold
        end = int(np.searchsorted(falling, DECODE_GROUP_MIN_FILL * falling[first], side="right"))
        groups.append(seqs[first : max(end, first + 1)])
        first = max(end, first + 1)
    planned = [_plan_decode_group(step, group, block_size, window, device) for group in groups]
    return DecodePlan(planned, torch.cat([group.tokens for group in planned]))


def _plan_decode_group(step: HostStep, seqs: np.ndarray, block_size: int, window: int | None,
                       device: torch.device) -> DecodeGroup:
    contexts = step.context_lens[seqs]
    starts = first_block(contexts - 1, window, block_size)
    ends = blocks_for(contexts, block_size)
    max_blocks = int((ends - starts).max())
    padded_len = max_blocks * block_size
    columns = starts[:, None] + np.arange(max_blocks)
    inside = columns < ends[:, None]
    held = np.take_along_axis(step.tables[seqs], np.minimum(columns, ends[:, None] - 1), 1)
    blocks = np.where(inside, held, 0)
    keys = starts[:, None] * block_size + np.arange(padded_len)  # each gathered row's position
    visible = keys < contexts[:, None]
    if window is not None:
        visible &= keys > contexts[:, None] - 1 - window
    key_bias = None
    if not visible.all():
        key_bias = to_device(np.where(visible, np.float32(0), np.float32(-np.inf)), device, torch.float32)
        key_bias = key_bias.view(1, len(seqs), 1, padded_len)
    return DecodeGroup(
        tokens=to_device(step.starts[seqs], device),
        gather_blocks=to_device(blocks.reshape(-1), device),
        key_bias=key_bias,
        num_seqs=len(seqs),
        padded_len=padded_len,
    )


def plan_prefill(step: HostStep, seq: int, block_size: int, window: int | None,
                 device: torch.device) -> PrefillPlan:
    q_len, ctx, start = int(step.query_lens[seq]), int(step.context_lens[seq]), int(step.starts[seq])
    from_cache = ctx > q_len  # earlier tokens (prefix hit or earlier chunk) are only in the cache
    if not from_cache and window is None:
        return PrefillPlan(start, start + q_len, ctx, None, None, None)
    key_start = int(first_block(ctx - q_len, window, block_size)) * block_size if from_cache else 0
    plan = PrefillPlan(start, start + q_len, ctx - key_start, None, None, None, from_cache, key_start)
    if from_cache:
        table = step.tables[seq, key_start // block_size : blocks_for(ctx, block_size)]
        first = int(table[0])
        if np.array_equal(table, np.arange(first, first + len(table))):
            plan.block_range = (first, first + len(table))
        else:
            plan.blocks = to_device(table, device)
    positions = torch.arange(q_len, device=device)[:, None] + (ctx - q_len)
    keys = torch.arange(key_start, ctx, device=device)[None, :]
    plan.mask = keys <= positions
    if window is not None:
        plan.mask &= keys > positions - window
    return plan
