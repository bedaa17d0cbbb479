"""Radix-tree prefix cache: SGLang's RadixAttention index, over the paged KV pool.

The hash index (minillm/kvcache/prefix_cache.py) names every full block by a hash chained over its
whole prefix. A radix tree keeps the same knowledge as a tree over token ids: each node holds a
run of tokens (a whole number of blocks here) and the KV blocks that hold them, and a prompt's
cached prefix is the path from the root that spells its first tokens:

    root
     ├── [system prompt ........]  blocks 3 7          shared by every chat below
     │    ├── [user: hi ...]       block 9            chat 1, turn 1
     │    │    └── [... turn 2]    blocks 12 4        turn 2 extends turn 1
     │    └── [user: translate]    block 5            chat 2
     └── [def main(): ...]         block 8

- match: walk down, comparing one block of tokens at a time; a match that ends inside a node's
  run splits the node there (the node keeps the matched head, a new child the rest), so a
  sequence always holds whole nodes. As in prefix_cache.py, at most num_tokens - 1 tokens hit.
- insert: after a forward, a sequence's newly full blocks hang under its path. Where the tree
  already holds the same tokens (another request computed them in the same steps), the sequence
  swaps its copy for the tree's block and frees its own: one copy of each prefix.
- evict: the least recently used LEAF that nobody holds gives up its last block; a node with a
  cached child is never evicted, so shared trunks outlive their branches.

Block size. The paged cache shares whole blocks, so a match is rounded down to a block boundary:
a shared prefix of L tokens reuses L - L % B of them with blocks of B tokens, and the tokens of
the last, partly shared block run again: (B - 1) / 2 per hit on average when L % B is uniform.
The same holds for a chat's next turn, whose previous answer ends in a partial block; and a
prompt cached whole runs its whole last block again (the n - 1 cap), not one token. SGLang runs
its pool with a page size of 1 (one KV slot per page), so a node may split at any token and
every shared token is reused; the price is one page-table entry per token and attention kernels
that gather single rows. vLLM keeps blocks of 16 tokens for its kernels and hashes them.

What the tree buys over the hash chain at the same block size (for the same cached content both
find the same hit):
- one copy per prefix, leaves first: requests admitted together that share a prefix each
  compute it. The hash index keeps the later copies held until their requests end, and their
  later blocks hang under a trunk they do not hold: when the trunk's own request ends first,
  eviction may take the trunk and strand those blocks (cached, but the chain breaks at the
  first miss). The tree swaps the copies for its own blocks as soon as they are computed and
  only cuts leaves, so every cached block stays on a path from the root and a shared trunk
  outlives its branches;
- the structure: the branches of chats, few-shot prompts or a tree of thought are explicit, so
  a scheduler could order waiting requests by match length (SGLang does; not done here);
- lookup compares tokens along one path and stops at the first mismatch, with no hashing.

Same role and interface as prefix_cache.PrefixCache (the block manager takes either; blocks are
plain ints): the pool in minillm/kvcache/block_manager.py owns the reference counts and calls release()
when a cached block loses its last holder and revive() when a hit takes an unheld block back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(eq=False)
class RadixNode:
    """A node and the edge above it: a run of whole blocks that follows its parent's run."""
    key: tuple[int, ...]                      # the first block's tokens: the parent's index of it
    tokens: tuple[int, ...]                   # len(blocks) * block_size token ids
    blocks: list[int]                         # the KV blocks holding them, in order
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    last_used: int = 0                        # the tree's clock at the last insert, hit or release


class RadixCache:
    """A radix tree of cached full blocks, with the LRU order of unheld leaves.

    A cached block is held (some sequence's block table has it) or unheld. Every holder holds
    a path from the root that ends where a node ends: a hit is such a path (split where it
    ends), insert swaps a sequence's duplicates for the tree's blocks, a fork copies its
    parent's table, and copy-on-write only replaces blocks not computed yet, which are not in
    the tree. So nothing below an unheld block is held, leaf-first eviction can reach every
    unheld block, and they are the evictable ones (tests/kvcache/test_paged.py checks this every step).
    """

    def __init__(self):
        self.root = RadixNode(key=(), tokens=(), blocks=[], parent=None)
        self._node_of: dict[int, RadixNode] = {}        # cached block -> its node
        self._unheld: set[int] = set()                  # cached blocks without a holder
        self._clock = 0

    # --- lookup -------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        """Block ids of the longest cached prefix of token_ids, at most (n - 1) // block_size
        blocks (one token must still run to produce logits)."""
        max_blocks = (len(token_ids) - 1) // block_size
        path = self._walk(token_ids[:max_blocks * block_size], block_size)
        return [block for node in path for block in node.blocks]

    def is_cached(self, block: int) -> bool:
        return block in self._node_of

    def is_evictable(self, block: int) -> bool:
        return block in self._unheld

    @property
    def num_evictable(self) -> int:
        return len(self._unheld)

    @property
    def num_cached(self) -> int:
        return len(self._node_of)

    # --- updates (called by the block manager and its pool) -----------------------------
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], block_size: int,
               start: int = 0, state=None) -> tuple[list[tuple[int, int]], None]:
        """Make a sequence's full computed blocks findable. token_ids: the tokens of those blocks
        (a multiple of block_size); blocks: the sequence's block table, which holds them all.

        Returns (swaps, None): (i, block) for each block i whose tokens the tree already holds in
        another block; the sequence must use that block instead of its own. start and state
        are the hash index's (where its chain continues); the tree walks from the root.
        """
        self._clock += 1
        path = self._walk(token_ids, block_size)
        swaps, num_matched = [], 0
        for node in path:
            node.last_used = self._clock
            swaps += [(num_matched + j, block) for j, block in enumerate(node.blocks)
                      if block != blocks[num_matched + j]]
            num_matched += len(node.blocks)
        num_full = len(token_ids) // block_size
        if num_matched < num_full:
            parent = path[-1] if path else self.root
            self._add_leaf(parent, token_ids[num_matched * block_size:num_full * block_size],
                           blocks[num_matched:num_full], block_size)
        return swaps, None

    def release(self, block: int) -> None:
        """The last holder let go of a cached block: its node is the most recently used."""
        self._unheld.add(block)
        self._touch(self._node_of[block])

    def revive(self, block: int) -> None:
        """A hit on an unheld block: some sequence holds it again."""
        self._unheld.remove(block)
        self._touch(self._node_of[block])

    def evict(self) -> int | None:
        """Unregister and return the last block of the least recently used leaf nobody holds
        (None if there is none). Scans the unheld blocks: O(cached blocks) a call."""
        leaves = [n for n in {self._node_of[b] for b in self._unheld} if not n.children]
        if not leaves:
            return None
        node = min(leaves, key=lambda n: (n.last_used, n.blocks[0]))
        block = node.blocks.pop()                       # its K/V is about to be overwritten
        node.tokens = node.tokens[:len(node.tokens) - len(node.key)]
        del self._node_of[block]
        self._unheld.remove(block)
        if not node.blocks:
            del node.parent.children[node.key]
        return block

    # --- the tree -----------------------------------------------------------------------
    def _walk(self, token_ids: Sequence[int], block_size: int) -> list[RadixNode]:
        """The nodes spelling the longest cached prefix of token_ids in whole blocks; the last
        one is split where the match ends inside it."""
        path, node, pos = [], self.root, 0
        while pos + block_size <= len(token_ids):
            child = node.children.get(tuple(token_ids[pos:pos + block_size]))
            if child is None:
                break
            num_equal = _equal_blocks(child, token_ids, pos, block_size)
            if num_equal < len(child.blocks):
                self._split(child, num_equal, block_size)
            path.append(child)
            node, pos = child, pos + num_equal * block_size
        return path

    def _split(self, node: RadixNode, num_blocks: int, block_size: int) -> None:
        """Cut a node after its first num_blocks blocks: it keeps the head, a new child the tail.

            [a b c d]  ->  [a b] -> [c d]          (the children of [a b c d] move to [c d])
        """
        cut = num_blocks * block_size
        tail = RadixNode(key=node.tokens[cut:cut + block_size], tokens=node.tokens[cut:],
                         blocks=node.blocks[num_blocks:], parent=node, children=node.children,
                         last_used=node.last_used)
        for child in tail.children.values():
            child.parent = tail
        for block in tail.blocks:
            self._node_of[block] = tail
        node.tokens, node.blocks, node.children = node.tokens[:cut], node.blocks[:num_blocks], {tail.key: tail}

    def _add_leaf(self, parent: RadixNode, token_ids: Sequence[int], blocks: Sequence[int],
                  block_size: int) -> None:
        """New blocks of one sequence (which holds them) under parent."""
        leaf = RadixNode(key=tuple(token_ids[:block_size]), tokens=tuple(token_ids), blocks=list(blocks),
                         parent=parent, last_used=self._clock)
        parent.children[leaf.key] = leaf
        for block in blocks:
            self._node_of[block] = leaf

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        node.last_used = self._clock


def _equal_blocks(node: RadixNode, token_ids: Sequence[int], pos: int, block_size: int) -> int:
    """How many leading blocks of node's run equal token_ids' blocks from pos (>= 1: the key
    matched already)."""
    num_equal = 1
    while (num_equal < len(node.blocks) and pos + (num_equal + 1) * block_size <= len(token_ids)
           and node.tokens[num_equal * block_size:(num_equal + 1) * block_size]
           == tuple(token_ids[pos + num_equal * block_size:pos + (num_equal + 1) * block_size])):
        num_equal += 1
    return num_equal
