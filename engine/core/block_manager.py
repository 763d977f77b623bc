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
  any block never used. The CPU cache is a lazily zeroed memory map (pages take memory at first
  touch): reusing warm blocks keeps the resident KV at the working set; only cached prefixes make
  it grow towards the configured size.
- KV cache groups (engine/kv_cache/groups.py; ``windows``: each group's sliding window, None
  for full attention): one pool of blocks, one block table per group and sequence, all as long.
  Every group takes a block per column; a window group gives back, after each step, the blocks
  wholly behind its window (their columns then hold ``NULL_BLOCK``, reserved for that), so a
  decoding sequence holds at most ceil(W / block_size) + 1 of them. Hashes stay one chain per
  sequence (``Sequence.block_hashes``); each group publishes its own blocks under them, and a
  prefix hit needs every full group's blocks up to the hit and each window group's blocks of the
  last W - 1 tokens before it (``match_prefix``). Recurrent states: engine/kv_cache/state_slots.py.
- KV-cache events (``kv_events``, a list when the server publishes them, else None): a tuple when
  a hash enters the table (``STORED``), leaves it (``REMOVED``: its last block was reused) or the
  table is dropped (``CLEARED``), handed over after each step (engine/frontend/kv_events.py).
"""

from __future__ import annotations

from collections import OrderedDict

from kvserve.engine.kv_cache.blocks import CLEARED, REMOVED, STORED, Block, block_hash, salt_root
from kvserve.engine.kv_cache.groups import NULL_BLOCK, Hits, first_live_block, peak_blocks
from kvserve.engine.kv_cache.state_slots import StateSlots
from kvserve.engine.model_input import blocks_for
from kvserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,), state_slots: int = 0,
                 state_snapshots: int = 0):
        self.windows = tuple(windows)  # per KV cache group: its sliding window (None: full attention)
        self.reserved = 1 if any(w is not None for w in self.windows) else 0  # NULL_BLOCK
        if num_blocks < 1 + self.reserved or block_size < 1:
            raise ValueError(f"need num_blocks >= {1 + self.reserved} and block_size >= 1, "
                             f"got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # popped from the front: hashless freed blocks (most recent first), never-used blocks,
        # then blocks holding a cached prefix, least recently freed first
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.reserved, num_blocks))
        # per group: hash -> block, and published blocks whose hash another block already holds
        self.hash_tables: list[dict[int, int]] = [{} for _ in self.windows]
        self.duplicate_sets: list[dict[int, set[int]]] = [{} for _ in self.windows]
        self.hash_to_block, self.duplicates = self.hash_tables[0], self.duplicate_sets[0]
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which found
        self.kv_events: list[tuple] | None = None  # see the module's docstring
        if state_slots and enable_prefix_caching and not state_snapshots:  # a hit needs the state too
            raise ValueError("prefix caching needs state snapshots, which a model with state slots lacks")
        self.state_slots = StateSlots(state_slots, state_snapshots) if state_slots else None

    num_groups = property(lambda self: len(self.windows))

    def take_kv_events(self) -> list[tuple]:
        """The events since the last call (empty when they are not collected)."""
        events, self.kv_events = self.kv_events, (None if self.kv_events is None else [])
        return events or []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use, since running
        sequences chain their next hashes on the blocks they hold."""
        if len(self.free_ids) != self.num_blocks:
            return False
        for block in self.blocks:
            block.hash, block.token_ids, block.parent_hash = None, None, None
        for table, duplicates in zip(self.hash_tables, self.duplicate_sets, strict=True):
            table.clear()
            duplicates.clear()
        if self.kv_events is not None:
            self.kv_events.append((CLEARED,))
        if self.state_slots is not None:
            self.state_slots.clear_snapshots()
        return True

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks sequences can take (the null block, reserved with window groups, is not one)."""
        return len(self.blocks) - self.reserved

    num_free_blocks = property(lambda self: len(self.free_ids))

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        """Columns of a block table holding ``num_tokens`` tokens (one block per group each)."""
        return blocks_for(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Blocks over every group a sequence of ``num_tokens`` tokens may hold at once, its steps
        computing up to ``chunk`` tokens (window groups hold only their window's)."""
        return peak_blocks(self.windows, num_tokens, chunk, self.block_size)

    def blocks_held(self, seq: Sequence, group: int) -> int:
        """Blocks ``seq`` holds in ``group`` (its table's columns less those freed behind a window)."""
        return sum(1 for bid in seq.block_tables[group] if bid != NULL_BLOCK or not self.reserved)

    def check_integrity(self) -> None:
        """Invariants tests can call: refcounts match the free list; the hash tables are consistent."""
        for b in self.blocks[self.reserved :]:
            assert b.ref_count >= 0, b
            assert (b.ref_count == 0) == (b.block_id in self.free_ids), b
        for g, (table, duplicates) in enumerate(zip(self.hash_tables, self.duplicate_sets, strict=True)):
            for h, bid in table.items():
                assert self.blocks[bid].hash == h and self.blocks[bid].group == g, (h, self.blocks[bid])
            for h, bids in duplicates.items():
                assert bids and h in table, (h, bids)
                for bid in bids:
                    assert self.blocks[bid].hash == h and table[h] != bid, (h, self.blocks[bid])

    # ---- prefix cache -----------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> Hits:
        """Every group's blocks holding the longest cached prefix of ``seq`` (full blocks only):
        a full group needs each block up to the hit, a window group those its window reaches
        from the first token after it.

        The block holding the last token is never matched: at least one token must be
        computed to produce logits, even when the whole prompt is cached.
        """
        if not self.enable_prefix_caching:
            return Hits([[] for _ in self.windows])
        hashes = self.hash_chain(seq, (seq.num_tokens - 1) // self.block_size)
        found, hit = [], len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:  # a full group: its longest cached prefix bounds the hit
                blocks = []
                while len(blocks) < hit and (bid := self._cached(g, len(blocks), hashes, seq)) is not None:
                    blocks.append(bid)
                hit = len(blocks)
            else:
                blocks = [self._cached(g, i, hashes, seq) for i in range(len(hashes))]
            found.append(blocks)
        while hit and not all(self._reaches(found[g], hit, w) for g, w in enumerate(self.windows)):
            hit -= 1
        if self.state_slots is not None:  # where a snapshot of the state is (restored by ``admit``)
            hit = self.state_slots.find(hashes, hit)
        return self._hits(found, hit, hashes)

    def _hits(self, tables: list[list[int | None]], hit: int, hashes: list[int] | None = None) -> Hits:
        """The first ``hit`` columns of ``tables``, each window group's behind its window nulled."""
        groups = []
        for g, window in enumerate(self.windows):
            live = first_live_block(hit * self.block_size, window, self.block_size)
            groups.append([NULL_BLOCK] * live + tables[g][live:hit])
        return Hits(groups, hashes[hit - 1] if hashes and hit else None)

    def _reaches(self, table: list[int | None], hit: int, window: int | None) -> bool:
        """Whether ``table`` holds every block a window group's next token after ``hit`` columns
        reaches (None, or the null block, is a block it lacks); full groups are checked apart."""
        if window is None:
            return True
        live = first_live_block(hit * self.block_size, window, self.block_size)
        return all(bid is not None and not (self.reserved and bid == NULL_BLOCK) for bid in table[live:hit])

    def _cached(self, group: int, i: int, hashes: list[int], seq: Sequence) -> int | None:
        """The block of ``group`` published under the i-th hash of ``seq``'s chain, if it holds
        the same tokens after the same parent (collision guard)."""
        bid = self.hash_tables[group].get(hashes[i])
        if bid is None:
            return None
        bs = self.block_size
        parent = hashes[i - 1] if i else salt_root(seq.params.cache_salt)
        return bid if self._holds(bid, parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])) else None

    def hash_chain(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The hashes of ``seq``'s first ``num_blocks`` full blocks (extends ``seq.block_hashes``)."""
        chain, bs = seq.block_hashes, self.block_size
        prev = chain[-1] if chain else salt_root(seq.params.cache_salt)
        for i in range(len(chain), num_blocks):
            prev = block_hash(prev, seq.token_ids[i * bs : (i + 1) * bs])
            chain.append(prev)
        return chain[:num_blocks]

    def _holds(self, bid: int, parent: int | None, tokens: tuple[int, ...]) -> bool:
        """Collision guard: the block really holds ``tokens`` after the block hashed ``parent``."""
        block = self.blocks[bid]
        return block.token_ids == tokens and block.parent_hash == parent

    # ---- allocation -------------------------------------------------------------------
    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether ``seq`` (empty block tables) can take ``hits`` and cover its first chunk."""
        groups = getattr(hits, "groups", [hits])
        reused_free = sum(1 for table in groups for bid in table  # block 0 is a block like any other
                          if (bid != NULL_BLOCK or not self.reserved) and self.blocks[bid].ref_count == 0)
        covered = len(hits) * self.block_size + num_new_tokens
        fresh = (self.blocks_needed(covered) - len(hits)) * self.num_groups
        slot_free = self.state_slots is None or self.state_slots.num_free > 0
        return slot_free and reused_free + fresh <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give an un-admitted sequence its cached prefix blocks (``match_prefix``'s, or for a
        single group a list) and count the lookup."""
        assert not seq.block_table, seq
        groups = getattr(hits, "groups", [hits])
        assert len(groups) == self.num_groups, (len(groups), self.windows)
        seq.block_tables = [[] for _ in self.windows]
        for table, hit in zip(seq.block_tables, groups, strict=True):
            for bid in hit:
                if bid != NULL_BLOCK or not self.reserved:
                    block = self.blocks[bid]
                    if block.ref_count == 0:
                        del self.free_ids[bid]
                    block.ref_count += 1
                table.append(bid)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        if self.state_slots is not None:  # a slot, which takes the state snapshot at the hit's end
            self.state_slots.take(seq, getattr(hits, "state_key", None))
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.query_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed_tokens

    def shared_prefix(self, parent: Sequence, num_blocks: int) -> Hits:
        """The blocks of ``parent``'s first ``num_blocks`` columns that a fork may share, cut back
        to where every window group still holds what its window reaches (it may have freed some)."""
        hit, tables = num_blocks, parent.block_tables
        while hit and not all(self._reaches(tables[g], hit, w) for g, w in enumerate(self.windows)):
            hit -= 1
        return self._hits(tables, hit)

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.missing_blocks(seq, num_new_tokens) <= len(self.free_ids)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append blocks so that the next ``num_new_tokens`` tokens of ``seq`` have slots."""
        self.take_blocks(seq, self.missing_blocks(seq, num_new_tokens))

    def missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks (over every group) ``seq`` lacks for its next ``num_new_tokens`` tokens."""
        columns = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(0, columns) * self.num_groups

    def take_blocks(self, seq: Sequence, count: int) -> None:
        """Append ``count`` free blocks (``missing_blocks`` says how many: a column in each group)."""
        if count > len(self.free_ids):
            raise RuntimeError(f"out of KV blocks: need {count}, {self.num_free_blocks} free")
        if len(seq.block_tables) != self.num_groups:  # never admitted (a hand-made sequence)
            seq.block_tables = [[] for _ in self.windows]
        for _ in range(count // self.num_groups):
            for g, table in enumerate(seq.block_tables):
                table.append(self._take_free_block(g))

    def _take_free_block(self, group: int = 0) -> int:
        bid, _ = self.free_ids.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            self._unpublish(block)
        block.hash, block.token_ids, block.parent_hash, block.ref_count = None, None, None, 1
        block.group = group
        return bid

    def _publish(self, block: Block) -> None:
        registered = self.hash_tables[block.group].setdefault(block.hash, block.block_id)
        if registered != block.block_id:
            self.duplicate_sets[block.group].setdefault(block.hash, set()).add(block.block_id)
        elif self.kv_events is not None:  # with groups, the group and its window too
            group = (block.group, self.windows[block.group]) if self.reserved or self.num_groups > 1 else ()
            self.kv_events.append((STORED, block.hash, block.parent_hash, block.token_ids, *group))

    def _unpublish(self, block: Block) -> None:
        """``block`` is being reused: its hash leaves the table, or passes to a surviving copy."""
        h, table, duplicates = block.hash, self.hash_tables[block.group], self.duplicate_sets[block.group]
        copies = duplicates.get(h)
        if table.get(h) == block.block_id:
            if copies:
                table[h] = copies.pop()
            else:
                del table[h]
                if self.kv_events is not None:
                    group = (block.group,) if self.reserved or self.num_groups > 1 else ()
                    self.kv_events.append((REMOVED, h, *group))
        elif copies is not None:
            copies.discard(block.block_id)
        if copies is not None and not copies:
            del duplicates[h]

    def commit(self, seq: Sequence) -> None:
        """Publish the hashes of blocks whose KV is now fully written, then give back what window
        groups no longer reach (call after a step, with ``num_computed_tokens`` final)."""
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        start = seq.num_hashed_blocks
        if full > start and self.enable_prefix_caching:  # most steps: no block filled up
            hashes = self.hash_chain(seq, full)
            for table in seq.block_tables:  # group by group: each group's stores form one chain
                for i in range(start, full):
                    if table[i] == NULL_BLOCK and self.reserved:
                        continue
                    block = self.blocks[table[i]]
                    if block.hash is None:
                        block.hash, block.token_ids = hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs])
                        block.parent_hash = hashes[i - 1] if i else salt_root(seq.params.cache_salt)
                        self._publish(block)
            seq.num_hashed_blocks = full
        at = seq.num_computed_tokens  # a recurrent state is kept at checkpoints (kv_cache/state_slots.py)
        if (self.state_slots is not None and self.enable_prefix_caching
                and (at == seq.checkpoint_at or at in seq.turn_checkpoints)):
            self.state_slots.checkpoint(seq, self.hash_chain(seq, at // bs)[-1])
        if self.reserved:
            self.free_behind_windows(seq)

    def free_behind_windows(self, seq: Sequence) -> None:
        """Give back each window group's blocks wholly behind the window of ``seq``'s next token."""
        for window, table in zip(self.windows, seq.block_tables, strict=True):
            live = min(first_live_block(seq.num_computed_tokens, window, self.block_size), len(table))
            for i in range(live - 1, -1, -1):  # newest first: the older the block, the later it goes
                if table[i] == NULL_BLOCK:
                    break  # freed at an earlier step, and everything before it
                self._release(table[i])
                table[i] = NULL_BLOCK

    def _release(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref_count -= 1
        assert block.ref_count >= 0, block
        if block.ref_count == 0:
            self.free_ids[bid] = None
            if block.hash is None:  # nothing to hit: reuse it (warm) before anything else
                self.free_ids.move_to_end(bid, last=False)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past those ``num_tokens`` tokens need: slots a verification step
        took for drafts it rejected (never published: only committed tokens are hashed)."""
        keep = self.blocks_needed(num_tokens)
        for table in seq.block_tables:
            while len(table) > keep:
                bid = table.pop()
                if bid != NULL_BLOCK or not self.reserved:
                    self._release(bid)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks at zero keep their hash for later hits.

        Walks the tables backwards so that a sequence's suffix is evicted before its prefix.
        """
        for table in seq.block_tables:
            for bid in reversed(table):
                if bid != NULL_BLOCK or not self.reserved:
                    self._release(bid)
        seq.block_tables = [[] for _ in self.windows]
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        if self.state_slots is not None:
            self.state_slots.release(seq)
