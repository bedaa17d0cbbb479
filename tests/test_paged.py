"""The paged block manager: block tables, slot mapping, growth, fork with copy-on-write, free.

Also the torch side, minillm/paged_attention.py, on CPU: the store (int8 too), block copies,
the gather-based reference and its tiled split-K twin. The Triton kernels are in
tests/test_paged_attention.py, prefix caching in tests/test_prefix_cache.py.

The property test drives a BlockManager with random sequences of allocate / append / compute /
fork / free (and, with prefix caching, eviction under memory pressure, with the hash index or
the radix tree) next to a shadow KV memory: every time the test "computes" a token it writes,
at the token's slot, the tuple of all tokens up to it (what the real K/V depends on). After
every step:
- every block's reference count equals the number of block-table entries holding it;
- every block is in exactly one place: held, on the free list, or cached-evictable;
- no eviction hands out a block some sequence holds;
- every computed token of every live sequence reads back its own prefix from its slot, so no
  block was handed out twice, freed while held, shared wrongly by a fork or a prefix hit, or
  lost its content in a copy-on-write.
"""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from minillm.block_manager import BlockManager, OutOfBlocks, blocks_after_parallel_sampling, prefix_hit_tokens
from minillm.paged_attention import (
    allocate_kv_cache, block_table_tensor, copy_blocks, gather_kv, paged_attention_reference,
    paged_attention_split, store_kv_reference,
)
from minillm.quant.kv_int8 import dequantize_kv, quantize_kv


def prompt(n, start=100):
    return list(range(start, start + n))


# --- block tables and slots -------------------------------------------------------------

def test_blocks_are_allocated_as_the_sequence_grows():
    bm = BlockManager(num_blocks=8, block_size=16)
    assert bm.allocate("a", prompt(1)) == 0
    assert len(bm.block_table("a")) == 1 and bm.num_free_blocks == 7
    tokens = prompt(16)
    assert bm.append_slots("a", tokens) == []
    assert len(bm.block_table("a")) == 1                  # 16 tokens still fit one block
    assert bm.append_slots("a", tokens + [7]) == []
    table = bm.block_table("a")
    assert len(table) == 2 and bm.num_free_blocks == 6
    assert bm.slot_mapping("a", 14, 17) == [table[0] * 16 + 14, table[0] * 16 + 15, table[1] * 16]
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.seq_ids == []


def test_allocate_reserves_the_whole_prompt_and_no_more():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate(0, prompt(9))
    assert len(bm.block_table(0)) == 3                    # ceil(9 / 4)
    assert bm.num_tokens(0) == 9 and bm.num_computed_tokens(0) == 0
    slots = bm.slot_mapping(0, 0, 9)
    assert len(set(slots)) == 9 and all(s // 4 in bm.block_table(0) for s in slots)


def test_out_of_blocks_leaves_state_unchanged():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", prompt(8))
    assert not bm.can_allocate(prompt(5))
    with pytest.raises(OutOfBlocks):
        bm.allocate("b", prompt(5))
    assert bm.seq_ids == ["a"] and bm.num_free_blocks == 1
    assert bm.can_append_slots("a", 12) and not bm.can_append_slots("a", 13)
    with pytest.raises(OutOfBlocks):
        bm.append_slots("a", prompt(13))
    assert bm.num_tokens("a") == 8 and len(bm.block_table("a")) == 2 and bm.num_free_blocks == 1


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = prompt(6)                                    # one full block + a half-full one
    bm.allocate("p", tokens)
    bm.mark_computed("p", 6)
    bm.fork("p", "c")
    assert bm.block_table("c") == bm.block_table("p")
    assert all(bm.pool.ref_counts[b] == 2 for b in bm.block_table("p"))
    assert bm.num_free_blocks == 6                        # forking copies no block
    full, last = bm.block_table("p")
    copies = bm.append_slots("p", tokens + [1])           # p writes into the shared half block
    assert len(copies) == 1 and copies[0][0] == last
    assert bm.block_table("p") == [full, copies[0][1]]
    assert bm.pool.ref_counts[last] == 1 and bm.pool.ref_counts[full] == 2
    assert bm.append_slots("c", tokens + [2]) == []       # c is now the only holder: no copy
    assert bm.block_table("c") == [full, last]
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.pool.ref_counts)


def test_fork_exactly_at_a_block_boundary_copies_nothing():
    """Regression: forking when the last block is full must not copy it; both sequences get a
    fresh block for their next token and keep sharing the full ones."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = prompt(8)
    bm.allocate("p", tokens)
    bm.mark_computed("p", 8)
    bm.fork("p", "c")
    shared = bm.block_table("p")
    assert bm.append_slots("p", tokens + [1]) == []
    assert bm.append_slots("c", tokens + [2]) == []
    assert bm.block_table("p")[:2] == shared == bm.block_table("c")[:2]
    assert bm.block_table("p")[2] != bm.block_table("c")[2]
    assert [bm.pool.ref_counts[b] for b in shared] == [2, 2]
    assert bm.num_free_blocks == 8 - 4


def test_fork_during_prefill_copies_the_blocks_still_to_be_written():
    """A fork before the prompt is computed: the blocks the next forward writes are copied."""
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("p", prompt(10))
    bm.mark_computed("p", 4)                              # block 0 computed, blocks 1-2 not yet
    bm.fork("p", "c")
    copies = bm.append_slots("p", prompt(10))             # before p's next forward
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

    def forward(seq, tokens):
        copy_blocks([k_cache, v_cache], bm.append_slots(seq, tokens))
        start = bm.num_computed_tokens(seq)
        rows = torch.stack([kv_row(tuple(tokens[:p + 1])) for p in range(start, len(tokens))])
        store_kv_reference(rows[:, 0], rows[:, 1], k_cache, v_cache,
                           torch.tensor(bm.slot_mapping(seq, start, len(tokens))))
        bm.mark_computed(seq, len(tokens))

    base = prompt(6)
    bm.allocate(0, base)
    forward(0, base)
    bm.fork(0, 1)
    bm.fork(0, 2)
    branches = {s: base + [s] for s in range(3)}
    for s in range(3):
        forward(s, branches[s])
        forward(s, branches[s] + [9])
    q = torch.randn(3, 4, D, generator=gen)
    tables = block_table_tensor([bm.block_table(s) for s in range(3)])
    lens = torch.tensor([len(branches[s]) + 1 for s in range(3)])
    out = paged_attention_reference(q, k_cache, v_cache, tables, lens, D ** -0.5)
    for s in range(3):
        tokens = branches[s] + [9]
        rows = torch.stack([kv_row(tuple(tokens[:p + 1])) for p in range(len(tokens))])   # (L, 2, Hkv, D)
        k = rows[:, 0].repeat_interleave(2, dim=1).transpose(0, 1)          # (Hq, L, D)
        v = rows[:, 1].repeat_interleave(2, dim=1).transpose(0, 1)          # (Hq, L, D)
        want = torch.nn.functional.scaled_dot_product_attention(q[s][:, None], k, v)[:, 0]
        torch.testing.assert_close(out[s], want, atol=1e-5, rtol=1e-5)
    assert bm.pool.ref_counts[bm.block_table(0)[0]] == 3  # the full prompt block is still shared


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)
    bm = BlockManager(4, block_size=4)
    with pytest.raises(ValueError, match="token_ids"):
        bm.allocate("a", [])
    bm.allocate("a", prompt(5))
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("a", prompt(2))
    with pytest.raises(ValueError, match="unknown seq_id"):
        bm.free("b")
    with pytest.raises(ValueError, match="only grows"):
        bm.append_slots("a", prompt(3))
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.mark_computed("a", 6)
    bm.mark_computed("a", 3)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.mark_computed("a", 2)                          # counters only move forward
    with pytest.raises(ValueError, match="start"):
        bm.slot_mapping("a", 0, 6)
    with pytest.raises(ValueError, match="child_id"):
        bm.fork("a", "a")
    with pytest.raises(ValueError, match="computed tokens cannot be dropped"):
        bm.truncate("a", 2)                               # 3 are computed
    with pytest.raises(ValueError, match="num_tokens"):
        bm.truncate("a", 6)                               # it holds 5


def test_truncate_frees_only_the_blocks_a_rollback_empties():
    bm = BlockManager(6, block_size=4)
    bm.allocate("a", prompt(5))                           # 2 blocks
    bm.mark_computed("a", 4)
    bm.append_slots("a", prompt(5) + [90, 91, 92, 93, 94])   # 5 drafts: 3 blocks
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 3
    bm.truncate("a", 7)                                   # 2 accepted: still 2 blocks
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 4 and bm.num_tokens("a") == 7


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
        self.tokens = {}                                  # seq id -> its token ids (the test's view)
        self.shadow = {}                                  # slot -> token prefix whose K/V it holds
        self.finished = []                                # token lists of freed sequences
        self.next_id = 0
        if self.caching:
            self.bm.prefix_cache.evict = self._checked(self.bm.prefix_cache.evict)

    def _checked(self, evict):
        def evict_unheld():
            block = evict()
            assert block is not None and self.bm.pool.ref_counts[block] == 0
            assert all(block not in self.bm.block_table(seq) for seq in self.tokens)
            return block
        return evict_unheld

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(data=st.data(), head=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=6))
    def allocate(self, data, head, tail):
        tokens = head + tail
        if self.finished and data.draw(st.booleans()):
            tokens = data.draw(st.sampled_from(self.finished))   # re-admission: a 100% prefix match,
            if data.draw(st.booleans()):
                tokens = tokens + tail                           # or the next turn of a chat
        if not tokens:
            return
        seq, free_before = self._new_id(), self.bm.num_free_blocks
        if not self.bm.can_allocate(tokens):
            with pytest.raises(OutOfBlocks):
                self.bm.allocate(seq, tokens)
            assert self.bm.num_free_blocks == free_before and seq not in self.bm.seq_ids
            return
        cached = self.bm.allocate(seq, tokens)
        assert cached % self.bs == 0 and cached <= len(tokens) - 1
        assert cached == 0 or self.caching
        assert self.bm.num_computed_tokens(seq) == cached
        self.tokens[seq] = list(tokens)

    @rule(data=st.data())
    def memory_pressure(self, data):
        """A sequence of unseen tokens that takes some of the free blocks: once the never-cached
        ones are gone, each further block is an eviction."""
        if self.bm.num_free_blocks:
            seq, num_blocks = self._new_id(), data.draw(st.integers(1, self.bm.num_free_blocks))
            tokens = prompt(num_blocks * self.bs, start=1000 + 100 * seq)
            assert self.bm.allocate(seq, tokens) == 0
            self.tokens[seq] = tokens

    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def append(self, data, new):
        if not self.tokens:
            return
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq] + new
        if not self.bm.can_append_slots(seq, len(tokens)):
            with pytest.raises(OutOfBlocks):
                self.bm.append_slots(seq, tokens)
            return
        self._copy(self.bm.append_slots(seq, tokens))
        self.tokens[seq] = tokens

    @rule(data=st.data(), chunk=st.integers(1, 8))
    def compute(self, data, chunk):
        """One forward over the next chunk of a sequence (chunked prefill or a decode step)."""
        if not self.tokens:
            return
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq]
        if not self.bm.can_append_slots(seq, len(tokens)):
            return                                        # the copy-on-write would not fit
        self._copy(self.bm.append_slots(seq, tokens))     # the protocol: before every forward
        start = self.bm.num_computed_tokens(seq)
        end = min(len(tokens), start + chunk)
        for p, slot in zip(range(start, end), self.bm.slot_mapping(seq, start, end)):
            self.shadow[slot] = tuple(tokens[:p + 1])
        self.bm.mark_computed(seq, end)

    @rule(data=st.data(), drafts=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def speculate(self, data, drafts):
        """A verification step: the pending token plus draft tokens are appended and run (their K/V
        written), then the rejected drafts are rolled back; accepted ones stay computed."""
        ready = [s for s in sorted(self.tokens) if self.bm.num_computed_tokens(s) == len(self.tokens[s]) - 1]
        if not ready:
            return
        seq = data.draw(st.sampled_from(ready))
        tokens = self.tokens[seq] + drafts
        if not self.bm.can_append_slots(seq, len(tokens)):
            return
        free_before, blocks_before = self.bm.num_free_blocks, self.bm.block_table(seq)
        # shared before the append: copy-on-write may then give seq a private copy, a legitimate new table
        shared = any(self.bm.pool.ref_counts[b] > 1 for b in blocks_before)
        self._copy(self.bm.append_slots(seq, tokens))
        start = self.bm.num_computed_tokens(seq)
        for p, slot in zip(range(start, len(tokens)), self.bm.slot_mapping(seq, start, len(tokens))):
            self.shadow[slot] = tuple(tokens[:p + 1])     # every draft's K/V is written...
        accepted = data.draw(st.integers(0, len(drafts)))
        kept = len(self.tokens[seq]) + accepted
        self.bm.truncate(seq, kept)                       # ...and the rejected ones forgotten
        self.bm.mark_computed(seq, kept)
        self.tokens[seq] = tokens[:kept]
        if accepted == 0 and not shared:
            assert self.bm.block_table(seq) == blocks_before and self.bm.num_free_blocks == free_before

    @rule(data=st.data())
    def fork(self, data):
        if not self.tokens:
            return
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @rule(data=st.data())
    def free(self, data):
        if not self.tokens:
            return
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        self.finished.append(self.tokens.pop(seq))

    def _copy(self, copies):
        for src, dst in copies:
            for offset in range(self.bs):
                if src * self.bs + offset in self.shadow:
                    self.shadow[dst * self.bs + offset] = self.shadow[src * self.bs + offset]

    @invariant()
    def reference_counts_equal_holders(self):
        holders = [0] * self.bm.num_blocks
        for seq in self.tokens:
            for block in self.bm.block_table(seq):
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
        for seq, tokens in self.tokens.items():
            assert self.bm.num_tokens(seq) == len(tokens)
            n = self.bm.num_computed_tokens(seq)
            for p, slot in enumerate(self.bm.slot_mapping(seq, 0, n)):
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
