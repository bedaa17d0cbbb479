"""Block manager of the paged KV cache: fixed-size blocks handed out on demand, like pages of
virtual memory.

A contiguous KV cache reserves max_model_len token slots per request up front; most of that
memory holds nothing, because most requests stop long before max_model_len. Paging (vLLM's
PagedAttention) splits the cache into blocks of `block_size` tokens (16 by default) and gives
a request one more block only when its last one is full, so at most block_size - 1 slots per
request are empty. A request's logical token positions map to physical blocks through its
block table:

    position p  ->  block_table[p // block_size], offset p % block_size
    slot        =   physical_block * block_size + offset     # a row of the cache viewed flat

The bookkeeping is plain Python (this file, no tensors); the K/V tensors, their store through
the slot mapping, block copies and attention over block tables are in minillm/paged_attention.py,
and the model runner holds them as k_cache, v_cache of shape (num_blocks, block_size, Hkv, D)
per layer.

API (driven by a scheduler, vLLM v1 style: each request's num_computed_tokens catches up
with its num_tokens; preemption by recompute is free() and a later allocate()):

    bm = BlockManager(num_blocks, block_size=16, enable_prefix_caching=False, prefix_cache="hash")
        # prefix_cache: the index of cached blocks, "hash" (vLLM's chained block hashes,
        # minillm/prefix_cache.py) or "radix" (SGLang's radix tree, minillm/radix_cache.py)
    bm.can_allocate(prompt_ids) -> bool
    bm.allocate(seq_id, prompt_ids) -> num_cached_tokens   # blocks for the whole prompt;
        # with prefix caching, the leading full blocks another request computed are shared
        # and their tokens need no prefill (at most len(prompt_ids) - 1 of them)
    bm.slot_mapping(seq_id, start, end) -> [slot]           # where tokens start..end-1 go
    bm.mark_computed(seq_id, num_computed_tokens)           # after each forward: the K/V of
        # those tokens is in the cache; newly full blocks become findable by other requests
    bm.can_append_slots(seq_id, num_tokens) -> bool           # room to grow to num_tokens?
    bm.append_slots(seq_id, token_ids) -> [(src, dst)]      # before each forward: grow to
        # len(token_ids) tokens; a block that is about to be written but is shared with a
        # fork is copied first (copy-on-write): the runner copies the K/V of src into dst
    bm.truncate(seq_id, num_tokens)     # speculative rollback: drop uncomputed tail tokens, free emptied blocks
    bm.fork(parent_id, child_id)        # the child shares all the parent's blocks (n > 1 sampling)
    bm.free(seq_id)                     # finished or preempted: blocks back to the pool, tail first
    bm.block_table(seq_id) -> [block]
    bm.num_free_blocks

Bad arguments raise ValueError; running out of blocks raises OutOfBlocks (check with
can_allocate / can_append_slots first, and preempt if they say no).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from minillm.prefix_cache import PrefixCache
from minillm.radix_cache import RadixCache

PREFIX_CACHES = {"hash": PrefixCache, "radix": RadixCache}     # prefix_cache= -> its index


def check_prefix_cache(prefix_cache: str, enable_prefix_caching: bool) -> None:
    """ValueError unless prefix_cache names an index; a non-default index without prefix caching
    is refused rather than ignored (it would silently cache nothing)."""
    if prefix_cache not in PREFIX_CACHES:
        raise ValueError(f"prefix_cache = {prefix_cache!r} is not supported; allowed: "
                         f"{', '.join(map(repr, PREFIX_CACHES))}")
    if prefix_cache != "hash" and not enable_prefix_caching:
        raise ValueError(f"prefix_cache = {prefix_cache!r} needs enable_prefix_caching=True "
                         f"(without it no index is used)")


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than the request needs: preempt something and retry."""


class BlockPool:
    """Physical blocks 0..num_blocks-1 with reference counts and a free list.

    A block is in exactly one state: held (ref_count > 0), free (never cached, in `_free`), or
    evictable (ref_count 0 but its K/V is still findable in the prefix cache). Allocation takes
    a never-cached free block first and evicts the least recently used cached one only when
    none is left, so cached prefixes live as long as memory allows.
    """

    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | RadixCache | None = None):
        self.ref_counts = [0] * num_blocks
        self._free = deque(range(num_blocks))
        self.prefix_cache = prefix_cache

    @property
    def num_free(self) -> int:
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self._free) + evictable

    def free_block_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self) -> int:
        # BEGIN SOLUTION paged_blocks
        # HINT: take the oldest never-cached free block (self._free is a deque, popleft); if there is
        # HINT: none, evict the least recently used cached block (self.prefix_cache.evict(), when a
        # HINT: prefix cache exists and has evictable blocks); else raise OutOfBlocks. Its holder count is 1.
        if self._free:
            block = self._free.popleft()
        elif self.prefix_cache is not None and self.prefix_cache.num_evictable:
            block = self.prefix_cache.evict()
        else:
            raise OutOfBlocks("no free KV block left")
        self.ref_counts[block] = 1
        return block
        # END SOLUTION

    def acquire(self, block: int) -> None:
        """One more holder of a block that holds valid K/V (a fork, or a prefix-cache hit)."""
        # BEGIN SOLUTION paged_blocks
        # HINT: a block nobody holds may only be shared if the prefix cache still keeps it (evictable):
        # HINT: revive it there; a plain free block holds nothing valid (RuntimeError). Count the holder.
        if self.ref_counts[block] == 0:
            if self.prefix_cache is None or not self.prefix_cache.is_evictable(block):
                raise RuntimeError(f"block {block} is free: nothing valid to share")
            self.prefix_cache.revive(block)
        self.ref_counts[block] += 1
        # END SOLUTION

    def release(self, block: int) -> None:
        # BEGIN SOLUTION paged_blocks
        # HINT: releasing a block nobody holds is a double free (RuntimeError). When the last holder
        # HINT: lets go: a block the prefix cache knows stays findable (self.prefix_cache.release),
        # HINT: any other block goes to the END of the free list.
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"double free of block {block}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.prefix_cache is not None and self.prefix_cache.is_cached(block):
                self.prefix_cache.release(block)        # keep the K/V, evict it later if needed
            else:
                self._free.append(block)
        # END SOLUTION


@dataclass
class _Sequence:
    token_ids: list[int]
    blocks: list[int]                                  # the block table
    num_computed: int = 0                              # tokens whose K/V is in the cache
    num_registered: int = 0                            # leading blocks inserted into the prefix cache
    cache_state: object = None                         # what the index's last insert returned


class BlockManager:
    """Block tables of every live sequence over one BlockPool (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False,
                 prefix_cache: str = "hash"):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        check_prefix_cache(prefix_cache, enable_prefix_caching)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = PREFIX_CACHES[prefix_cache]() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self._seqs: dict[object, _Sequence] = {}

    # --- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def seq_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id) -> list[int]:
        return list(self._get(seq_id).blocks)

    def num_tokens(self, seq_id) -> int:
        return len(self._get(seq_id).token_ids)

    def num_computed_tokens(self, seq_id) -> int:
        return self._get(seq_id).num_computed

    def slot_mapping(self, seq_id, start: int, end: int) -> list[int]:
        """Cache slots of the tokens at positions start..end-1 of a sequence."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= len(seq.token_ids):
            raise ValueError(f"need 0 <= start <= end <= num_tokens={len(seq.token_ids)}, "
                             f"got start={start}, end={end}")
        bs = self.block_size
        return [seq.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    # --- admission ----------------------------------------------------------------------
    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens a prefix-cache hit would serve right now (0 without caching)."""
        self._check_tokens(token_ids)
        return len(self._match(token_ids)) * self.block_size

    def can_allocate(self, token_ids: Sequence[int], use_prefix_cache: bool = True) -> bool:
        self._check_tokens(token_ids)
        hits = self._match(token_ids) if use_prefix_cache else []
        return self._blocks_to_allocate(len(token_ids), hits) <= self.num_free_blocks

    def allocate(self, seq_id, token_ids: Sequence[int], use_prefix_cache: bool = True) -> int:
        """Give a new sequence blocks for all its tokens; returns how many are already computed.
        use_prefix_cache=False computes every token (a request that wants prompt logprobs)."""
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        self._check_tokens(token_ids)
        hits = self._match(token_ids) if use_prefix_cache else []
        if self._blocks_to_allocate(len(token_ids), hits) > self.num_free_blocks:
            raise OutOfBlocks(f"seq_id {seq_id!r} needs more blocks than are free")
        for block in hits:                         # first, so that allocate() cannot evict them
            self.pool.acquire(block)
        fresh = [self.pool.allocate() for _ in range(self._num_blocks_for(len(token_ids)) - len(hits))]
        num_cached = len(hits) * self.block_size
        self._seqs[seq_id] = _Sequence(list(token_ids), hits + fresh, num_cached, len(hits))
        return num_cached

    # --- growth -------------------------------------------------------------------------
    def can_append_slots(self, seq_id, num_tokens: int) -> bool:
        """Whether append_slots can grow the sequence to num_tokens tokens in total."""
        seq = self._get(seq_id)
        return self._append_cost(seq, num_tokens)[0] <= self.num_free_blocks

    def append_slots(self, seq_id, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Grow a sequence to len(token_ids) tokens (its old tokens followed by the new ones).

        Returns the copy-on-write pairs (src_block, dst_block) whose K/V the runner must copy
        before the next forward writes into dst.
        """
        seq = self._get(seq_id)
        if len(token_ids) < len(seq.token_ids):
            raise ValueError(f"token_ids has {len(token_ids)} tokens but seq_id {seq_id!r} already "
                             f"has {len(seq.token_ids)}: append_slots only grows a sequence")
        needed, shared = self._append_cost(seq, len(token_ids))
        if needed > self.num_free_blocks:
            raise OutOfBlocks(f"seq_id {seq_id!r} needs {needed} blocks, {self.num_free_blocks} free")
        copies = []
        for i in shared:                           # copy-on-write: only the writer gets a new block
            new_block = self.pool.allocate()
            copies.append((seq.blocks[i], new_block))
            self.pool.release(seq.blocks[i])
            seq.blocks[i] = new_block
        while len(seq.blocks) < self._num_blocks_for(len(token_ids)):
            seq.blocks.append(self.pool.allocate())
        seq.token_ids.extend(token_ids[len(seq.token_ids):])
        return copies

    def mark_computed(self, seq_id, num_computed_tokens: int) -> None:
        """Record that the K/V of the first num_computed_tokens tokens is in the cache."""
        seq = self._get(seq_id)
        if not seq.num_computed <= num_computed_tokens <= len(seq.token_ids):
            raise ValueError(f"num_computed_tokens must be in [{seq.num_computed}, "
                             f"{len(seq.token_ids)}] for seq_id {seq_id!r}, got {num_computed_tokens}")
        seq.num_computed = num_computed_tokens
        num_full = num_computed_tokens // self.block_size
        if self.prefix_cache is None or num_full <= seq.num_registered:
            return
        swaps, seq.cache_state = self.prefix_cache.insert(
            seq.token_ids[:num_full * self.block_size], seq.blocks, self.block_size,
            seq.num_registered, seq.cache_state)
        for i, cached in swaps:                    # the radix tree keeps one copy of each prefix:
            self.pool.acquire(cached)              # use it (same tokens, same K/V), free ours
            self.pool.release(seq.blocks[i])
            seq.blocks[i] = cached
        seq.num_registered = num_full

    # --- sharing and release ------------------------------------------------------------
    def truncate(self, seq_id, num_tokens: int) -> None:
        """Keep the first num_tokens tokens of a sequence and give back every block past them:
        speculative decoding appends k draft tokens before a forward and rolls back the ones the
        target rejected. Their K/V slots are simply forgotten (the next tokens overwrite them);
        only blocks that the rollback leaves empty return to the pool. Tokens still counted as
        computed cannot be dropped: the prefix cache may have indexed their blocks."""
        seq = self._get(seq_id)
        if not isinstance(num_tokens, int) or not max(1, seq.num_computed) <= num_tokens <= len(seq.token_ids):
            raise ValueError(f"num_tokens must be an int in [{max(1, seq.num_computed)}, {len(seq.token_ids)}] "
                             f"for seq_id {seq_id!r} (computed tokens cannot be dropped), got {num_tokens!r}")
        del seq.token_ids[num_tokens:]
        while len(seq.blocks) > self._num_blocks_for(num_tokens):
            self.pool.release(seq.blocks.pop())

    def fork(self, parent_id, child_id) -> None:
        """The child starts as a copy of the parent that shares every block (no K/V copied)."""
        if child_id in self._seqs:
            raise ValueError(f"child_id {child_id!r} is already allocated")
        parent = self._get(parent_id)
        for block in parent.blocks:
            self.pool.acquire(block)
        self._seqs[child_id] = _Sequence(list(parent.token_ids), list(parent.blocks),
                                         parent.num_computed, parent.num_registered, parent.cache_state)

    def free(self, seq_id) -> None:
        """Release a finished or preempted sequence's blocks, last block first, so that with
        prefix caching the tails of prefixes are evicted before their heads."""
        seq = self._get(seq_id)
        for block in reversed(seq.blocks):
            self.pool.release(block)
        del self._seqs[seq_id]

    # --- helpers ------------------------------------------------------------------------
    def _get(self, seq_id) -> _Sequence:
        if seq_id not in self._seqs:
            raise ValueError(f"unknown seq_id {seq_id!r}")
        return self._seqs[seq_id]

    @staticmethod
    def _check_tokens(token_ids) -> None:
        if len(token_ids) == 0:
            raise ValueError("token_ids must hold at least one token")

    def _num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _match(self, token_ids) -> list[int]:
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.match(token_ids, self.block_size)

    def _blocks_to_allocate(self, num_tokens: int, hits: list[int]) -> int:
        """Free blocks an allocation consumes: new blocks, plus hits that are now evictable
        (reviving one takes it out of the free count)."""
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        return self._num_blocks_for(num_tokens) - len(hits) + revived

    def _append_cost(self, seq: _Sequence, num_tokens: int) -> tuple[int, list[int]]:
        """(free blocks needed, indices of shared blocks the next forward writes into)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        first_written = seq.num_computed // self.block_size
        last = min(len(seq.blocks), self._num_blocks_for(num_tokens))
        shared = [i for i in range(first_written, last) if self.pool.ref_counts[seq.blocks[i]] > 1]
        grow = max(0, self._num_blocks_for(num_tokens) - len(seq.blocks))
        return grow + len(shared), shared


def blocks_after_parallel_sampling(prompt_len: int, n: int, block_size: int = 16) -> int:
    """Blocks held once n samples of one prompt (n > 1 sampling) have each written their first output
    token, counted on a real BlockManager: the prompt's full blocks stay shared (fork), and only the
    partly filled last block is copied, by every writer but the last (copy-on-write)."""
    num_blocks = n * (prompt_len // block_size + 2)                        # room even without sharing
    bm = BlockManager(num_blocks, block_size)
    prompt = list(range(prompt_len))
    bm.allocate(0, prompt)
    bm.mark_computed(0, prompt_len)
    for child in range(1, n):
        bm.fork(0, child)
    for seq in range(n):
        bm.append_slots(seq, prompt + [seq])
    return num_blocks - bm.num_free_blocks


def prefix_hit_tokens(shared_len: int, prompt_len: int, block_size: int = 16) -> int:
    """Tokens of a prompt_len-token prompt served by the prefix cache when an earlier request, fully
    computed, started with the same shared_len tokens; counted on a real BlockManager: whole blocks
    only, and at most prompt_len - 1 tokens, so that the last one runs and yields logits."""
    bm = BlockManager(2 * (max(shared_len, prompt_len) // block_size + 2), block_size, enable_prefix_caching=True)
    shared = list(range(shared_len))
    earlier = shared + [shared_len]                                     # then the two prompts differ
    bm.allocate("earlier", earlier)
    bm.mark_computed("earlier", len(earlier))
    return bm.cached_prefix_tokens(shared + [shared_len + 1] * (prompt_len - shared_len))
