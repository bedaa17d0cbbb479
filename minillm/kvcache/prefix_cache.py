"""Prefix caching: find the KV blocks another request already computed for the same prefix.

Two requests that start with the same tokens (a shared system prompt, a few-shot preamble,
the earlier turns of a chat) produce the same K/V for those tokens, because a token's K/V
depends only on the tokens before it. So a FULL block of `block_size` tokens is named by

    hash(parent_hash, tokens of the block)         # chained: the hash covers the whole prefix

and a new request walks its own chain block by block, reusing every block it finds, until
the first miss. Partial (last) blocks are never cached: their tokens are still changing.

Rules that keep it correct (each one is a bug some engine has had):
- a hit confirms the stored parent hash and tokens, not only the hash;
- a hit covers at most num_tokens - 1 tokens (whole blocks, so at most (n - 1) // block_size
  blocks): the last prompt token must still run through the model to produce the logits
  that sample the first output token;
- a block whose sequence finished keeps its hash and stays findable; it is only reused for
  other content when the pool runs out of never-cached free blocks, least recently used
  first (evict() unregisters it before it is handed out again).

This module is the index only; minillm/kvcache/block_manager.py owns the blocks, reference counts and the
free list, and calls into it. Blocks are plain ints (physical block ids).

SGLang's RadixAttention keeps the same information as a radix tree over tokens instead of a
hash table over blocks: minillm/kvcache/radix_cache.py, with the same interface (match, insert, release,
revive, evict), so the block manager takes either (BlockManager(..., prefix_cache="radix")).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Sequence

ROOT_HASH = 0          # the parent hash of the first block of every sequence
DROPPED = -1           # a hit (and block-table) entry outside a sliding window: computed, but no block held


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Deterministic 128-bit hash of one full block, chained on its parent's hash.

    sha256 (not Python's hash(), which is salted per process for str and may change between
    versions) so that the same prefix has the same name in every process and every run.
    """
    # BEGIN SOLUTION paged_blocks
    data = parent_hash.to_bytes(16, "little") + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")
    # END SOLUTION


def chain_hashes(token_ids: Sequence[int], block_size: int, start: int = 0,
                 parent_hash: int = ROOT_HASH) -> list[int]:
    """Hashes of the full blocks start, start+1, ... of token_ids (parent_hash: block start-1's)."""
    # BEGIN SOLUTION paged_blocks
    hashes = []
    for first in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[first:first + block_size])
        hashes.append(parent_hash)
    return hashes
    # END SOLUTION


class PrefixCache:
    """hash -> block index of full computed blocks, plus the LRU order of unreferenced ones.

    A registered block is either held by some sequence (reference count > 0, the pool's
    business) or evictable: no sequence holds it, its K/V is still valid, and it waits in
    `_evictable` (oldest first) until a hit revives it or the pool needs the memory.
    """

    def __init__(self):
        self._block_of: dict[int, int] = {}                        # hash -> block id
        self._entry: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # block -> (hash, parent, tokens)
        self._evictable: OrderedDict[int, None] = OrderedDict()   # block ids, least recent first

    # --- lookup -------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], block_size: int,
              hashes: Sequence[int] | None = None) -> list[int]:
        """Block ids of the longest cached prefix of token_ids, at most (n - 1) // block_size blocks.

        hashes: the chain of token_ids' full blocks if the caller already has it.
        """
        # BEGIN SOLUTION paged_blocks
        max_blocks = (len(token_ids) - 1) // block_size        # leave >= 1 token to compute
        if hashes is None:
            hashes = chain_hashes(token_ids[:max_blocks * block_size], block_size)
        blocks, parent = [], ROOT_HASH
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block = self._block_of.get(block_hash)
            tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
            if block is None or self._entry[block][1:] != (parent, tokens):   # confirm, not just hash
                break
            blocks.append(block)
            parent = block_hash
        return blocks
        # END SOLUTION

    def match_window(self, token_ids: Sequence[int], block_size: int, window: int) -> list[int]:
        """match() for a sliding-window model of window W. The token after a prefix of L blocks sees only
        the keys of its last W positions, so only the blocks holding those must be cached; the ones
        before come back as DROPPED. The chain's names are computed from the tokens, so a missing early
        block does not end the walk: without this, a windowed model's hits fall to nothing once the
        early blocks, given back first as the window slid, are evicted first."""
        max_blocks = (len(token_ids) - 1) // block_size
        found, parent = [], ROOT_HASH
        for i, block_hash in enumerate(chain_hashes(token_ids[:max_blocks * block_size], block_size)):
            block = self._block_of.get(block_hash)
            tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
            found.append(block if block is not None and self._entry[block][1:] == (parent, tokens) else None)
            parent = block_hash
        for num_blocks in range(len(found), 0, -1):           # the longest prefix whose window is cached
            first = max(0, num_blocks * block_size - window + 1) // block_size
            if None not in found[first:num_blocks]:
                return [DROPPED] * first + found[first:num_blocks]
        return []

    def is_cached(self, block: int) -> bool:
        return block in self._entry

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._entry)

    # --- updates (called by the block manager and its pool) -----------------------------
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], block_size: int,
               start: int = 0, state: int | None = None) -> tuple[list[tuple[int, int]], int]:
        """Register blocks start, start+1, ... of a sequence. token_ids: the tokens of its full
        computed blocks (a multiple of block_size); blocks: its block table. state: the chain hash
        of block start - 1 as the previous insert returned it (None: hash again from the root).

        Returns ([], the chain hash of the last block): no block to swap, since a duplicate keeps
        its own block (register refuses it) and goes back to the free list when freed.
        """
        if state is None:
            state = chain_hashes(token_ids[:start * block_size], block_size)[-1] if start else ROOT_HASH
        for i, block_hash in enumerate(chain_hashes(token_ids, block_size, start, state), start):
            self.register(blocks[i], block_hash, state, token_ids[i * block_size:(i + 1) * block_size])
            state = block_hash
        return [], state

    def register(self, block: int, block_hash: int, parent_hash: int,
                 token_ids: Sequence[int]) -> bool:
        """Make a freshly computed full block findable. False if this content is cached already
        (two requests computed the same prefix at once): the first block keeps the name."""
        if block_hash in self._block_of or block in self._entry:
            return False
        self._block_of[block_hash] = block
        self._entry[block] = (block_hash, parent_hash, tuple(token_ids))
        return True

    def release(self, block: int) -> None:
        """The last holder let go of a cached block: it becomes the most recently used evictable."""
        self._evictable[block] = None

    def revive(self, block: int) -> None:
        """A hit on an evictable block: some sequence holds it again."""
        del self._evictable[block]

    def evict(self) -> int | None:
        """Unregister and return the least recently used evictable block (None if there is none)."""
        # BEGIN SOLUTION paged_blocks
        if not self._evictable:
            return None
        block, _ = self._evictable.popitem(last=False)
        block_hash, _, _ = self._entry.pop(block)      # its K/V is about to be overwritten
        del self._block_of[block_hash]
        return block
        # END SOLUTION
