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
the slot mapping, block copies and attention over block tables are in minillm/attention/paged.py,
and the model runner holds them as k_cache, v_cache of shape (num_blocks, block_size, Hkv, D)
per layer.

API (driven by a scheduler, vLLM v1 style: each request's num_computed_tokens catches up
with its num_tokens; preemption by recompute is free() and a later allocate()). The Request
(minillm/engine/request.py) is the one record of a request's tokens and computed count: the block
manager reads them from it and keeps, per request_id, only what it owns, the block table and
the prefix-cache registration. Calls that read tokens or the count take the Request; calls
that only touch the table take its request_id.

    bm = BlockManager(num_blocks, block_size=16, enable_prefix_caching=False, prefix_cache="hash")
        # prefix_cache: the index of cached blocks, "hash" (vLLM's chained block hashes,
        # minillm/kvcache/prefix_cache.py) or "radix" (SGLang's radix tree, minillm/kvcache/radix_cache.py)
    bm.cached_prefix_tokens(req) -> int                  # what a prefix hit would serve now
    bm.can_allocate(req) -> bool
    bm.allocate(req) -> num_cached_tokens                # blocks for all of req.all_token_ids;
        # with prefix caching, the leading full blocks another request computed are shared
        # and their tokens need no prefill (at most req.num_tokens - 1 of them)
    bm.can_append_slots(req, num_tokens) -> bool         # room to grow to num_tokens?
    bm.append_slots(req, num_tokens) -> [(src, dst)]     # before each forward: grow the table to
        # num_tokens slots (req.num_tokens_with_spec: its tokens and draft tokens); a block that
        # is about to be written but is shared with a fork is copied first (copy-on-write):
        # the runner copies the K/V of src into dst
    bm.slot_mapping(request_id, start, end) -> [slot]    # where tokens start..end-1 go
    bm.cache_blocks(req)                # after each forward moved req.num_computed_tokens: its
        # newly full computed blocks become findable by other requests (prefix caching)
    bm.truncate(req, num_tokens)        # speculative rollback: drop uncomputed tail slots, free emptied blocks
    bm.fork(parent_id, child_id)        # the child shares all the parent's blocks (n > 1 sampling)
    bm.free(request_id)                 # finished or preempted: blocks back to the pool, tail first
    bm.free_outside_window(req)         # a sliding-window model: blocks no future query can see go back
    bm.block_table(request_id) -> [block]
    bm.num_slots(request_id) -> int     # token positions the table covers
    bm.num_free_blocks

Bad arguments raise ValueError; running out of blocks raises OutOfBlocks (check with
can_allocate / can_append_slots first, and preempt if they say no).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from minillm.engine.request import Request
from minillm.kvcache.prefix_cache import DROPPED, PrefixCache
from minillm.kvcache.radix_cache import RadixCache

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
        if self.ref_counts[block] == 0:
            if self.prefix_cache is None or not self.prefix_cache.is_evictable(block):
                raise RuntimeError(f"block {block} is free: nothing valid to share")
            self.prefix_cache.revive(block)
        self.ref_counts[block] += 1
        # END SOLUTION

    def release(self, block: int) -> None:
        # BEGIN SOLUTION paged_blocks
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
class _BlockTable:
    """What the block manager owns of one request; its tokens and computed count stay on the Request."""
    blocks: list[int]                                  # physical blocks: position p is in blocks[p // block_size]
                                                       # (DROPPED: outside the sliding window, given back)
    num_slots: int                                     # token positions the blocks are reserved for
    num_registered: int = 0                            # leading blocks inserted into the prefix cache
    cache_state: object = None                         # what the index's last insert returned
    num_dropped: int = 0                               # leading entries that are DROPPED


class BlockManager:
    """Block tables of every live request over one BlockPool (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False,
                 prefix_cache: str = "hash", sliding_window: int | None = None):
        """sliding_window: the model's (Mistral): a query at position p sees keys p - W + 1 .. p, so a
        block wholly before the next query's window is given back (free_outside_window)."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        check_prefix_cache(prefix_cache, enable_prefix_caching)
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.prefix_cache = PREFIX_CACHES[prefix_cache]() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self._tables: dict[str, _BlockTable] = {}       # request_id -> its table

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache): all blocks become plain free blocks.
        Only while no request holds blocks (their tables would point at blocks the index no longer knows):
        -> False then, and nothing changes; True otherwise."""
        if self._tables:
            return False
        if self.prefix_cache is not None:
            self.prefix_cache = type(self.prefix_cache)()
            self.pool = BlockPool(self.num_blocks, self.prefix_cache)
        return True

    # --- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)

    def block_table(self, request_id: str) -> list[int]:
        """The request's physical blocks by position; a dropped entry (outside the sliding window) reads as
        block 0, which attention masks out with the window."""
        return [max(block, 0) for block in self._get(request_id).blocks]

    def num_slots(self, request_id: str) -> int:
        return self._get(request_id).num_slots

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Cache slots of the tokens at positions start..end-1 of a request."""
        table = self._get(request_id)
        if not 0 <= start <= end <= table.num_slots:
            raise ValueError(f"need 0 <= start <= end <= num_slots={table.num_slots}, "
                             f"got start={start}, end={end}")
        bs = self.block_size
        if start < table.num_dropped * bs:
            raise ValueError(f"position {start} of request_id {request_id!r} fell out of the sliding window")
        return [table.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    # --- admission ----------------------------------------------------------------------
    def cached_prefix_tokens(self, req: Request) -> int:
        """How many leading tokens of req a prefix-cache hit would serve right now (0 without caching)."""
        token_ids = self._token_ids(req)
        return len(self._match(token_ids)) * self.block_size

    def can_allocate(self, req: Request, use_prefix_cache: bool = True) -> bool:
        token_ids = self._token_ids(req)
        hits = self._match(token_ids) if use_prefix_cache else []
        return self._blocks_to_allocate(len(token_ids), hits) <= self.num_free_blocks

    def allocate(self, req: Request, use_prefix_cache: bool = True) -> int:
        """Give a new request blocks for all its tokens; returns how many are already computed
        (the caller sets req.num_computed_tokens to it). use_prefix_cache=False computes every
        token (a request that wants prompt logprobs)."""
        if req.request_id in self._tables:
            raise ValueError(f"request_id {req.request_id!r} is already allocated")
        token_ids = self._token_ids(req)
        hits = self._match(token_ids) if use_prefix_cache else []
        if self._blocks_to_allocate(len(token_ids), hits) > self.num_free_blocks:
            raise OutOfBlocks(f"request_id {req.request_id!r} needs more blocks than are free")
        dropped = hits.count(DROPPED)              # a windowed hit: leading positions no query will see
        for block in hits[dropped:]:               # first, so that allocate() cannot evict them
            self.pool.acquire(block)
        fresh = [self.pool.allocate() for _ in range(self._num_blocks_for(len(token_ids)) - len(hits))]
        self._tables[req.request_id] = _BlockTable(hits + fresh, len(token_ids), len(hits), num_dropped=dropped)
        return len(hits) * self.block_size

    # --- growth -------------------------------------------------------------------------
    def can_append_slots(self, req: Request, num_tokens: int) -> bool:
        """Whether append_slots can grow the request's table to num_tokens slots in total."""
        table = self._get(req.request_id)
        return self._append_cost(table, req.num_computed_tokens, num_tokens)[0] <= self.num_free_blocks

    def append_slots(self, req: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Grow a request's table to num_tokens slots (at most req.num_tokens_with_spec: a slot
        for each of its tokens and draft tokens).

        Returns the copy-on-write pairs (src_block, dst_block) whose K/V the runner must copy
        before the next forward writes into dst.
        """
        table = self._get(req.request_id)
        if num_tokens < table.num_slots:
            raise ValueError(f"num_tokens={num_tokens} but request_id {req.request_id!r} already has "
                             f"{table.num_slots} slots: append_slots only grows a table")
        if num_tokens > req.num_tokens_with_spec:
            raise ValueError(f"num_tokens={num_tokens} but request_id {req.request_id!r} holds only "
                             f"{req.num_tokens_with_spec} tokens (with drafts): append its tokens first")
        needed, shared = self._append_cost(table, req.num_computed_tokens, num_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocks(f"request_id {req.request_id!r} needs {needed} blocks, "
                              f"{self.num_free_blocks} free")
        copies = []
        for i in shared:                           # copy-on-write: only the writer gets a new block
            new_block = self.pool.allocate()
            copies.append((table.blocks[i], new_block))
            self.pool.release(table.blocks[i])
            table.blocks[i] = new_block
        while len(table.blocks) < self._num_blocks_for(num_tokens):
            table.blocks.append(self.pool.allocate())
        table.num_slots = num_tokens
        return copies

    def cache_blocks(self, req: Request) -> None:
        """After a forward moved req.num_computed_tokens on: the K/V of that many tokens is in
        the cache, so its newly full blocks become findable (a no-op without prefix caching)."""
        table = self._get(req.request_id)
        lowest = table.num_registered * self.block_size        # cached blocks cannot be uncomputed
        if not lowest <= req.num_computed_tokens <= table.num_slots:
            raise ValueError(f"num_computed_tokens must be in [{lowest}, {table.num_slots}] for "
                             f"request_id {req.request_id!r}, got {req.num_computed_tokens}")
        # min: a stop inside accepted drafts leaves the request fewer tokens than computed slots
        num_full = min(req.num_computed_tokens, req.num_tokens_with_spec) // self.block_size
        if self.prefix_cache is None or num_full <= table.num_registered:
            return
        token_ids = (req.all_token_ids + req.spec_token_ids)[:num_full * self.block_size]
        swaps, table.cache_state = self.prefix_cache.insert(
            token_ids, table.blocks, self.block_size, table.num_registered, table.cache_state)
        for i, cached in swaps:                    # the radix tree keeps one copy of each prefix:
            self.pool.acquire(cached)              # use it (same tokens, same K/V), free ours
            self.pool.release(table.blocks[i])
            table.blocks[i] = cached
        table.num_registered = num_full

    # --- sharing and release ------------------------------------------------------------
    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep the first num_tokens slots of a request's table and give back every block past
        them: speculative decoding appends k draft tokens before a forward and rolls back the ones
        the target rejected. Their K/V slots are simply forgotten (the next tokens overwrite them);
        only blocks that the rollback leaves empty return to the pool. Computed tokens (read from
        req.num_computed_tokens, before it moves on) cannot be dropped: the prefix cache may have
        indexed their blocks."""
        table = self._get(req.request_id)
        lowest = max(1, req.num_computed_tokens, table.num_registered * self.block_size)
        if not isinstance(num_tokens, int) or not lowest <= num_tokens <= table.num_slots:
            raise ValueError(f"num_tokens must be an int in [{lowest}, {table.num_slots}] for request_id "
                             f"{req.request_id!r} (computed tokens cannot be dropped), got {num_tokens!r}")
        table.num_slots = num_tokens
        while len(table.blocks) > self._num_blocks_for(num_tokens):
            self.pool.release(table.blocks.pop())

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child starts with a table that shares every block of the parent's (no K/V copied).
        Its Request must hold the parent's tokens and num_computed_tokens (a copy of the parent)."""
        if child_id in self._tables:
            raise ValueError(f"child_id {child_id!r} is already allocated")
        parent = self._get(parent_id)
        for block in parent.blocks[parent.num_dropped:]:
            self.pool.acquire(block)
        self._tables[child_id] = _BlockTable(list(parent.blocks), parent.num_slots,
                                             parent.num_registered, parent.cache_state, parent.num_dropped)

    def free_outside_window(self, req: Request) -> None:
        """With a sliding window W: the next query, at position req.num_computed_tokens, and every later
        one see keys from num_computed_tokens - W + 1 on, so the blocks wholly before that go back to the
        pool (a no-op without a window). With prefix caching a registered block stays findable."""
        if self.sliding_window is None:
            return
        table = self._get(req.request_id)
        first_seen = max(0, req.num_computed_tokens - self.sliding_window + 1)
        for i in range(table.num_dropped, min(first_seen // self.block_size, len(table.blocks))):
            self.pool.release(table.blocks[i])
            table.blocks[i] = DROPPED
            table.num_dropped = i + 1

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request's blocks, last block first, so that with
        prefix caching the tails of prefixes are evicted before their heads."""
        table = self._get(request_id)
        for block in reversed(table.blocks[table.num_dropped:]):
            self.pool.release(block)
        del self._tables[request_id]

    # --- helpers ------------------------------------------------------------------------
    def _get(self, request_id: str) -> _BlockTable:
        if request_id not in self._tables:
            raise ValueError(f"unknown request_id {request_id!r}")
        return self._tables[request_id]

    @staticmethod
    def _token_ids(req: Request) -> list[int]:
        token_ids = req.all_token_ids
        if not token_ids:
            raise ValueError(f"request_id {req.request_id!r} has no token_ids: a request needs at least one token")
        return token_ids

    def _num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _match(self, token_ids: list[int]) -> list[int]:
        if self.prefix_cache is None:
            return []
        if self.sliding_window is not None and isinstance(self.prefix_cache, PrefixCache):
            return self.prefix_cache.match_window(token_ids, self.block_size, self.sliding_window)
        # the radix tree evicts leaves first: a path's later blocks never outlive its earlier ones, and
        # the early blocks of a hit go back after the request's first step (free_outside_window)
        return self.prefix_cache.match(token_ids, self.block_size)

    def _blocks_to_allocate(self, num_tokens: int, hits: list[int]) -> int:
        """Free blocks an allocation consumes: new blocks, plus hits that are now evictable
        (reviving one takes it out of the free count)."""
        revived = sum(1 for b in hits if b != DROPPED and self.pool.ref_counts[b] == 0)
        return self._num_blocks_for(num_tokens) - len(hits) + revived

    def _append_cost(self, table: _BlockTable, num_computed: int, num_tokens: int) -> tuple[int, list[int]]:
        """(free blocks needed, indices of shared blocks the next forward writes into: those at or
        after the block holding position num_computed)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        first_written = num_computed // self.block_size
        last = min(len(table.blocks), self._num_blocks_for(num_tokens))
        shared = [i for i in range(first_written, last) if self.pool.ref_counts[table.blocks[i]] > 1]
        grow = max(0, self._num_blocks_for(num_tokens) - len(table.blocks))
        return grow + len(shared), shared

