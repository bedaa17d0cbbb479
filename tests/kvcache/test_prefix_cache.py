"""Prefix caching: chained block hashes, hits, the num_tokens - 1 cap, LRU eviction.

Named regressions (the bugs that dominate small engines' trackers):
- a prompt that is a 100% prefix hit still leaves a token to compute;
- a prefix hit after the sequence's blocks were freed and re-allocated to other content;
- a preempted (freed) sequence re-admitted with its generated tokens hits its own blocks,
  and its counters start from the hit, not from stale values.
The random-operation property test with prefix caching is in tests/kvcache/test_paged.py.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import CharTokenizer
from minillm import LLM, SamplingParams
from minillm.engine.request import Request
from minillm.kvcache.block_manager import BlockManager, OutOfBlocks
from minillm.kvcache.prefix_cache import ROOT_HASH, PrefixCache, chain_hashes, hash_block
from minillm.model.llama import random_model, tiny_config


def admit(bm, request_id, tokens):
    """Allocate a request as the scheduler does: its computed count starts at the prefix hit."""
    req = Request.from_token_ids(request_id, tokens)
    req.num_computed_tokens = bm.allocate(req)
    return req


def computed(bm, request_id, tokens):
    """Allocate a request and pretend the model computed all its tokens. -> its cached tokens."""
    req = admit(bm, request_id, tokens)
    cached = req.num_computed_tokens
    req.num_computed_tokens = req.num_tokens
    bm.cache_blocks(req)
    return cached


def allocate(bm, request_id, tokens):
    return admit(bm, request_id, tokens).num_computed_tokens


# --- hashing ----------------------------------------------------------------------------

def test_hash_chains_the_parent():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert chain_hashes(a + b, 4) == [hash_block(ROOT_HASH, a), hash_block(hash_block(ROOT_HASH, a), b)]
    assert chain_hashes(b + b, 4)[1] != chain_hashes(a + b, 4)[1]    # same block, other prefix
    assert chain_hashes(a + b + [9], 4) == chain_hashes(a + b, 4)     # partial blocks get no hash
    assert chain_hashes(a + b, 4, start=1, parent_hash=hash_block(ROOT_HASH, a)) == chain_hashes(a + b, 4)[1:]
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [2, 1])


def test_hash_is_the_same_in_every_process():
    """Python's hash() of str is salted per process; a prefix must keep its name across runs."""
    code = ("import importlib.util as u; s = u.spec_from_file_location('pc', 'minillm/kvcache/prefix_cache.py'); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.chain_hashes(list(range(40)), 16))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}, cwd=Path(__file__).parents[2]).stdout
            for seed in ("1", "2")}
    assert outs == {str(chain_hashes(list(range(40)), 16)) + "\n"}


def test_a_hit_confirms_the_tokens_not_only_the_hash():
    cache = PrefixCache()
    h = hash_block(ROOT_HASH, [1, 2])
    cache.register(block=5, block_hash=h, parent_hash=ROOT_HASH, token_ids=[9, 9])   # a "collision"
    assert cache.match([1, 2, 3], 2) == []
    cache2 = PrefixCache()
    cache2.register(block=5, block_hash=h, parent_hash=ROOT_HASH, token_ids=[1, 2])
    assert cache2.match([1, 2, 3], 2) == [5]


# --- hits -------------------------------------------------------------------------------

def test_shared_system_prompt_is_computed_once():
    bm = BlockManager(num_blocks=64, block_size=16, enable_prefix_caching=True)
    system = list(range(1000, 1000 + 64))                              # 4 full blocks
    assert computed(bm, "a", system + [1, 2, 3]) == 0
    assert computed(bm, "b", system + [4, 5]) == 64
    assert bm.block_table("a")[:4] == bm.block_table("b")[:4]
    assert bm.block_table("a")[4] != bm.block_table("b")[4]
    assert [bm.pool.ref_counts[x] for x in bm.block_table("a")[:4]] == [2] * 4


def test_different_prefix_same_block_does_not_hit():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    computed(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert computed(bm, "b", [9, 2, 3, 4, 5, 6, 7, 8, 0]) == 0         # block 1 equal, parent not
    assert computed(bm, "c", [1, 2, 3, 4, 9, 9, 9, 9, 0]) == 4         # stops at the first miss


def test_full_prefix_hit_still_computes_one_token():
    """Regression: a prompt that is entirely cached (here 2 full blocks) must leave at least one
    token to run, or there are no logits to sample the first output token from."""
    bm = BlockManager(num_blocks=16, block_size=16, enable_prefix_caching=True)
    tokens = list(range(32))
    computed(bm, "a", tokens)
    bm.free("a")
    b = admit(bm, "b", tokens)
    assert b.num_computed_tokens == 16 and b.num_computed_tokens <= len(tokens) - 1   # the hit is whole blocks
    assert allocate(bm, "c", tokens + [5]) == 32                       # one more token: 2 blocks hit
    assert allocate(bm, "d", tokens[:1]) == 0


def test_blocks_are_findable_only_once_computed():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(13))
    a = admit(bm, "a", tokens)                                         # not computed yet
    assert allocate(bm, "b", tokens) == 0
    a.num_computed_tokens = 6                                          # chunked prefill: 1.5 blocks
    bm.cache_blocks(a)
    assert allocate(bm, "c", tokens) == 4
    a.num_computed_tokens = 13
    bm.cache_blocks(a)
    assert allocate(bm, "d", tokens) == 12


def test_same_prompt_computed_twice_keeps_one_cached_copy():
    """Two requests admitted together both compute the prompt; the first registered block keeps
    the name, the duplicate goes back to the plain free list when freed."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(9))
    a, b = admit(bm, "a", tokens), admit(bm, "b", tokens)
    for req in (a, b):
        req.num_computed_tokens = 9
        bm.cache_blocks(req)
    assert bm.prefix_cache.num_cached == 2
    duplicates = bm.block_table("b")[:2]
    bm.free("b")
    assert all(not bm.prefix_cache.is_cached(x) for x in duplicates)
    assert set(duplicates) <= set(bm.pool.free_block_ids())
    assert allocate(bm, "c", tokens) == 8 and bm.block_table("c")[:2] == bm.block_table("a")[:2]


# --- finished sequences, eviction, preemption -------------------------------------------

def test_freed_blocks_stay_cached_and_are_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = list(range(12)) + [99]                                         # 3 full blocks + 1 token
    computed(bm, "a", a)
    a_blocks = bm.block_table("a")
    bm.free("a")
    assert bm.num_free_blocks == 6 and bm.prefix_cache.num_evictable == 3
    assert bm.pool.free_block_ids()[-1] == a_blocks[3]                 # the partial block: plain free
    computed(bm, "x", [7] * 16)                                        # 4 blocks: 3 plain free + 1 evicted
    assert a_blocks[2] in bm.block_table("x")                          # the tail of a's prefix went first
    assert bm.prefix_cache.num_evictable == 2
    bm.free("x")
    assert allocate(bm, "a2", a) == 8 and bm.block_table("a2")[:2] == a_blocks[:2]


def test_prefix_hit_after_blocks_were_freed_and_reallocated():
    """Regression: once a freed cached block is handed to another sequence and overwritten, its
    old hash must be gone; only the surviving head of the chain may hit, and it must be the
    right content."""
    bs = 4
    bm = BlockManager(num_blocks=5, block_size=bs, enable_prefix_caching=True)
    written = {}                                                       # slot -> token prefix there

    def run(request_id, tokens):
        req = admit(bm, request_id, tokens)
        cached = req.num_computed_tokens
        for p, slot in zip(range(cached, len(tokens)), bm.slot_mapping(request_id, cached, len(tokens))):
            written[slot] = tuple(tokens[:p + 1])
        req.num_computed_tokens = len(tokens)
        bm.cache_blocks(req)
        return cached

    a = list(range(16)) + [1]                                          # 4 full blocks + 1
    run("a", a)
    bm.free("a")
    run("b", [50] * 8 + [51])                                          # 3 blocks: 1 plain + 2 evicted
    bm.free("b")
    cached = run("a2", a)
    assert cached == 2 * bs                                            # the head survived, not the tail
    for p, slot in enumerate(bm.slot_mapping("a2", 0, len(a))):
        assert written[slot] == tuple(a[:p + 1])


def test_preempted_sequence_hits_its_own_blocks_with_fresh_counters():
    """Regression: preemption by recompute frees everything; re-admission with prompt + the
    tokens generated so far hits the blocks it had computed, and num_computed restarts there."""
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    r = admit(bm, "r", list(range(10)))
    r.num_computed_tokens = r.num_tokens
    bm.cache_blocks(r)
    for t in (70, 71, 72, 73):                                         # four decode steps
        r.output_token_ids.append(t)
        bm.append_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        bm.cache_blocks(r)
    bm.free("r")                                                       # preempted: its count
    r.num_computed_tokens = 0                                          # goes back to 0 (Scheduler._preempt)
    r.num_computed_tokens = bm.allocate(r)
    assert r.num_computed_tokens == 12                                 # (14 - 1) // 4 blocks
    assert bm.num_slots("r") == 14 and r.num_tokens == 14


def test_can_allocate_counts_evictable_hits_as_used():
    """Reviving a cached block with no holder takes it off the free count: admission must count
    it, or allocate would evict its own hits (or run out half-way)."""
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    a = list(range(8)) + [1]                                           # 2 full blocks + 1
    computed(bm, "a", a)
    bm.free("a")                                                       # free: 3 plain + 2 evictable
    allocate(bm, "y", [7] * 12)                                        # takes the 3 plain ones
    assert bm.num_free_blocks == 2
    a2 = Request.from_token_ids("a2", a)
    assert not bm.can_allocate(a2)                                     # 2 hits revived + 1 new > 2
    with pytest.raises(OutOfBlocks):
        bm.allocate(a2)
    assert bm.num_free_blocks == 2 and bm.prefix_cache.num_evictable == 2
    bm.free("y")
    assert bm.can_allocate(a2) and bm.allocate(a2) == 8


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_request_output_says_how_many_prompt_tokens_the_cache_served(index):
    """RequestOutput.num_cached_tokens (vLLM's field): whole blocks of an earlier prompt's prefix, 0 without caching."""
    from helpers import CharTokenizer
    from minillm import LLM, SamplingParams
    from minillm.model.llama import random_model, tiny_config

    model, params = random_model(tiny_config(), seed=0), SamplingParams(max_tokens=2, ignore_eos=True)
    shared = list(range(3, 3 + 40))                                 # 2 whole blocks of 16, and 8 tokens more
    for caching, expected in ((True, 32), (False, 0)):
        llm = LLM(model=model, tokenizer=CharTokenizer(), max_model_len=128, enable_prefix_caching=caching,
                  **({"prefix_cache": index} if caching else {}))
        first = llm.generate([{"prompt_token_ids": shared + [50]}], params, use_tqdm=False)[0]
        second = llm.generate([{"prompt_token_ids": shared + [60, 61]}], params, use_tqdm=False)[0]
        assert (first.num_cached_tokens, second.num_cached_tokens) == (0, expected), caching


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_reset_prefix_cache_forgets_every_prefix_and_frees_its_blocks(index):
    """vLLM's reset_prefix_cache: refused while a request holds blocks; afterwards nothing hits and every
    block is a plain free one."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, prefix_cache=index)
    tokens = list(range(1, 14))
    computed(bm, "a", tokens)
    assert not bm.reset_prefix_cache()                                  # "a" is still running
    bm.free("a")
    assert computed(bm, "b", tokens) == 12                              # cached: 3 full blocks hit
    bm.free("b")
    assert bm.reset_prefix_cache()
    assert computed(bm, "c", tokens) == 0 and bm.prefix_cache.num_evictable == 0
    bm.free("c")
    assert bm.num_free_blocks == 16


def test_llm_reset_prefix_cache_makes_the_next_request_compute_its_prompt():
    llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), device="cpu", max_model_len=256,
              enable_prefix_caching=True)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.reset_prefix_cache()
    after = llm.generate([prompt], params, use_tqdm=False)[0]
    assert (first.num_cached_tokens, after.num_cached_tokens) == (0, 0) and again.num_cached_tokens == 32
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == after.outputs[0].token_ids
