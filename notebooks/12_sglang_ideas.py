# %% [markdown]
# # 12 · SGLang's two ideas: a radix-tree prefix cache and structured outputs
#
# *Lesson: [lessons/12-sglang-ideas.md](../lessons/12-sglang-ideas.md).* Interview question:
# **那 SGLang、TGI 跟 vLLM 比怎么样？** SGLang's answer rests on two ideas, both built here from scratch:
# RadixAttention (a radix tree over cached tokens) and a compressed state machine for structured output
# (JSON, regex, tool calls) with jump-forward decoding.
#
# Set `MINILLM_QUICK=1` for a fast CPU pass (CI does); unset it for the full run.

# %%
import time
import torch
from minillm import LLM, SamplingParams
from minillm.course.notebook import start
device, QUICK = start()                        # cuda when present; prints the machine
llm = LLM(model="smollm2", dtype="float32", device=device, max_model_len=1024)

# %% [markdown]
# ## 1. A radix tree over token ids, by hand
#
# A prefix cache answers one question at admission: which leading tokens of this prompt already have their K/V
# in the pool? A trie over token ids answers it by walking down from the root. A radix tree is a trie whose
# chains without branches are merged into one node. On paper first, with blocks of 4 tokens: each node keeps
# a run of whole blocks; a match walks one block at a time; a match that ends inside a node splits it.

# %%
B = 4
def walk(tree, ids):
    '''tree: {first block (tuple): [run of tokens, children]} -> cached tokens of ids, whole blocks only'''
    pos, node = 0, tree
    while pos + B <= len(ids) - 1:                       # leave one token to run: it yields the logits
        child = node.get(tuple(ids[pos:pos + B]))
        if child is None:
            break
        run, children = child
        n = 0
        while n < len(run) and pos + n + B <= len(ids) - 1 and run[n:n + B] == ids[pos + n:pos + n + B]:
            n += B
        pos += n
        if n < len(run):
            break
        node = children
    return pos

def insert(tree, ids):
    '''add the whole blocks of ids (split nodes where they diverge)'''
    pos, node = 0, tree
    full = len(ids) // B * B
    while pos < full:
        key = tuple(ids[pos:pos + B])
        if key not in node:
            node[key] = [list(ids[pos:full]), {}]
            return
        run, children = node[key]
        n = 0
        while n < len(run) and pos + n < full and run[n:n + B] == ids[pos + n:pos + n + B]:
            n += B
        if n < len(run):                                 # split: the node keeps the head, a child the tail
            node[key] = [run[:n], {tuple(run[n:n + B]): [run[n:], children]}]
            run, children = node[key]
        pos, node = pos + n, children

system = list(range(100, 109))                           # 9 tokens: two whole blocks and one more
turn1 = system + [1, 2, 3, 4, 5, 6]
turn2 = turn1 + [7, 8, 9, 10, 11]
other = system + [50, 51, 52, 53, 54]
tree, by_hand = {}, {}
for name, ids in (("turn 1", turn1), ("turn 2", turn2), ("other chat", other)):
    by_hand[name] = walk(tree, ids)
    insert(tree, ids)
print("cached tokens by hand:", by_hand)

# %%
from minillm.kvcache.block_manager import BlockManager
from minillm.engine.request import Request
library = {}
for kind in ("radix", "hash"):
    bm = BlockManager(32, B, enable_prefix_caching=True, prefix_cache=kind)
    hits = {}
    for name, ids in (("turn 1", turn1), ("turn 2", turn2), ("other chat", other)):
        req = Request.from_token_ids(name, ids)
        hits[name] = bm.allocate(req)
        req.num_computed_tokens = req.num_tokens  # prefilled: its full blocks become findable
        bm.cache_blocks(req)
        bm.free(name)
    library[kind] = hits
print("radix tree (library):", library["radix"])
print("hash chain (library):", library["hash"])
print("same hits as by hand:", library["radix"] == by_hand == library["hash"])

# %% [markdown]
# ![The tree after four requests (block manager with prefix_cache="radix"); hash vs radix peak KV blocks, measured](../lessons/figures/radix_tree.png)
#
# Both indexes find the same hits in whole blocks: the 9th system-prompt token sits in a block that also holds
# the turn's first tokens, so every request computes it again. What differs is what each keeps when requests
# that share a prefix run *at the same time*.
#
# ## 2. Hash vs radix vs no cache through the engine
#
# Two waves of concurrent requests through the engine (SmolLM2, greedy), with caching off, the hash index and the
# tree. `system prompt`: one long shared prompt, then a question each. `branches`: one document, then a tool step
# each, and in the second wave each branch grows by a step. Each output says how many of its prompt tokens the
# cache served (`RequestOutput.num_cached_tokens`); the engine's step log says how many KV blocks were held at the
# peak. (`python -m minillm bench prefix` runs these and two more workloads at full size.)

# %%
import statistics
from minillm.evaluate import evaluation_text
tok, text = llm.get_tokenizer(), evaluation_text()
document = tok.encode(text)[:256 if QUICK else 384]
questions = [tok.encode(f"\nQuestion {i}: summarise the passage above in {i + 3} words.\nAnswer:") for i in range(8)]
steps = [tok.encode(f"\nStep {k}: call tool number {k} on the document and report.\n") for k in range(5)]
workloads = {"system prompt": [[document + q for q in questions[:4]], [document + q for q in questions[4:]]],
             "branches": [[document + steps[k] for k in range(4)], [document + steps[k] + steps[k + 1] for k in range(4)]]}
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
for workload in ("system prompt",) if QUICK else workloads:
    outputs = {}
    for mode in ("none", "hash", "radix"):
        run_llm = LLM(model=llm.model, tokenizer=tok, device=device, max_model_len=1024, num_kv_blocks=512,
                      enable_prefix_caching=mode != "none", **({"prefix_cache": mode} if mode != "none" else {}))
        done = [o for wave in workloads[workload]
                for o in run_llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)]
        held = run_llm.engine.block_manager.num_blocks - min(s["free_blocks"] for s in run_llm.engine.step_log)
        prompt, served = sum(len(o.prompt_token_ids) for o in done), sum(o.num_cached_tokens for o in done)
        ttft = statistics.median(o.metrics.time_to_first_token for o in done)
        print(f"{workload:>13} {mode:>5}: prompt {prompt:5d}  served by the cache {served:5d} ({served / prompt:5.1%})  "
              f"peak blocks {held:4d}  TTFT p50 {ttft:.3f} s")
        outputs[mode] = [o.outputs[0].token_ids for o in done]
    print(workload, "identical tokens with none / hash / radix:", outputs["none"] == outputs["hash"] == outputs["radix"])

# %% [markdown]
# ## 3. From a regex to a mask over the vocabulary, by hand
#
# The grammar is a DFA over UTF-8 bytes (`minillm/guided/regex.py`); the model emits tokens, each a byte string.
# In a state, a token is allowed iff walking its bytes never reaches the dead state. First by hand, one token at a
# time in plain Python, then the library's vectorised walk (`minillm/guided/token_automaton.py`).

# %%
from minillm import GuidedDecodingParams
from minillm.guided import compile_guide, compile_regex
from minillm.guided.token_automaton import vocabulary_bytes
tok, V = llm.get_tokenizer(), llm.config.vocab_size
token_bytes = vocabulary_bytes(tok, V)                       # token id -> its bytes (b"" for special tokens)
choice = ["yes", "no", "maybe not"]
dfa = compile_regex("(?:yes|no|maybe not)")
print("DFA states:", dfa.num_states, "| matches 'maybe not':", dfa.matches("maybe not"), "| 'maybe':", dfa.matches("maybe"))

def allowed_by_hand(state):
    ok = []
    for t, data in enumerate(token_bytes):
        s = state
        for b in data:
            s = dfa.transitions[s][b]
            if s == dfa.dead:
                break
        if data and s != dfa.dead:
            ok.append(t)
    return ok

by_hand = allowed_by_hand(dfa.start)
guide = compile_guide(GuidedDecodingParams(choice=choice), tok, V)
mask = guide.automaton.mask(guide.automaton.start)            # bool (V,), EOS included where accepting
library = [t for t in mask.nonzero().flatten().tolist() if t != tok.eos_token_id]
print(f"allowed at the start: {len(by_hand)} tokens, e.g. {[tok.decode([t]) for t in by_hand[:8]]}")
print("same allowed tokens as the library:", by_hand == library)

# %% [markdown]
# ## 4. Why JSON needs a stack: a grammar, its pushdown automaton and the mask cache
#
# A regex cannot check that every `[` is closed. A grammar can: each rule is a DFA over bytes with one column per rule
# it calls (`minillm/guided/grammar.py`), and the parser keeps a stack of calls (`minillm/guided/pushdown.py`). Below, a
# recursive grammar, a document 50 levels deep, and the frame cache: per (rule, state) the tokens are accepted, rejected
# or uncertain; only the uncertain ones are walked on the real stack.

# %%
from minillm.guided import Grammar, PushdownAutomaton
from minillm.guided.token_automaton import TokenVocabulary
nested = 'root ::= "[" (item (", " item)*)? "]"\nitem ::= [0-9]+ | root'
grammar = Grammar(nested)
print("rules kept as calls:", [r.name for r in grammar.rules], "| DFA states:", [r.dfa.num_states for r in grammar.rules])
pda = PushdownAutomaton(grammar, TokenVocabulary(token_bytes, tok.eos_token_id))
def walk(text):
    config = pda.start
    for b in text.encode():
        config = pda.step(config, b)
    return config
deep = "[" * 50 + "7" + "]" * 50
print("50 levels deep accepted:", pda.is_accepting(walk(deep)), "| one ] too many rejected:", walk(deep + "]") == pda.dead)
inside = walk("[[1, [2")
stack = sorted(pda.configs[inside][1])[0]
allowed_here = pda.mask(inside)
accepted, uncertain, _ = pda.frame_mask(stack)
by_walking = [t for t, b in enumerate(token_bytes) if b and pda.next_state(inside, t) != pda.dead]
print(f"in '[[1, [2': frame accepts {int(accepted.sum())} tokens, {len(uncertain)} uncertain (walked on the stack), "
      f"mask allows {int(allowed_here.sum())}")
print("same allowed tokens as walking each token:", allowed_here.nonzero().flatten().tolist() == by_walking)
print("e.g. uncertain:", [tok.decode([t]) for t in uncertain[:8]])

# %% [markdown]
# A JSON schema becomes such a grammar (`minillm/guided/json_schema.py`), ranges and formats included:

# %%
from minillm.guided import schema_to_grammar
print(schema_to_grammar({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 130}},
                         "required": ["age"], "additionalProperties": False}))

# %% [markdown]
# ## 5. Guided generation with SmolLM2: a JSON schema, validated
#
# Every output must parse and validate against its schema. With `jump_forward=True` the fixed text the schema
# forces (keys, separators) is appended without a model step.

# %%
import json
import jsonschema
schema = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 24},
    "customer_age_in_years": {"type": "integer"},
    "customer_is_subscribed": {"type": "boolean"}},
    "required": ["customer_full_name", "customer_age_in_years", "customer_is_subscribed"]}
prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a customer as JSON."}], add_generation_prompt=True)
results = {}
for jump in (False, True):
    params = SamplingParams(temperature=0, max_tokens=96, guided_decoding=GuidedDecodingParams(json=schema, jump_forward=jump))
    (req,) = llm.make_requests([prompt], params)
    t0 = time.perf_counter()
    llm.engine.run([req])
    seconds = time.perf_counter() - t0
    doc = json.loads(req.text)
    jsonschema.validate(doc, schema)
    results[jump] = (req.text, len(req.output_token_ids), req.guide.num_forced_tokens, seconds)
    print(f"jump_forward={jump!s:5}: {req.text}")
    print(f"   {len(req.output_token_ids)} tokens, {req.guide.num_forced_tokens} appended without sampling, {seconds:.2f} s; valid: True")

# %% [markdown]
# ## What to take away
#
# - At the same block size a hash chain and a radix tree find the same prefix hits; this tree (like SGLang's) keeps
#   one copy of a prefix that concurrent requests computed side by side, which is memory (and so concurrency) under
#   load. That is how it is implemented, not a property of the index: a hash index could share duplicates too.
# - Structured output is an automaton over bytes lifted to tokens: a DFA for a regex, a pushdown automaton for a
#   grammar (JSON nests). On this CPU the per-step cost is a cached mask and building the masks of a new schema is what
#   costs (a walk of the vocabulary per grammar frame). On a GPU a decode step takes milliseconds and a mask over a
#   128K vocabulary can take as long, which is why xgrammar overlaps the mask with the GPU's forward (lesson 12). Jump-forward turns the text a schema fixes into prefill-like chunks.
