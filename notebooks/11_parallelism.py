# %% [markdown]
# # 11 · Tensor and pipeline parallelism: one model, several processes
#
# *Lesson: [lessons/11-parallelism.md](../lessons/11-parallelism.md).* Interview question: **TP or PP inside a node?
# Across nodes? Why?**
#
# Everything here runs on a CPU: the "GPUs" are processes talking over gloo, torch.distributed's CPU backend
# (NCCL would be the CUDA one). They share this machine's cores, so we look at what is computed and what is sent,
# not at speed.

# %%
import os
import torch
import torch.nn.functional as F
from minillm import LLM, SamplingParams
from minillm.model.llama import tiny_config
from minillm.parallel.calculator import table, tp_bytes_per_token
from minillm.parallel.checks import shard_vs_full
from minillm.parallel.launch import launch
from minillm.parallel.pipeline import gpipe_schedule
from minillm.course.calculators import bubble_fraction
from minillm.course.notebook import start
from minillm.perf.roofline import LLAMA3_70B
# the ranks are CPU processes talking over gloo, on any machine: one GPU cannot host three ranks
device, QUICK = start("cpu")

# %% [markdown]
# ## 1. The two ways to split a matrix, by hand
#
# A linear layer computes `y = x W^T` with `W` of shape (out, in). Split `W` over N ranks in two ways:
#
# - **column-parallel** (by output features, rows of `W`): rank r computes `x W_r^T`, its own slice of `y`,
#   from the whole `x`. No communication; the slices side by side are `y`.
# - **row-parallel** (by input features, columns of `W`): rank r holds only the slice `x_r` of the input
#   and computes `x_r W_r^T`, a *partial sum* of the whole `y`. Adding the N partial sums (an all-reduce) gives `y`.
#
# A SwiGLU FFN uses both in a row: gate and up column-parallel (each rank gets its slice of the hidden
# features, exactly the input slice the row-parallel down projection needs), then down row-parallel:
# one all-reduce per FFN. Attention does the same with heads: q, k, v column-parallel, o_proj row-parallel.
#
# ![the FFN split over 3 ranks by shard_model; a GPipe schedule](../lessons/figures/parallelism.png)

# %%
torch.manual_seed(0)
N, d, f = 3, 12, 18
x = torch.randn(5, d)                                    # (tokens, d)
w_up, w_down = torch.randn(f, d), torch.randn(d, f)      # (f, d), (d, f)
h = F.silu(x @ w_up.T)                                   # (tokens, f): the FFN's hidden features, unsplit
y = h @ w_down.T                                         # (tokens, d)
rows = torch.arange(f).chunk(N)                          # rank r owns hidden features rows[r]
h_r = [F.silu(x @ w_up[r].T) for r in rows]              # column-parallel: (tokens, f/N) each, no communication
partial = [h_r[i] @ w_down[:, r].T for i, r in enumerate(rows)]   # row-parallel: (tokens, d) partial sums
print(f"column slices side by side == unsplit hidden: {torch.allclose(torch.cat(h_r, -1), h, atol=1e-5)}")
print(f"sum of partial products == x W^T: {torch.allclose(sum(partial), y, atol=1e-5)}")

# %% [markdown]
# ## 2. The same with processes: minillm.parallel on 3 ranks
#
# `shard_model` applies this split to every layer of a Llama (heads, KV heads, FFN, and the vocabulary of the
# embedding and LM head), and `RowParallelLinear` does the sum with a real all-reduce. `launch` runs a function on 3
# fresh processes in one gloo group; each compares its shard's logits with the unsplit model's.

# %%
cfg = tiny_config(n_heads=6, n_kv_heads=3, vocab_size=250, n_layers=3)
tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))   # (B, T)
ranks = launch(shard_vs_full, 3, cfg, tokens)
for r, out in enumerate(ranks):
    print(f"rank {r}: {out['kv_heads_here']} of {cfg.n_kv_heads} KV heads, ffn {out['ffn_here']} of {cfg.ffn_dim}, "
          f"max |difference| = {out['max_abs_diff']:.1e}")

# %% [markdown]
# ## 3. What tensor parallelism sends
#
# Per layer: one all-reduce after o_proj, one after down, each of (tokens, dim). Plus one for the
# vocabulary-parallel embedding and an all-gather of the logits. Counted by `minillm.parallel.comm` on rank 0:

# %%
counts = ranks[0]["counts"]
n_tokens = tokens.numel()
formula = (2 * cfg.n_layers + 1) * n_tokens * cfg.dim * 4                # fp32
print(f"all-reduces: {counts['all_reduce.calls']} (2 x {cfg.n_layers} layers + 1)")
print(f"bytes all-reduced: counted {counts['all_reduce.bytes']}, formula {formula}, "
      f"counted == formula: {counts['all_reduce.bytes'] == formula}")
print(f"Llama-3-70B in bf16: {tp_bytes_per_token(LLAMA3_70B, 2) / 1024:.0f} KiB all-reduced per token by its 80 layers")

# %% [markdown]
# ## 4. Pipeline parallelism and its bubble
#
# Pipeline parallelism gives each rank whole layers: rank 0 the first third, and so on, sending one
# (tokens, dim) activation to the next rank. One batch keeps one stage busy at a time; GPipe cuts it into m
# micro-batches. With unit-time stages, micro-batch j reaches stage s at slot s + j, the pass lasts m + p - 1
# slots and each stage works m of them. Counting the idle slots by hand:

# %%
for p, m in [(3, 1), (3, 4), (4, 12)]:
    slots = gpipe_schedule(p, m)
    span = max(t for _, _, t in slots) + 1
    idle = 1 - len(slots) / (p * span)
    print(f"p={p} m={m}: {span} slots, idle share {idle:.3f}, (p-1)/(m+p-1) = {bubble_fraction(p, m):.3f}, "
          f"same: {abs(idle - bubble_fraction(p, m)) < 1e-12}")

# %% [markdown]
# Measured on processes by `python -m minillm bench parallel` (the cell reads its committed result, it does not
# rerun it): each stage's busy time against the wall time of the pass. Small micro-batches on a shared CPU add
# overhead the formula does not have.

# %%
import json
from pathlib import Path
doc = json.loads(Path("../results/parallel.json").read_text())
print(doc["machine"]["cpu"], f"({doc['machine']['threads']} threads)")
for row in (r for r in doc["results"] if r["part"] == "bubble"):
    print(f"p={row['stages']} m={row['micro_batches']}: idle share measured {row['idle_share_measured']:.2f}, "
          f"formula {row['idle_share_formula']:.2f}")

# %% [markdown]
# ## 5. The engine on top: `LLM(..., tensor_parallel_size=3)`
#
# The driver (this process) schedules; every step it broadcasts the batch to two worker processes it started,
# and all three run the same step on their shards. Greedy tokens must equal one process's.

# %%
prompts = ["The three primary colours are", "def fibonacci(n):"]
params = SamplingParams(temperature=0, max_tokens=6 if QUICK else 16, ignore_eos=True)
one = [o.outputs[0].token_ids for o in LLM(model="smollm2", device=device).generate(prompts, params, use_tqdm=False)]
with LLM(model="smollm2", device=device, tensor_parallel_size=3) as tp:
    three = [o.outputs[0].token_ids for o in tp.generate(prompts, params, use_tqdm=False)]
    workers = [p.pid for p in tp.parallel.processes]
print(f"tensor_parallel_size=3 vs one process, same tokens: {one == three}")
print(f"worker processes still alive after close: {[p for p in workers if os.path.exists(f'/proc/{p}')]}")

# %% [markdown]
# ## 6. On real hardware: Llama-3-70B on 8 H200s
#
# The calculator splits lesson 01's roofline N ways and adds the communication (published link bandwidths:
# NVLink 4 inside a node, InfiniBand NDR between nodes). TP divides one token's time; PP does not (a token
# still passes every stage). With several batches in flight it multiplies throughput relative to a pipeline
# with one batch in flight, not relative to one GPU holding the whole model: per GPU it does the same work.

# %%
for r in table(LLAMA3_70B, "H200", (1, 2, 4, 8), batch=64, context=4096):
    print(f"{r['mode']} x{r['gpus']} over {r['link']:15s} per step: weights {r['weights_s']*1e3:6.2f} ms, "
          f"comm {r['comm_s']*1e3:5.2f} ms, latency {r['token_latency_s']*1e3:6.2f} ms, {r['tokens_per_s']:7.0f} tok/s, "
          f"fits: {r['fits']}")
