# %% [markdown]
# # 10 · Classroom labs: self-check
#
# *Handouts: [lessons/labs/](../lessons/labs/). Teacher's guide: [lessons/labs/README.md](../lessons/labs/README.md).*
#
# Each lab hands you this repository with one technique cut out: the functions keep their signature
# and docstring, and their body raises `NotImplementedError` with a hint. You write the missing code;
# the cells below run the lab's tests against **this** copy of the repository and print a score per
# task. The same grader runs from a shell:
#
# ```bash
# python -m minillm lab list                 # the labs, their time estimates and tasks
# python -m minillm lab grade kv_cache       # grade the current folder on one lab
# ```
#
# On the reference repository every lab passes all of its tasks; on a fresh student copy its own lab passes none
# (`tests/course/test_labs.py` checks both).
# With `MINILLM_QUICK=1` each cell checks only one task of its lab (a fast smoke run); unset it for
# the full grade. Cells grade in this kernel's process: after editing a file, restart the kernel.

# %%
import os, sys
from pathlib import Path
REPO = Path.cwd().parent if (Path.cwd().parent / "minillm").is_dir() else Path.cwd()
sys.path.insert(0, str(REPO))                          # grade THIS copy, whatever is installed
import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # the Triton lab runs under the interpreter on CPU
from minillm.course import labs
from minillm.course.notebook import start
device, QUICK = start()                          # prints the machine; the labs pick their own device
print("grading", labs.REPO, "| mode:", "quick (MINILLM_QUICK=1): one task per lab" if QUICK else "full: every task")
print(labs.format_lab_list())

# %% [markdown]
# ## 01 · kv_cache: store K and V once, read them every step
#
# Write `KVCache.write` and the cache parts of `forward_cached` in `minillm/stages/kv_cache.py`
# ([handout](../lessons/labs/01-kv_cache.md)).

# %%
result = labs.self_check("kv_cache", quick=QUICK)

# %% [markdown]
# ## 02 · gqa: grouped-query attention without copying K/V
#
# Write `grouped_attention` and `mean_pool_kv_heads` in `minillm/attention/gqa.py`
# ([handout](../lessons/labs/02-gqa.md)).

# %%
result = labs.self_check("gqa", quick=QUICK)

# %% [markdown]
# ## 03 · nf4_rtn: packing, round-to-nearest groups, NF4
#
# Write the packing, the RTN quantiser and NF4's blockwise quantiser in `minillm/quant/int4.py` and
# `minillm/quant/nf4.py` ([handout](../lessons/labs/03-nf4_rtn.md)).

# %%
result = labs.self_check("nf4_rtn", quick=QUICK)

# %% [markdown]
# ## 04 · gptq: quantise column by column
#
# Write the Hessian, its inverse factor and GPTQ's column loop in `minillm/quant/gptq.py`
# ([handout](../lessons/labs/04-gptq.md)).

# %%
result = labs.self_check("gptq", quick=QUICK)

# %% [markdown]
# ## 05 · online_softmax: FlashAttention in PyTorch
#
# Write the tiled online softmax of `flash_attention_torch` in `minillm/attention/flash.py`
# ([handout](../lessons/labs/05-online_softmax.md)).

# %%
result = labs.self_check("online_softmax", quick=QUICK)

# %% [markdown]
# ## 06 · flash_triton: the Triton kernel's inner loop
#
# Write the online-softmax update of `_attn_fwd_tiles` and the epilogue of `_attn_fwd` in
# `kernels/flash_attention.py` ([handout](../lessons/labs/06-flash_triton.md)). On a CPU laptop the
# kernel runs under `TRITON_INTERPRET=1` (set in the first cell, before the kernel is imported).

# %%
result = labs.self_check("flash_triton", quick=QUICK)

# %% [markdown]
# ## 07 · paged_blocks: the block pool and prefix caching
#
# Write `BlockPool.allocate / acquire / release` in `minillm/kvcache/block_manager.py` and `hash_block`,
# `chain_hashes`, `PrefixCache.match`, `PrefixCache.evict` in `minillm/kvcache/prefix_cache.py`
# ([handout](../lessons/labs/07-paged_blocks.md)).

# %%
result = labs.self_check("paged_blocks", quick=QUICK)

# %% [markdown]
# ## 08 · scheduler: one step of continuous batching
#
# Write `Scheduler.schedule` and `Scheduler._preempt` in `minillm/engine/scheduler.py`
# ([handout](../lessons/labs/08-scheduler.md)).

# %%
result = labs.self_check("scheduler", quick=QUICK)

# %% [markdown]
# ## 09 · rejection_sampler: speculative decoding's acceptance rule
#
# Write `greedy_verify` and `rejection_sample` in `minillm/speculative/core.py`
# ([handout](../lessons/labs/09-rejection_sampler.md)).

# %%
result = labs.self_check("rejection_sampler", quick=QUICK)

# %% [markdown]
# ## 10 · row_parallel: tensor parallelism's all-reduce
#
# Write `row_parallel` in `minillm/parallel/tensor.py`
# ([handout](../lessons/labs/10-row_parallel.md)).

# %%
result = labs.self_check("row_parallel", quick=QUICK)

# %% [markdown]
# ## 11 · token_mask: structured outputs' token mask
#
# Write `allowed_tokens` in `minillm/guided/token_automaton.py`
# ([handout](../lessons/labs/11-token_mask.md)).

# %%
result = labs.self_check("token_mask", quick=QUICK)

# %% [markdown]
# ## Handing it in
#
# A student hands in the whole folder. The teacher grades every copy in one command, each in its own
# process, with the reference's tests (editing the tests in a copy changes nothing):
#
# ```bash
# python -m minillm lab grade kv_cache --submissions submissions/ --csv kv_cache-scores.csv
# ```
