"""A KV block as the block manager keeps it, and the chained hash that names a full block's
contents for prefix caching (engine/core/block_manager.py); the kinds of KV-cache events."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import xxhash


def block_hash(prev_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    """xxhash64 chained over the previous block's hash and this block's token ids."""
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


# the kinds of KV-cache event tuples: (STORED, hash, parent_hash, token_ids), (REMOVED, hash), (CLEARED,);
# with KV cache groups STORED adds (group, its window or None) and REMOVED (group,)
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
    group: int = 0  # the KV cache group whose layers hold it (the one that last took it)
