# %% [markdown]
# # 06 · Paged KV cache and prefix caching
#
# *Lesson: [lessons/06-paged-attention.md](../lessons/06-paged-attention.md).* Interview question:
# **vLLM 的 PagedAttention 解决什么问题？为什么传统 KV Cache 浪费严重？**
#
# Set `MINILLM_QUICK=1` for a fast CPU pass (CI does); unset it for the full run.

# %%
import time, math
import torch
import matplotlib.pyplot as plt
from minillm import LLM, SamplingParams
from minillm.stages.reference import stream_contiguous
from minillm.kvcache.block_manager import BlockManager
from minillm.engine.request import Request
from minillm.course.notebook import start
device, QUICK = start()                        # cuda when present; prints the machine

# %% [markdown]
# ## 1. Blocks, block tables, slots
#
# A request's logical positions map to physical blocks of 16 tokens through its block table, like pages of
# virtual memory. A block is handed out only when the previous one is full, so a request wastes at most 15 slots.
#
# On paper first, with blocks of 4 tokens and 8 physical blocks: a free list, and a plain dict from each
# request to its list of physical blocks. Position `p` of a request lives in its block `p // 4` at offset
# `p % 4`, i.e. in slot `block * 4 + offset` of the cache viewed as one long row of token slots. The
# library's `BlockManager` must give the same tables and slots for the same requests.

# %%
block_size, free = 4, list(range(8))                 # physical blocks, lowest first
tables = {}                                          # request -> its block table
def allocate_by_hand(seq, num_tokens):
    tables[seq] = [free.pop(0) for _ in range(-(-num_tokens // block_size))]   # ceil: whole blocks only
def slot_by_hand(seq, position):
    return tables[seq][position // block_size] * block_size + position % block_size

allocate_by_hand("a", 10)                            # 10 tokens -> 3 blocks, the last one half full
allocate_by_hand("b", 5)                             # 5 tokens  -> 2 blocks
print("by hand: a ->", tables["a"], " b ->", tables["b"], " free:", free)
bm = BlockManager(num_blocks=8, block_size=4)
bm.allocate(Request.from_token_ids("a", list(range(10))))
bm.allocate(Request.from_token_ids("b", list(range(50, 55))))
print("same block tables:", [bm.block_table(s) for s in "ab"] == [tables[s] for s in "ab"],
      "| same slots:", bm.slot_mapping("a", 0, 10) == [slot_by_hand("a", p) for p in range(10)])

# %% [markdown]
# ![Block tables of three sequences: a shared prefix with reference counts, then copy-on-write](../lessons/figures/block_table.png)
#
# *Two block tables may point at the same physical block; the first writer into a shared block gets its own copy (copy-on-write), as the next cell does with `fork`.*

# %%
bm = BlockManager(num_blocks=8, block_size=4)
a = Request.from_token_ids("a", list(range(10)))   # the Request holds the tokens; the block
bm.allocate(a)                                     # manager reads them: 10 tokens -> 3 blocks
bm.allocate(Request.from_token_ids("b", list(range(50, 55))))   # 5 tokens -> 2 blocks
print("a:", bm.block_table("a"), " b:", bm.block_table("b"), " free:", bm.num_free_blocks)
print("slots of a's tokens 0..9:", bm.slot_mapping("a", 0, 10))
a.num_computed_tokens = 10                         # a's prompt ran
a2 = Request.from_token_ids("a2", a.all_token_ids) # a second sample of the same prompt
a2.num_computed_tokens = 10
bm.fork("a", "a2")                                 # parallel sampling: share every block
print("a2 shares a's blocks:", bm.block_table("a2"))
a2.output_token_ids.append(99)                     # a2 samples a token...
copies = bm.append_slots(a2, a2.num_tokens)        # ...and writes it into the shared last block
print("copy-on-write (src, dst):", copies, " a2 now:", bm.block_table("a2"))
for s in ("a", "a2", "b"):
    bm.free(s)
print("after freeing everything, free blocks:", bm.num_free_blocks)

# %% [markdown]
# ## 2. How much reserved KV memory holds real tokens?
#
# The simulation (`minillm/stages/kv_allocation.py`) serves a long-tailed request trace from a fixed KV budget
# under four policies (the vLLM paper's baselines). Contiguous reservation wastes what a request never fills;
# paging wastes at most a partial block.

# %%
from minillm.stages.kv_allocation import ContiguousPolicy, PagedPolicy, make_workload, simulate
reqs = make_workload(300 if QUICK else 2000, 2048)
budget = 16384 if QUICK else 32768
rows = {}
for name, policy in {"contiguous-max": ContiguousPolicy("max", budget, 2048),
                     "contiguous-pow2": ContiguousPolicy("pow2", budget, 2048),
                     "contiguous-oracle": ContiguousPolicy("oracle", budget, 2048),
                     "paged": PagedPolicy(budget, 16)}.items():
    sim = simulate(policy, make_workload(len(reqs), 2048))
    rows[name] = sim
    print(f"{name:18s} KV utilisation {sim['kv_utilization']:6.1%}   mean running sequences {sim['mean_running']:6.1f}")
plt.figure(figsize=(6, 3)); plt.bar(list(rows), [100 * r["kv_utilization"] for r in rows.values()])
plt.ylabel("% of allocated KV holding tokens"); plt.xticks(rotation=15); plt.tight_layout(); plt.show()

# %% [markdown]
# ## 3. The model on the paged cache: the same tokens
#
# `LLM.generate` runs on the engine (lesson 07), whose model runner stores K/V through the slot mapping and
# attends through block tables. Greedy tokens must equal the contiguous single-sequence path.

# %%
llm = LLM(model="smollm2", dtype="float32", device=device)
tok = llm.get_tokenizer()
prompt = {"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": "Explain virtual memory in two sentences."}]))}
params = SamplingParams(temperature=0, max_tokens=16 if QUICK else 64, ignore_eos=True)
paged = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
(req,) = llm.make_requests([prompt], params)
for _ in stream_contiguous(llm, req):     # alone on the contiguous cache (minillm/stages/reference.py)
    pass
print("identical tokens:", paged.token_ids == req.output_token_ids)
print(paged.text)

# %% [markdown]
# ## 4. Prefix caching: a shared system prompt is computed once
#
# Full blocks are named by a chained hash of their tokens. A later request walks its chain and reuses every
# block it finds, so only its own tail is prefilled. TTFT at batch 1 is the prefill, so on a CPU it drops with it.
# On a GPU this small model's prefill is only part of TTFT: the prompt below is a few hundred GFLOP, a few
# milliseconds in fp32 at the matmul rate notebook 01 measured on the H200, while the rest is every layer's
# kernels launched one by one from Python, with the cache or without it. The outputs below, from an H200, show
# no drop beyond the noise; a larger model or a longer shared prefix is where the cache pays on a GPU (not
# measured here).

# %%
from minillm.evaluate import evaluation_text
system_len = 256 if QUICK else 1024
cached = LLM(model=llm.model, tokenizer=tok, device=device, enable_prefix_caching=True)
system = tok.encode(evaluation_text())[:system_len]
one = SamplingParams(temperature=0, max_tokens=1)
rows = []
for i in range(3 if QUICK else 6):
    p = {"prompt_token_ids": system + tok.encode(f"Question {i}: summarise the passage in {i + 3} words.")}
    row = []
    for engine_llm in (llm, cached):
        (r,) = engine_llm.make_requests([p], one)
        engine_llm.engine.run([r])
        row.append((r.metrics.time_to_first_token, r.num_cached_tokens))
    rows.append(row)
    print(f"request {i}: TTFT no cache {row[0][0]*1e3:7.1f} ms | prefix cache {row[1][0]*1e3:7.1f} ms "
          f"({row[1][1]} of {len(p['prompt_token_ids'])} prompt tokens cached)")
