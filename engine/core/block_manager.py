"""The paged KV cache's control plane: which block holds which tokens (plain Python, no torch).

- Blocks are fixed-size; a sequence's ``block_table`` lists its block ids in order.
- Prefix caching: a *full* block is identified by a chained xxhash64 over (previous block's
  hash, this block's token ids). A hit also needs equal token ids and an equal parent hash
  (collision guard: the block stores both, so a hash collision anywhere in the chain misses).
  A request's ``cache_salt`` stands in for the first block's previous hash (``salt_root``), so
  only requests with the same salt share blocks.
- Two sequences that compute the same block at once leave two blocks with one hash; only
  one is in the hash table. When that one is evicted, a surviving duplicate takes its place,
  so the prefix stays cached as long as one copy of its KV exists.
- The hit rate counts a sequence's first admission only: recomputation after preemption is
  the engine's own doing, not a client's repeated prefix.
- A block's hash is published only by ``commit``, which the engine calls after the step
  that wrote the block's KV, so no request can hit a block whose KV does not exist yet.
- New blocks come from the head of the free list. Freed blocks that hold a published hash
  keep it and go to the tail (least recently freed reused first), so a later request can
  still hit them. Freed blocks with nothing to hit (a sequence's partial last block, any
  block with prefix caching off) go to the head: reused most recently freed first, before
  any block never used. The CPU cache is a lazily zeroed memory map whose pages take memory
  at first touch, so reusing warm blocks keeps the resident KV at the working set instead of
  walking through the whole cache; only cached prefixes (which are worth their memory) make
  it grow towards the configured size.
- KV-cache events (``kv_events``, a list when the server publishes them, else None): a tuple is
  appended when a hash enters the table (``STORED``), leaves it (``REMOVED``: the last block
  holding it was reused) or the whole table is dropped (``CLEARED``); the engine core hands the
  list over after each step. That append is the only cost on the step; the front-end groups and
  encodes them (engine/frontend/kv_events.py).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from kvserve.engine.model_input import blocks_for
from kvserve.engine.sequence import Sequence


def block_hash(prev_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    """xxhash64 chained over the previous block's hash and this block's token ids."""
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


# the kinds of KV-cache event tuples: (STORED, hash, parent_hash, token_ids), (REMOVED, hash), (CLEARED,)
STORED, REMOVED, CLEARED = 0, 1, 2


def salt_root(salt: str | None) -> int | None:
    """The hash a salted sequence's first block chains from (None: unsalted, the shared cache)."""
    if salt is None:
        return None
    return xxhash.xxh64(b"kvserve cache_salt\0" + salt.encode("utf-8", "surrogatepass")).intdigest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent_hash: int | None = None  # the previous block's hash when this one was published


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # popped from the front: hashless freed blocks (most recent first), never-used blocks,
        # then blocks holding a cached prefix, least recently freed first
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # published blocks whose hash another block already holds in hash_to_block
        self.duplicates: dict[int, set[int]] = {}
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which found
        self.kv_events: list[tuple] | None = None  # see the module's docstring

    def take_kv_events(self) -> list[tuple]:
        """The events since the last call (empty when they are not collected)."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use, since running
        sequences chain their next hashes on the blocks they hold."""
        if len(self.free_ids) != len(self.blocks):
            return False
        for block in self.blocks:
            block.hash, block.token_ids, block.parent_hash = None, None, None
        self.hash_to_block.clear()
        self.duplicates.clear()
        if self.kv_events is not None:
            self.kv_events.append((CLEARED,))
        return True

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def check_integrity(self) -> None:
        """Invariants tests can call: refcounts match the free list; the hash table is consistent."""
        for b in self.blocks:
            assert b.ref_count >= 0, b
            assert (b.ref_count == 0) == (b.block_id in self.free_ids), b
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h, (h, self.blocks[bid])
        for h, bids in self.duplicates.items():
            assert bids and h in self.hash_to_block, (h, bids)
            for bid in bids:
                assert self.blocks[bid].hash == h and self.hash_to_block[h] != bid, (h, self.blocks[bid])

    # ---- prefix cache -----------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (full blocks only).

        The block holding the last token is never matched: at least one token must be
        computed to produce logits, even when the whole prompt is cached.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        prev = salt_root(seq.params.cache_salt)
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(prev, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or not self._holds(bid, prev, tokens):
                break
            hits.append(bid)
            prev = h
        return hits

    def _holds(self, bid: int, parent: int | None, tokens: tuple[int, ...]) -> bool:
        """Collision guard: the block really holds ``tokens`` after the block hashed ``parent``."""
        block = self.blocks[bid]
        return block.token_ids == tokens and block.parent_hash == parent

    # ---- allocation -------------------------------------------------------------------
    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether ``seq`` (empty block table) can take ``hits`` and cover its first chunk."""
        reused_free = sum(1 for bid in hits if self.blocks[bid].ref_count == 0)
        covered = len(hits) * self.block_size + num_new_tokens
        fresh = self.blocks_needed(covered) - len(hits)
        return reused_free + fresh <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give an un-admitted sequence its cached prefix blocks and count the lookup."""
        assert not seq.block_table, seq
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_ids[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.query_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed_tokens

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.missing_blocks(seq, num_new_tokens) <= len(self.free_ids)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append blocks so that the next ``num_new_tokens`` tokens of ``seq`` have slots."""
        self.take_blocks(seq, self.missing_blocks(seq, num_new_tokens))

    def missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` lacks for its next ``num_new_tokens`` tokens."""
        return max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def take_blocks(self, seq: Sequence, count: int) -> None:
        """Append ``count`` free blocks to ``seq``'s table (``missing_blocks`` says how many)."""
        if count > len(self.free_ids):
            raise RuntimeError(f"out of KV blocks: need {count}, {self.num_free_blocks} free")
        for _ in range(count):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        bid, _ = self.free_ids.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            self._unpublish(block)
        block.hash, block.token_ids, block.parent_hash, block.ref_count = None, None, None, 1
        return bid

    def _publish(self, block: Block) -> None:
        registered = self.hash_to_block.setdefault(block.hash, block.block_id)
        if registered != block.block_id:
            self.duplicates.setdefault(block.hash, set()).add(block.block_id)
        elif self.kv_events is not None:
            self.kv_events.append((STORED, block.hash, block.parent_hash, block.token_ids))

    def _unpublish(self, block: Block) -> None:
        """``block`` is being reused: its hash leaves the table, or passes to a surviving copy."""
        h = block.hash
        copies = self.duplicates.get(h)
        if self.hash_to_block.get(h) == block.block_id:
            if copies:
                self.hash_to_block[h] = copies.pop()
            else:
                del self.hash_to_block[h]
                if self.kv_events is not None:
                    self.kv_events.append((REMOVED, h))
        elif copies is not None:
            copies.discard(block.block_id)
        if copies is not None and not copies:
            del self.duplicates[h]

    def commit(self, seq: Sequence) -> None:
        """Publish the hashes of blocks whose KV is now fully written (call after a step)."""
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        start = seq.num_hashed_blocks
        if full <= start or not self.enable_prefix_caching:  # most steps: no block filled up
            return
        prev = self.blocks[seq.block_table[start - 1]].hash if start else salt_root(seq.params.cache_salt)
        for i in range(start, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                block.hash, block.token_ids, block.parent_hash = block_hash(prev, tokens), tokens, prev
                self._publish(block)
            prev = block.hash
        seq.num_hashed_blocks = full

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past those ``num_tokens`` tokens need: slots a verification step
        took for drafts it rejected (never published: only committed tokens are hashed)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            bid = seq.block_table.pop()
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[bid] = None
                if block.hash is None:
                    self.free_ids.move_to_end(bid, last=False)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks at zero keep their hash for later hits.

        Walks the table backwards so that a sequence's suffix is evicted before its prefix.
        """
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, block
            if block.ref_count == 0:
                self.free_ids[bid] = None
                if block.hash is None:  # nothing to hit: reuse it (warm) before anything else
                    self.free_ids.move_to_end(bid, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
