"""The paged block manager: block tables, slot mapping, growth, fork with copy-on-write, free.

Also the torch side, minillm/attention/paged.py, on CPU: the store (int8 too), block copies,
the gather-based reference and its tiled split-K twin. The Triton kernels are in
tests/attention/test_paged_attention.py, prefix caching in tests/kvcache/test_prefix_cache.py.

The property test drives a BlockManager with random sequences of allocate / append / compute /
fork / free on Requests (the one record of tokens and computed counts; the block manager reads
them, it holds no copy) (and, with prefix caching, eviction under memory pressure, with the hash index or
the radix tree) next to a shadow KV memory: every time the test "computes" a token it writes,
at the token's slot, the tuple of all tokens up to it (what the real K/V depends on). After
every step:
- every block's reference count equals the number of block-table entries holding it;
- every block is in exactly one place: held, on the free list, or cached-evictable;
- no eviction hands out a block some request holds;
- every computed token of every live request reads back its own prefix from its slot, so no
  block was handed out twice, freed while held, shared wrongly by a fork or a prefix hit, or
  lost its content in a copy-on-write.
"""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from minillm.attention.paged import (
                                     allocate_kv_cache, block_table_tensor, copy_blocks, gather_kv, paged_attention_reference,
                                     paged_attention_split, store_kv_reference,
                                     )
from minillm.course.calculators import blocks_after_parallel_sampling, prefix_hit_tokens
from minillm.engine.request import Request
from minillm.kvcache.block_manager import BlockManager, OutOfBlocks
from minillm.quant.kv_int8 import dequantize_kv, quantize_kv


def prompt(n, start=100):
    return list(range(start, start + n))


def admit(bm, request_id, token_ids):
    """A request allocated as the scheduler does: its num_computed_tokens starts at the prefix hit."""
    req = Request.from_token_ids(request_id, token_ids)
    req.num_computed_tokens = bm.allocate(req)
    return req


def computed(bm, req, num_computed_tokens):
    """What the scheduler does after a forward: move the request's count on, then tell the block manager."""
    req.num_computed_tokens = num_computed_tokens
    bm.cache_blocks(req)


def grow(bm, req, new_token_ids):
    """A request samples new tokens; the block manager reads them from the request, not from the call."""
    req.output_token_ids += new_token_ids
    return bm.append_slots(req, req.num_tokens)


# --- block tables and slots -------------------------------------------------------------

def test_blocks_are_allocated_as_the_sequence_grows():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = admit(bm, "a", prompt(1))
    assert a.num_computed_tokens == 0
    assert len(bm.block_table("a")) == 1 and bm.num_free_blocks == 7
    assert grow(bm, a, prompt(15, start=101)) == []
    assert len(bm.block_table("a")) == 1                  # 16 tokens still fit one block
    assert grow(bm, a, [7]) == []
    table = bm.block_table("a")
    assert len(table) == 2 and bm.num_free_blocks == 6
    assert bm.slot_mapping("a", 14, 17) == [table[0] * 16 + 14, table[0] * 16 + 15, table[1] * 16]
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.request_ids == []


def test_allocate_reserves_the_whole_prompt_and_no_more():
    bm = BlockManager(num_blocks=10, block_size=4)
    req = admit(bm, "0", prompt(9))
    assert len(bm.block_table("0")) == 3                  # ceil(9 / 4)
    assert bm.num_slots("0") == 9 and req.num_computed_tokens == 0
    slots = bm.slot_mapping("0", 0, 9)
    assert len(set(slots)) == 9 and all(s // 4 in bm.block_table("0") for s in slots)


def test_out_of_blocks_leaves_state_unchanged():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = admit(bm, "a", prompt(8))
    b = Request.from_token_ids("b", prompt(5))
    assert not bm.can_allocate(b)
    with pytest.raises(OutOfBlocks):
        bm.allocate(b)
    assert bm.request_ids == ["a"] and bm.num_free_blocks == 1
    assert bm.can_append_slots(a, 12) and not bm.can_append_slots(a, 13)
    with pytest.raises(OutOfBlocks):
        grow(bm, a, prompt(5, start=200))                 # 13 tokens
    assert bm.num_slots("a") == 8 and len(bm.block_table("a")) == 2 and bm.num_free_blocks == 1


def test_the_block_manager_holds_no_copy_of_the_tokens():
    """One record per request: the block manager keeps the block table and the prefix-cache
    registration; tokens and the computed count are read from the Request whenever needed."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = admit(bm, "a", prompt(3))
    assert set(vars(bm._tables["a"])) == {"blocks", "num_slots", "num_registered", "cache_state", "num_dropped"}
    computed(bm, a, 3)
    a.output_token_ids += [7, 8]                          # the request grows on its own...
    bm.append_slots(a, a.num_tokens)                      # ...the call passes a count, no tokens
    computed(bm, a, 5)                                    # its first block is now full and computed
    later = Request.from_token_ids("b", prompt(3) + [7, 9])
    assert bm.cached_prefix_tokens(later) == 4            # block 0 = prompt(3) + [7], read from a
    assert bm.cached_prefix_tokens(Request.from_token_ids("c", prompt(3) + [8, 9])) == 0
    a.spec_token_ids = [1, 2, 3, 4]                       # draft tokens count as the request's too
    assert bm.append_slots(a, a.num_tokens_with_spec) == [] and bm.num_slots("a") == 9
    with pytest.raises(ValueError, match="holds only 9 tokens"):
        bm.append_slots(a, 10)                            # no slot for a token the request lacks
    assert not any(isinstance(v, list) and v[:3] == prompt(3)
                   for table in bm._tables.values() for v in vars(table).values())


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = prompt(6)                                    # one full block + a half-full one
    p = admit(bm, "p", tokens)
    computed(bm, p, 6)
    c = Request.from_token_ids("c", tokens)               # the child: a copy of the parent
    c.num_computed_tokens = p.num_computed_tokens
    bm.fork("p", "c")
    assert bm.block_table("c") == bm.block_table("p")
    assert all(bm.pool.ref_counts[b] == 2 for b in bm.block_table("p"))
    assert bm.num_free_blocks == 6                        # forking copies no block
    full, last = bm.block_table("p")
    copies = grow(bm, p, [1])                             # p writes into the shared half block
    assert len(copies) == 1 and copies[0][0] == last
    assert bm.block_table("p") == [full, copies[0][1]]
    assert bm.pool.ref_counts[last] == 1 and bm.pool.ref_counts[full] == 2
    assert grow(bm, c, [2]) == []                         # c is now the only holder: no copy
    assert bm.block_table("c") == [full, last]
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.pool.ref_counts)


def test_fork_exactly_at_a_block_boundary_copies_nothing():
    """Regression: forking when the last block is full must not copy it; both sequences get a
    fresh block for their next token and keep sharing the full ones."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = prompt(8)
    p = admit(bm, "p", tokens)
    computed(bm, p, 8)
    c = Request.from_token_ids("c", tokens)
    c.num_computed_tokens = p.num_computed_tokens
    bm.fork("p", "c")
    shared = bm.block_table("p")
    assert grow(bm, p, [1]) == []
    assert grow(bm, c, [2]) == []
    assert bm.block_table("p")[:2] == shared == bm.block_table("c")[:2]
    assert bm.block_table("p")[2] != bm.block_table("c")[2]
    assert [bm.pool.ref_counts[b] for b in shared] == [2, 2]
    assert bm.num_free_blocks == 8 - 4


def test_fork_during_prefill_copies_the_blocks_still_to_be_written():
    """A fork before the prompt is computed: the blocks the next forward writes are copied."""
    bm = BlockManager(num_blocks=8, block_size=4)
    p = admit(bm, "p", prompt(10))
    computed(bm, p, 4)                                    # block 0 computed, blocks 1-2 not yet
    bm.fork("p", "c")
    copies = bm.append_slots(p, p.num_tokens)             # before p's next forward
    assert [src for src, _ in copies] == bm.block_table("c")[1:]
    assert bm.block_table("p")[0] == bm.block_table("c")[0]


def test_parallel_sampling_keeps_each_branch_kv_right():
    """n = 3 samples of one prompt: fork twice, append a different token to each branch, write
    K/V through the slot mapping (after the copy-on-write copies) and check that each branch's
    paged attention equals attention over its own contiguous K/V."""
    bs, Hkv, D = 4, 2, 8
    bm = BlockManager(num_blocks=12, block_size=bs)
    k_cache, v_cache = allocate_kv_cache(12, bs, Hkv, D)
    gen = torch.Generator().manual_seed(0)
    kv_of = {}                                            # token prefix -> its (K, V) rows

    def kv_row(prefix):
        if prefix not in kv_of:
            kv_of[prefix] = torch.randn(2, Hkv, D, generator=gen)
        return kv_of[prefix]

    def forward(req):
        copy_blocks([k_cache, v_cache], bm.append_slots(req, req.num_tokens))
        tokens, start = req.all_token_ids, req.num_computed_tokens
        rows = torch.stack([kv_row(tuple(tokens[:p + 1])) for p in range(start, len(tokens))])
        store_kv_reference(rows[:, 0], rows[:, 1], k_cache, v_cache,
                           torch.tensor(bm.slot_mapping(req.request_id, start, len(tokens))))
        computed(bm, req, len(tokens))

    base = prompt(6)
    samples = [admit(bm, "0", base)]
    forward(samples[0])
    for s in "12":
        samples.append(Request.from_token_ids(s, base))
        samples[-1].num_computed_tokens = samples[0].num_computed_tokens
        bm.fork("0", s)
    for s, req in enumerate(samples):
        req.output_token_ids.append(s)
        forward(req)
        req.output_token_ids.append(9)
        forward(req)
    q = torch.randn(3, 4, D, generator=gen)
    tables = block_table_tensor([bm.block_table(req.request_id) for req in samples])
    lens = torch.tensor([req.num_tokens for req in samples])
    out = paged_attention_reference(q, k_cache, v_cache, tables, lens, D ** -0.5)
    for s, req in enumerate(samples):
        tokens = req.all_token_ids
        assert tokens == base + [s, 9]
        rows = torch.stack([kv_row(tuple(tokens[:p + 1])) for p in range(len(tokens))])   # (L, 2, Hkv, D)
        k = rows[:, 0].repeat_interleave(2, dim=1).transpose(0, 1)          # (Hq, L, D)
        v = rows[:, 1].repeat_interleave(2, dim=1).transpose(0, 1)          # (Hq, L, D)
        want = torch.nn.functional.scaled_dot_product_attention(q[s][:, None], k, v)[:, 0]
        torch.testing.assert_close(out[s], want, atol=1e-5, rtol=1e-5)
    assert bm.pool.ref_counts[bm.block_table("0")[0]] == 3  # the full prompt block is still shared


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)
    bm = BlockManager(4, block_size=4)
    with pytest.raises(ValueError, match="token_ids"):
        bm.allocate(Request.from_token_ids("a", []))
    a = admit(bm, "a", prompt(5))
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate(Request.from_token_ids("a", prompt(2)))
    with pytest.raises(ValueError, match="unknown request_id"):
        bm.free("b")
    with pytest.raises(ValueError, match="unknown request_id"):
        bm.append_slots(Request.from_token_ids("b", prompt(5)), 5)
    with pytest.raises(ValueError, match="only grows"):
        bm.append_slots(a, 3)
    with pytest.raises(ValueError, match="holds only 5 tokens"):
        bm.append_slots(a, 6)
    a.num_computed_tokens = 6
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.cache_blocks(a)                                # more than the table holds
    computed(bm, a, 3)
    with pytest.raises(ValueError, match="start"):
        bm.slot_mapping("a", 0, 6)
    with pytest.raises(ValueError, match="child_id"):
        bm.fork("a", "a")
    with pytest.raises(ValueError, match="computed tokens cannot be dropped"):
        bm.truncate(a, 2)                                 # 3 are computed
    with pytest.raises(ValueError, match="num_tokens"):
        bm.truncate(a, 6)                                 # it holds 5
    bm.free("a")
    with pytest.raises(ValueError, match="unknown request_id"):
        bm.free("a")                                      # a double free


def test_cached_blocks_cannot_be_uncomputed():
    """The computed count lives on the Request; the block manager still refuses to go back past
    the blocks it registered in the prefix cache (their K/V is indexed for other requests)."""
    bm = BlockManager(8, block_size=4, enable_prefix_caching=True)
    a = admit(bm, "a", prompt(6))
    computed(bm, a, 5)                                    # block 0 is full and cached
    with pytest.raises(ValueError, match=r"num_computed_tokens must be in \[4, 6\]"):
        computed(bm, a, 2)                                # counters only move forward
    a.num_computed_tokens = 5
    bm.cache_blocks(a)


def test_truncate_frees_only_the_blocks_a_rollback_empties():
    bm = BlockManager(6, block_size=4)
    a = admit(bm, "a", prompt(5))                         # 2 blocks
    computed(bm, a, 4)
    a.spec_token_ids = [90, 91, 92, 93, 94]
    bm.append_slots(a, a.num_tokens_with_spec)            # 5 drafts: 3 blocks
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 3
    a.spec_token_ids = []                                 # verified: 2 accepted, the rest rejected
    bm.truncate(a, 7)                                     # still 2 blocks
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 4 and bm.num_slots("a") == 7


def test_a_stop_inside_accepted_drafts_caches_only_the_tokens_the_request_holds():
    """Engine._verify counts every accepted draft as computed, but a stop token among them ends the
    output early: the request then holds fewer tokens than computed slots, and only blocks whose
    tokens it still holds may become findable."""
    bm = BlockManager(8, block_size=4, enable_prefix_caching=True)
    a = admit(bm, "a", prompt(5))
    computed(bm, a, 4)                                    # the pending token is position 4
    a.spec_token_ids = [50, 51, 52, 53]
    bm.append_slots(a, a.num_tokens_with_spec)            # 9 slots
    a.spec_token_ids = []                                 # all 4 accepted...
    bm.truncate(a, 9)
    a.output_token_ids.append(50)                         # ...but 50 was a stop token: 6 tokens
    computed(bm, a, 9)                                    # 9 slots computed, 6 tokens known
    again = Request.from_token_ids("b", prompt(5) + [50, 51, 52, 53, 0])
    assert bm.cached_prefix_tokens(again) == 4            # block 1 (tokens 4..7) is not indexed
    assert bm._tables["a"].num_registered == 1            # nor counted as registered


# --- the property test ------------------------------------------------------------------

PREFIXES = [prompt(7, 0), prompt(5, 0) + [50, 51], prompt(9, 200)]   # shared heads collide


class BlockManagerMachine(RuleBasedStateMachine):
    caching = False
    prefix_cache = "hash"

    def __init__(self):
        super().__init__()
        self.bs = 3
        self.bm = BlockManager(num_blocks=10, block_size=self.bs, enable_prefix_caching=self.caching,
                               prefix_cache=self.prefix_cache)
        self.requests = {}                                # request_id -> its Request (the one record)
        self.shadow = {}                                  # slot -> token prefix whose K/V it holds
        self.finished = []                                # token lists of freed requests
        self.next_id = 0
        if self.caching:
            self.bm.prefix_cache.evict = self._checked(self.bm.prefix_cache.evict)

    def _checked(self, evict):
        def evict_unheld():
            block = evict()
            assert block is not None and self.bm.pool.ref_counts[block] == 0
            assert all(block not in self.bm.block_table(rid) for rid in self.requests)
            return block
        return evict_unheld

    def _new_id(self):
        self.next_id += 1
        return f"r{self.next_id:03d}"

    @rule(data=st.data(), head=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=6))
    def allocate(self, data, head, tail):
        tokens = head + tail
        if self.finished and data.draw(st.booleans()):
            tokens = data.draw(st.sampled_from(self.finished))   # re-admission: a 100% prefix match,
            if data.draw(st.booleans()):
                tokens = tokens + tail                           # or the next turn of a chat
        if not tokens:
            return
        req, free_before = Request.from_token_ids(self._new_id(), tokens), self.bm.num_free_blocks
        if not self.bm.can_allocate(req):
            with pytest.raises(OutOfBlocks):
                self.bm.allocate(req)
            assert self.bm.num_free_blocks == free_before and req.request_id not in self.bm.request_ids
            return
        cached = self.bm.allocate(req)
        assert cached % self.bs == 0 and cached <= len(tokens) - 1
        assert cached == 0 or self.caching
        req.num_computed_tokens = cached
        self.requests[req.request_id] = req

    @rule(data=st.data())
    def memory_pressure(self, data):
        """A request of unseen tokens that takes some of the free blocks: once the never-cached
        ones are gone, each further block is an eviction."""
        if self.bm.num_free_blocks:
            rid, num_blocks = self._new_id(), data.draw(st.integers(1, self.bm.num_free_blocks))
            req = Request.from_token_ids(rid, prompt(num_blocks * self.bs, start=1000 + 100 * self.next_id))
            assert self.bm.allocate(req) == 0
            self.requests[rid] = req

    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def append(self, data, new):
        if not self.requests:
            return
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        req.output_token_ids += new                       # sampled: the request grows first
        if not self.bm.can_append_slots(req, req.num_tokens):
            with pytest.raises(OutOfBlocks):
                self.bm.append_slots(req, req.num_tokens)
            del req.output_token_ids[-len(new):]          # not scheduled: as if never sampled
            return
        self._copy(self.bm.append_slots(req, req.num_tokens))

    @rule(data=st.data(), chunk=st.integers(1, 8))
    def compute(self, data, chunk):
        """One forward over the next chunk of a request (chunked prefill or a decode step)."""
        if not self.requests:
            return
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        if not self.bm.can_append_slots(req, req.num_tokens):
            return                                        # the copy-on-write would not fit
        self._copy(self.bm.append_slots(req, req.num_tokens))   # the protocol: before every forward
        tokens, start = req.all_token_ids, req.num_computed_tokens
        end = min(len(tokens), start + chunk)
        for p, slot in zip(range(start, end), self.bm.slot_mapping(req.request_id, start, end)):
            self.shadow[slot] = tuple(tokens[:p + 1])
        req.num_computed_tokens = end
        self.bm.cache_blocks(req)

    @rule(data=st.data(), drafts=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def speculate(self, data, drafts):
        """A verification step: the pending token plus draft tokens are appended and run (their K/V
        written), then the rejected drafts are rolled back; accepted ones stay computed."""
        ready = [rid for rid in sorted(self.requests)
                 if self.requests[rid].num_computed_tokens == self.requests[rid].num_tokens - 1]
        if not ready:
            return
        req = self.requests[data.draw(st.sampled_from(ready))]
        req.spec_token_ids = list(drafts)
        if not self.bm.can_append_slots(req, req.num_tokens_with_spec):
            req.spec_token_ids = []
            return
        free_before, blocks_before = self.bm.num_free_blocks, self.bm.block_table(req.request_id)
        # shared before the append: copy-on-write may then give req a private copy, a legitimate new table
        shared = any(self.bm.pool.ref_counts[b] > 1 for b in blocks_before)
        self._copy(self.bm.append_slots(req, req.num_tokens_with_spec))
        tokens, start = req.all_token_ids + req.spec_token_ids, req.num_computed_tokens
        for p, slot in zip(range(start, len(tokens)), self.bm.slot_mapping(req.request_id, start, len(tokens))):
            self.shadow[slot] = tuple(tokens[:p + 1])     # every draft's K/V is written...
        accepted = data.draw(st.integers(0, len(drafts)))
        kept = req.num_tokens + accepted
        req.spec_token_ids = []                           # verified, as the engine does: then roll back
        self.bm.truncate(req, kept)                       # ...and the rejected ones forgotten
        req.output_token_ids += drafts[:accepted]         # the accepted drafts are output
        req.num_computed_tokens = kept
        if accepted == 0 and not shared:                  # the rollback left nothing behind
            assert self.bm.block_table(req.request_id) == blocks_before and self.bm.num_free_blocks == free_before
        self.bm.cache_blocks(req)                         # radix may then swap a now-full block for its cached twin

    @rule(data=st.data())
    def fork(self, data):
        if not self.requests:
            return
        parent = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        child = Request.from_token_ids(self._new_id(), parent.all_token_ids)    # a copy of the parent
        child.num_computed_tokens = parent.num_computed_tokens
        self.bm.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child

    @rule(data=st.data())
    def free(self, data):
        if not self.requests:
            return
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.bm.free(rid)
        self.finished.append(self.requests.pop(rid).all_token_ids)

    def _copy(self, copies):
        for src, dst in copies:
            for offset in range(self.bs):
                if src * self.bs + offset in self.shadow:
                    self.shadow[dst * self.bs + offset] = self.shadow[src * self.bs + offset]

    @invariant()
    def reference_counts_equal_holders(self):
        holders = [0] * self.bm.num_blocks
        for rid in self.requests:
            for block in self.bm.block_table(rid):
                holders[block] += 1
        assert holders == self.bm.pool.ref_counts

    @invariant()
    def every_block_is_in_exactly_one_place(self):
        free = self.bm.pool.free_block_ids()
        cache = self.bm.prefix_cache
        evictable = [b for b in range(self.bm.num_blocks) if cache and cache.is_evictable(b)]
        held = [b for b, r in enumerate(self.bm.pool.ref_counts) if r > 0]
        assert len(free) == len(set(free))                # no double free
        assert sorted(free + evictable + held) == list(range(self.bm.num_blocks))
        assert self.bm.num_free_blocks == len(free) + len(evictable)
        assert all(not cache or not cache.is_cached(b) for b in free)

    @invariant()
    def computed_tokens_read_back_their_own_prefix(self):
        assert sorted(self.bm.request_ids) == sorted(self.requests)
        for rid, req in self.requests.items():
            tokens = req.all_token_ids
            assert self.bm.num_slots(rid) == len(tokens)
            for p, slot in enumerate(self.bm.slot_mapping(rid, 0, req.num_computed_tokens)):
                assert self.shadow.get(slot) == tuple(tokens[:p + 1])


class CachingBlockManagerMachine(BlockManagerMachine):
    caching = True


class RadixBlockManagerMachine(CachingBlockManagerMachine):
    prefix_cache = "radix"

    @invariant()
    def the_tree_holds_what_it_says(self):
        """Each cached block holds the K/V of the prefix its path spells (so a hit returns the
        blocks that prefix was computed in), and nothing below an unheld block is held (so
        leaf-first eviction reaches every evictable block)."""
        tree, refs, bs = self.bm.prefix_cache, self.bm.pool.ref_counts, self.bs
        seen = []

        def visit(node, prefix, under_unheld):
            assert len(node.tokens) == len(node.blocks) * bs and node.tokens[:bs] == node.key
            for j, block in enumerate(node.blocks):
                seen.append(block)
                under_unheld = under_unheld or refs[block] == 0
                assert not (under_unheld and refs[block])
                for offset in range(bs):
                    position = len(prefix) + j * bs + offset
                    assert self.shadow[block * bs + offset] == tuple((prefix + node.tokens)[:position + 1])
            for key, child in node.children.items():
                assert child.key == key and child.parent is node and child.blocks
                visit(child, prefix + node.tokens, under_unheld)

        visit(tree.root, (), False)
        assert len(seen) == len(set(seen)) == tree.num_cached


MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=60, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.settings = MACHINE_SETTINGS
TestCachingBlockManagerProperties = CachingBlockManagerMachine.TestCase
TestCachingBlockManagerProperties.settings = MACHINE_SETTINGS
TestRadixBlockManagerProperties = RadixBlockManagerMachine.TestCase
TestRadixBlockManagerProperties.settings = MACHINE_SETTINGS


# --- the torch side ---------------------------------------------------------------------

def test_store_copy_and_gather():
    k_cache, v_cache = allocate_kv_cache(4, 2, 1, 3)                      # (4, 2, 1, 3)
    k = torch.arange(9.0).view(3, 1, 3)                                   # (T=3, Hkv, D)
    store_kv_reference(k, -k, k_cache, v_cache, torch.tensor([5, -1, 2]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(k_cache[1, 0], k[2])
    assert k_cache.abs().sum() == k[0].sum() + k[2].sum()                 # slot -1 skipped
    copy_blocks([k_cache, v_cache], [(2, 0)])
    assert torch.equal(k_cache[0], k_cache[2]) and torch.equal(v_cache[0], v_cache[2])
    k_seq, v_seq = (x[0, :4] for x in gather_kv(k_cache, v_cache, torch.tensor([[1, 2, 3]])))
    assert k_seq.shape == (4, 1, 3)
    assert torch.equal(k_seq[0], k[2]) and torch.equal(k_seq[3], k[0]) and torch.equal(v_seq[3], -k[0])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_int8_store_copy_and_gather(fmt):
    """An int8 (or fp8: e4m3 bits in uint8) cache: the store quantises each row once, block copies
    carry the scales, the gather dequantises; all layers' caches at once copy along block_dim=1."""
    from minillm.quant.kv_fp8 import dequantize_kv_fp8, quantize_kv_fp8

    quantize, dequantize = (quantize_kv, dequantize_kv) if fmt == "int8" else (quantize_kv_fp8, dequantize_kv_fp8)
    gen = torch.Generator().manual_seed(0)
    L, nb, bs, Hkv, D = 2, 4, 2, 2, 8
    store = torch.int8 if fmt == "int8" else torch.uint8
    k_cache, v_cache = (torch.zeros(L, nb, bs, Hkv, D, dtype=store) for _ in range(2))
    k_scale, v_scale = (torch.zeros(L, nb, bs, Hkv, 1, dtype=torch.float16) for _ in range(2))
    k, v = torch.randn(3, Hkv, D, generator=gen), torch.randn(3, Hkv, D, generator=gen)   # (T, Hkv, D)
    store_kv_reference(k, v, k_cache[1], v_cache[1], torch.tensor([2, 3, 4]), k_scale[1], v_scale[1],
                       skip_padding=False)
    copy_blocks([k_cache, v_cache, k_scale, v_scale], [(1, 3)], block_dim=1)   # slots 2, 3 -> 6, 7
    keys, values = gather_kv(k_cache[1], v_cache[1], torch.tensor([[3, 2]]), k_scale[1], v_scale[1])
    expected_k, expected_v = (dequantize(*quantize(x[None]))[0] for x in (k, v))  # (T, Hkv, D)
    assert torch.equal(keys[0, :3], expected_k) and torch.equal(values[0, :3], expected_v)
    assert not k_cache[0].any()                                           # layer 0 untouched


def test_block_table_tensor_pads():
    t = block_table_tensor([[3, 1], [], [7]])
    assert t.dtype == torch.int32 and t.tolist() == [[3, 1], [0, 0], [7, 0]]


@pytest.mark.parametrize("num_splits,tile", [(1, 16), (3, 16), (4, 8), (64, 4)])
def test_split_twin_matches_reference(num_splits, tile):
    gen = torch.Generator().manual_seed(0)
    lengths, bs, Hkv, D = [1, 37, 100, 0], 16, 2, 8
    k_cache = torch.randn(20, bs, Hkv, D, generator=gen)
    v_cache = torch.randn(20, bs, Hkv, D, generator=gen)
    order = torch.randperm(20, generator=gen).tolist()
    tables = [order[:1], order[1:4], order[4:11], []]
    q = torch.randn(len(lengths), 3 * Hkv, D, generator=gen)
    args = (q, k_cache, v_cache, block_table_tensor(tables), torch.tensor(lengths), 0.5)
    ref = paged_attention_reference(*args)
    out = paged_attention_split(*args, num_splits=num_splits, tile=tile)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_attention_argument_checks():
    k_cache, v_cache = allocate_kv_cache(2, 4, 2, 8)
    tables, lens = block_table_tensor([[0]]), torch.tensor([3])
    with pytest.raises(ValueError, match="q must be"):
        paged_attention_reference(torch.zeros(4, 8), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_reference(torch.zeros(1, 4, 6), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_split(torch.zeros(1, 4, 8), k_cache, v_cache, tables, lens, 1.0, num_splits=0)


def test_parallel_sampling_shares_full_blocks_and_copies_only_the_last():
    assert blocks_after_parallel_sampling(1000, 1) == 63                 # 1001 tokens in blocks of 16
    assert blocks_after_parallel_sampling(1000, 4) == 62 + 4            # 62 shared, the partial one copied 3 times
    assert blocks_after_parallel_sampling(1024, 4) == 64 + 4            # full blocks shared; a new block each
    assert blocks_after_parallel_sampling(1000, 4, block_size=256) == 3 + 4


def test_prefix_hits_are_whole_blocks_and_leave_the_last_token_to_compute():
    assert prefix_hit_tokens(1030, 1043) == 1024                        # the partial 65th block is recomputed
    assert prefix_hit_tokens(1024, 1043) == 1024
    assert prefix_hit_tokens(1024, 1024) == 1024 - 16                   # a full hit is capped at n - 1 tokens
    assert prefix_hit_tokens(15, 40) == 0                               # no full block shared
