"""The radix-tree prefix cache (minillm/kvcache/radix_cache.py): match, split, insert, LRU leaf eviction,
the block manager on top of it, and the engine with prefix_cache="radix".

The random-operation property test over the tree is in tests/kvcache/test_paged.py
(TestRadixBlockManagerProperties). Engine workloads: greedy tokens with the radix tree equal
those with caching off and with the hash index, on multi-turn chat, few-shot prompts and
branches from one long context; the hits are the ones the shared prefixes allow.
"""
import pytest

from helpers import CharTokenizer, random_prompts
from minillm import LLM, SamplingParams
from minillm.__main__ import build_parser, main
from minillm.engine.request import Request
from minillm.kvcache.block_manager import BlockManager, OutOfBlocks
from minillm.kvcache.radix_cache import RadixCache
from minillm.model.llama import random_model, tiny_config

MODES = {"none": {}, "hash": dict(enable_prefix_caching=True),
         "radix": dict(enable_prefix_caching=True, prefix_cache="radix")}


def shape(node):
    """The tree below node as {blocks: {...}}."""
    return {tuple(child.blocks): shape(child) for child in node.children.values()}


def computed(bm, request_id, tokens):
    """Allocate a request and pretend the model computed all its tokens. -> its cached tokens."""
    req = Request.from_token_ids(request_id, tokens)
    cached = bm.allocate(req)
    req.num_computed_tokens = req.num_tokens
    bm.cache_blocks(req)
    return cached


def allocated_together(bm, prompts):
    """Requests admitted in the same step (nothing computed yet), then all computed. -> their cached tokens."""
    reqs = [Request.from_token_ids(request_id, tokens) for request_id, tokens in prompts.items()]
    cached = [bm.allocate(req) for req in reqs]
    for req in reqs:
        req.num_computed_tokens = req.num_tokens
        bm.cache_blocks(req)
    return cached


# --- the tree on its own --------------------------------------------------------------------

def test_match_is_whole_blocks_and_leaves_the_last_token_to_run():
    tree = RadixCache()
    assert tree.insert(list(range(12)), [10, 11, 12], 4) == ([], None)
    assert tree.match(list(range(12)) + [5], 4) == [10, 11, 12]
    assert tree.match(list(range(12)), 4) == [10, 11]                 # a full hit keeps 1 token to run
    assert tree.match([0, 1, 2, 3, 4, 5, 99, 99, 99], 4) == [10]      # 6 tokens shared: 1 whole block
    assert tree.match([9, 1, 2, 3, 4], 4) == []
    assert tree.num_cached == 3 and tree.num_evictable == 0           # inserted blocks are held


def test_a_match_ending_inside_a_node_splits_it():
    tree = RadixCache()
    tree.insert(list(range(12)), [10, 11, 12], 4)
    assert shape(tree.root) == {(10, 11, 12): {}}
    assert tree.match(list(range(8)) + [99], 4) == [10, 11]
    assert shape(tree.root) == {(10, 11): {(12,): {}}}
    tail = tree.root.children[(0, 1, 2, 3)].children[(8, 9, 10, 11)]
    assert tail.tokens == (8, 9, 10, 11) and tail.parent.tokens == tuple(range(8))
    assert tree.match(list(range(12)) + [5], 4) == [10, 11, 12]       # the split lost nothing


def test_a_branch_hangs_under_the_split_and_duplicates_are_swapped_for_the_tree_copy():
    tree = RadixCache()
    tree.insert(list(range(12)), [10, 11, 12], 4)
    branch = list(range(8)) + [50, 51, 52, 53]
    swaps, _ = tree.insert(branch, [20, 21, 22], 4)                   # computed the trunk again
    assert swaps == [(0, 10), (1, 11)]                                # use the tree's trunk instead
    assert shape(tree.root) == {(10, 11): {(12,): {}, (22,): {}}}
    assert tree.match(branch + [0], 4) == [10, 11, 22]
    assert not tree.is_cached(20) and tree.num_cached == 4


# --- through the block manager ----------------------------------------------------------

def test_same_prompt_computed_together_keeps_one_copy():
    """Two requests admitted in the same step both compute a prompt. The hash index keeps the
    second copy held until that request ends; the tree swaps it out at once."""
    tokens = list(range(9))
    held_blocks = {}
    for kind in ("hash", "radix"):
        bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, prefix_cache=kind)
        allocated_together(bm, {"a": tokens, "b": tokens})
        assert bm.prefix_cache.num_cached == 2
        held_blocks[kind] = 16 - bm.num_free_blocks
        if kind == "radix":
            assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
            assert [bm.pool.ref_counts[x] for x in bm.block_table("a")[:2]] == [2, 2]
    assert held_blocks == {"hash": 6, "radix": 4}


def test_lru_evicts_the_oldest_leaf_tail_first_and_the_trunk_last():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, prefix_cache="radix")
    trunk = list(range(8))                                            # 2 blocks
    computed(bm, "a", trunk + [20, 21, 22, 23, 0])
    assert computed(bm, "b", trunk + [30, 31, 32, 33, 34, 35, 36, 37, 0]) == 8
    t0, t1, a2 = bm.block_table("a")[:3]
    b2, b3 = bm.block_table("b")[2:4]
    bm.free("a")                                                      # a's leaf first, then b's
    bm.free("b")
    assert shape(bm.prefix_cache.root) == {(t0, t1): {(a2,): {}, (b2, b3): {}}}
    assert bm.num_free_blocks == 8 and bm.prefix_cache.num_evictable == 5
    never_cached = [bm.pool.allocate() for _ in range(3)]
    assert not set(never_cached) & {t0, t1, a2, b2, b3}
    evicted = [bm.pool.allocate() for _ in range(5)]
    assert evicted == [a2, b3, b2, t1, t0]                            # the inner trunk only after its leaves
    assert shape(bm.prefix_cache.root) == {} and bm.prefix_cache.num_cached == 0


def test_a_held_block_is_never_evicted():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True, prefix_cache="radix")
    computed(bm, "a", list(range(8)) + [0])                           # 2 cached blocks, held by a
    computed(bm, "old", [40, 41, 42, 43, 0])                          # 1 cached block
    bm.free("old")
    assert bm.num_free_blocks == 3 and bm.prefix_cache.num_evictable == 1
    computed(bm, "x", [90] * 12)                                      # 2 plain blocks + old's evicted
    y = Request.from_token_ids("y", [91])
    assert bm.num_free_blocks == 0 and not bm.can_allocate(y)
    with pytest.raises(OutOfBlocks):                                  # a's cached blocks are not taken
        bm.allocate(y)
    assert bm.cached_prefix_tokens(Request.from_token_ids("z", list(range(8)) + [1])) == 8


def test_the_tree_keeps_a_shared_trunk_the_hash_chain_loses():
    """Two requests admitted together share a 2-block trunk. With the hash index the second
    request hangs its blocks under a trunk it does not hold; the first one ends and releases
    the trunk early, so eviction takes the trunk's tail and leaves the second request's block
    cached but unreachable. The tree swapped the duplicate trunk out, evicts leaves first, and
    still serves the whole trunk."""
    hits = {}
    for kind in ("hash", "radix"):
        bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True, prefix_cache=kind)
        trunk = list(range(8))
        allocated_together(bm, {"a": trunk + [20, 21, 22, 23, 0], "b": trunk + [30, 31, 32, 33, 0]})
        b_leaf = bm.block_table("b")[2]
        bm.free("a")
        bm.free("b")
        assert bm.num_free_blocks == 10 and bm.prefix_cache.num_evictable == 4
        computed(bm, "x", [90] * 32)                                  # 6 plain free blocks + 2 evicted
        hits[kind] = bm.cached_prefix_tokens(Request.from_token_ids("c", trunk + [40, 41, 42, 43, 0]))
        if kind == "hash":
            assert bm.prefix_cache.is_cached(b_leaf)                  # still cached ...
            b_again = Request.from_token_ids("b2", trunk + [30, 31, 32, 33, 0])
            assert bm.cached_prefix_tokens(b_again) == 4              # ... but unreachable
    assert hits == {"hash": 4, "radix": 8}


# --- arguments ------------------------------------------------------------------------------

def test_bad_prefix_cache_values_are_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="'hash', 'radix'"):
        BlockManager(8, 4, enable_prefix_caching=True, prefix_cache="trie")
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        BlockManager(8, 4, prefix_cache="radix")                      # refused, not ignored
    assert BlockManager(8, 4).prefix_cache is None                    # the default "hash" is fine off
    model = random_model(tiny_config(), seed=0)
    with pytest.raises(ValueError, match="'hash', 'radix'"):
        LLM(model=model, tokenizer=CharTokenizer(), device="cpu", enable_prefix_caching=True, prefix_cache="Radix")
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        LLM(model=model, tokenizer=CharTokenizer(), device="cpu", prefix_cache="radix")


def test_serve_takes_the_prefix_cache_flag(monkeypatch, capsys):
    assert build_parser().parse_args(["serve"]).prefix_cache == "hash"
    made = {}
    monkeypatch.setattr("minillm.LLM", lambda **kwargs: made.update(kwargs))
    monkeypatch.setattr("minillm.serving.server.serve", lambda llm, **kwargs: None)
    assert main(["serve", "--enable-prefix-caching", "--prefix-cache", "radix"]) == 0
    assert made["prefix_cache"] == "radix" and made["enable_prefix_caching"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefix-cache", "trie"])
    assert "invalid choice: 'trie'" in capsys.readouterr().err


# --- through the engine: a tiny random model --------------------------------------------------

def tiny_llm(mode, **kwargs):
    model = random_model(tiny_config(), seed=0)
    return LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=256, block_size=4,
               num_kv_blocks=256, **MODES[mode], **kwargs)


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_one_at_a_time(llm, prompts, max_tokens):
    """Each prompt admitted after the previous one finished: (prompt ids, outputs, cached tokens)
    per request; a prompt may be a function of the earlier outputs (a chat's next turn)."""
    ids, outputs, cached = [], [], []
    for prompt in prompts:
        ids.append(prompt(outputs) if callable(prompt) else prompt)
        (req,) = llm.make_requests([{"prompt_token_ids": ids[-1]}], greedy(max_tokens))
        llm.engine.run([req])
        outputs.append(req.output_token_ids)
        cached.append(req.num_cached_tokens)
    return ids, outputs, cached


def expected_hits(prompts, outputs, block_size):
    """What a prefix cache with room for everything serves each request: the whole blocks of its
    longest common prefix with an earlier request's computed tokens (all but its last output
    token, which was sampled, never run), at most n - 1 tokens."""
    hits = []
    for j, prompt in enumerate(prompts):
        shared = max((_common_prefix(prompt, p + out[:-1]) for p, out in zip(prompts[:j], outputs)), default=0)
        hits.append(min(shared // block_size, (len(prompt) - 1) // block_size) * block_size)
    return hits


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def multi_turn(vocab, turns=4, seed=0):
    """Each turn: the whole conversation so far (earlier prompts and answers) and a new message."""
    system, *messages = random_prompts([21] + [7 + 3 * t for t in range(turns)], vocab, seed)

    def turn(t):
        def prompt(outputs):
            ids = list(system)
            for k in range(t):
                ids += messages[k] + outputs[k]
            return ids + messages[t]
        return prompt
    return [turn(t) for t in range(turns)]


def few_shot(vocab, seed=1):
    """An instruction, three examples in different orders, a question."""
    instruction, *rest = random_prompts([18, 9, 11, 6, 5, 5, 5, 5], vocab, seed)
    examples, questions = rest[:3], rest[3:]
    orders = [(0, 1, 2), (0, 1, 2), (1, 0, 2), (0, 2, 1), (2, 1, 0)]
    return [instruction + sum((examples[i] for i in order), []) + questions[q % 4]
            for q, order in enumerate(orders)]


def branches(vocab, seed=2):
    """One long context, then several continuations of it (an agent's tools, a tree of thought)."""
    context, *tails = random_prompts([70, 3, 8, 1, 13, 5], vocab, seed)
    return [context + [3 + k] + tail for k, tail in enumerate(tails)]   # first tokens differ


WORKLOADS = {"multi_turn": multi_turn, "few_shot": few_shot, "branches": branches}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_radix_equals_no_cache_and_hash_and_hits_where_expected(workload):
    runs = {}
    for mode in MODES:
        llm = tiny_llm(mode)
        prompts = WORKLOADS[workload](llm.config.vocab_size)
        runs[mode] = run_one_at_a_time(llm, prompts, max_tokens=6)
    prompts, outputs, cached = runs["radix"]
    assert outputs == runs["none"][1] == runs["hash"][1]
    assert cached == runs["hash"][2] == expected_hits(prompts, outputs, block_size=4)
    assert all(cached[1:]) and runs["none"][2] == [0] * len(prompts)


@pytest.mark.parametrize("max_num_batched_tokens", [40, 2048])
def test_requests_admitted_together_share_one_copy_of_their_prefix(max_num_batched_tokens):
    """All branches arrive at once (in chunks of 40 tokens: a later one hits what an earlier one
    computed, and both compute the next block in the same step): outputs equal no caching. With
    one step for all prompts every request computes the context; the tree drops the duplicate
    copies as soon as they are computed, so fewer blocks stay held. A second wave hits the whole
    context either way."""
    peak, outputs, hits = {}, {}, {}
    for mode in MODES:
        llm = tiny_llm(mode, max_num_batched_tokens=max_num_batched_tokens)
        wave = branches(llm.config.vocab_size)
        result = llm.generate([{"prompt_token_ids": p} for p in wave], greedy(5), use_tqdm=False)
        peak[mode] = llm.engine.block_manager.num_blocks - min(s["free_blocks"] for s in llm.engine.step_log)
        second = [{"prompt_token_ids": p[:70] + [99, 98]} for p in wave[:2]]
        reqs = llm.make_requests(second, greedy(5))
        llm.engine.run(reqs)
        outputs[mode] = [o.outputs[0].token_ids for o in result] + [r.output_token_ids for r in reqs]
        hits[mode] = [r.num_cached_tokens for r in reqs]
    assert outputs["radix"] == outputs["none"] == outputs["hash"]
    assert peak["radix"] < peak["hash"] if max_num_batched_tokens == 2048 else peak["radix"] <= peak["hash"]
    assert hits == {"none": [0, 0], "hash": [68, 68], "radix": [68, 68]}


# --- through the engine: SmolLM2 ----------------------------------------------------------

def smollm2_workload(tokenizer, workload):
    encode = tokenizer.encode
    system = encode("You are a careful assistant. Answer in one short sentence, and say when you are unsure.")
    if workload == "multi_turn":
        messages = [encode(f"\nUser: {q}\nAssistant:") for q in
                    ("What is a KV cache?", "Why does it grow?", "How does paging help?")]

        def turn(t):
            return lambda outs: system + sum((messages[k] + outs[k] for k in range(t)), []) + messages[t]
        return [turn(t) for t in range(len(messages))]
    if workload == "few_shot":
        shots = [encode(f"\nQ: {a} + {b}\nA: {a + b}") for a, b in ((2, 3), (10, 7), (41, 1))]
        return [system + sum((shots[i] for i in order), []) + encode(f"\nQ: {q} + 4\nA:")
                for q, order in zip((5, 6, 7), ((0, 1, 2), (0, 1, 2), (2, 0, 1)))]
    context = system + encode("\nDocument: paged attention stores keys and values in fixed-size blocks, "
                              "shares the blocks of a common prefix and copies a block on write.")
    return [context + encode(f"\nQuestion {k}: {q}") for k, q in
            enumerate(("What is stored?", "What is shared?", "When is a block copied?"))]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_smollm2_radix_equals_no_cache_and_hash(llm, workload):
    runs = {}
    for mode in MODES:
        cached_llm = LLM(model=llm.model, tokenizer=llm.get_tokenizer(), device="cpu", max_model_len=512,
                         num_kv_blocks=64, **MODES[mode])
        prompts = smollm2_workload(llm.get_tokenizer(), workload)
        runs[mode] = run_one_at_a_time(cached_llm, prompts, max_tokens=3)
    prompts, outputs, cached = runs["radix"]
    assert outputs == runs["none"][1] == runs["hash"][1]
    assert cached == runs["hash"][2] == expected_hits(prompts, outputs, block_size=16)
    assert all(c >= 16 for c in cached[1:])                         # the system prompt, at least
