# %% [markdown]
# # 01 · Where the time goes: is LLM inference compute-bound or memory-bound?
#
# *Lesson: [lessons/01-where-time-goes.md](../lessons/01-where-time-goes.md).*
# The article's first interview question: **LLM 推理的瓶颈到底是计算还是显存？** We answer it with
# measurements of a real model (SmolLM2-135M-Instruct) on whatever machine runs this notebook.
#
# Set `MINILLM_QUICK=1` to shrink the measurements (CI does); unset it for the full run.

# %%
import time
import torch
import matplotlib.pyplot as plt
from minillm.perf import roofline
from minillm.loading.loader import load_model
from minillm.stages.kv_cache import generate_greedy_naive
from minillm.stages.fast_decode import generate_greedy_fast, weights_only_step
from minillm.perf.timing import time_median
from minillm.course.notebook import start

device, QUICK = start()                        # cuda when present; prints the machine

# %% [markdown]
# ## 1. How many bytes does one token cost?
#
# At batch 1, decode multiplies every weight matrix by one vector: each weight is read once and used
# for one multiply-add (2 FLOPs). In fp32 that is 2 FLOPs per 4 bytes, **0.5 FLOP/byte**[^fp32-ai].
#
# [^fp32-ai]: counted by minillm.perf.roofline: 2 / 4
#
# Count it by hand first, from the loaded model: one multiply-add per weight, plus attention's two
# dot products per cached key and head; bytes are every weight once plus the cached K and V. Edit
# `context` or the dtype's bytes and see the intensity move. The last line checks the count against
# `minillm.perf.roofline`, which the rest of the notebook uses.

# %%
model, tok = load_model("smollm2", dtype="float32", device=device)
cfg = model.cfg
context, bytes_per_value = 16, 4                 # tokens already in the KV cache; fp32
weights = sum(p.numel() for p in model.parameters())   # the tied LM head is the embedding: stored once
flops = 2 * weights                              # one multiply-add per weight for the one new token
flops += cfg.n_layers * cfg.n_heads * 2 * (2 * cfg.head_dim * context)   # q.k with each cached key, then p.v
nbytes = weights * bytes_per_value               # every weight read once
nbytes += context * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * bytes_per_value   # cached K and V
print(f"by hand: {flops / 1e6:.1f} MFLOP and {nbytes / 1e6:.1f} MB per token = {flops / nbytes:.3f} FLOP/byte")
print("hand count == roofline:", flops == roofline.decode_flops_per_token(cfg, context)
      and nbytes == roofline.decode_bytes_per_step(cfg, bytes_per_value, context))

# %% [markdown]
# ![The roofline of this CPU and three GPUs, and the batch at which decode turns compute-bound](../lessons/figures/roofline.png)
#
# *Decode at batch 1 sits far left of every ridge point: bandwidth, not arithmetic, sets its speed (`python -m minillm figures` redraws this).*

# %%
n = cfg.num_parameters()
for name, b in [("float32", 4), ("bfloat16", 2), ("int8", 1), ("int4", 0.5)]:
    print(f"{name:9s} weights: {roofline.weight_bytes(cfg, b)/1e6:7.1f} MB   "
          f"KV per token: {roofline.kv_bytes_per_token(cfg, b)/1024:5.1f} KiB")
print(f"parameters: {n/1e6:.1f} M; decode FLOPs per token (context 16): {roofline.decode_flops_per_token(cfg, 16)/1e6:.0f} MFLOP")

# %% [markdown]
# ## 2. What can this machine do?
#
# Two numbers describe a processor for this purpose: how fast it streams memory (measured with a large
# matrix-vector product, exactly decode's access pattern) and how fast it multiplies matrices (a large GEMM,
# prefill's pattern). Their ratio is the **ridge point**: below that many FLOPs per byte, a kernel waits for memory.

# %%
reps = 3 if QUICK else 7
gpu = device == "cuda"                           # a GPU gets sizes that fill it: 2 GB copies, 8192^3 matmuls
bw = roofline.measure_bandwidth(128 if QUICK else (2048 if gpu else 512), repeats=reps, device=device)
fl = roofline.measure_flops(512 if QUICK else (8192 if gpu else 2048), repeats=reps, device=device)
print(f"GEMV bandwidth: {bw/1e9:.1f} GB/s   GEMM: {fl/1e9:.0f} GFLOP/s   ridge: {fl/bw:.1f} FLOP/byte")
for name, g in roofline.GPUS.items():
    print(f"{name:10s} {g['flops']/1e12:5.0f} TFLOP/s  {g['bandwidth']/1e12:4.2f} TB/s  ridge {g['flops']/g['bandwidth']:5.0f} FLOP/byte")

# %% [markdown]
# ## 3. The roofline: decode sits far left of the ridge, prefill far right
#
# Attainable FLOP/s = min(peak, bandwidth × intensity). Decode at batch 1 does ~0.5 FLOP per fp32 byte[^fp32-ai-again];
# a 512-token prefill reuses each weight 512 times.
#
# [^fp32-ai-again]: counted by minillm.perf.roofline: 2 / 4

# %%
import numpy as np
x = np.logspace(-1, 3, 200)
plt.figure(figsize=(6, 3.5))
plt.loglog(x, np.minimum(fl, bw * x) / 1e9, label="this machine (measured)")
points = {"decode, batch 1": roofline.arithmetic_intensity(cfg, 4, 1, 16),
          "decode, batch 16": roofline.arithmetic_intensity(cfg, 4, 16, 16),
          "prefill, 512 tokens": roofline.arithmetic_intensity(cfg, 4, 512, 0)}
for label, ai in points.items():
    plt.scatter([ai], [min(fl, bw * ai) / 1e9]); plt.annotate(label, (ai, min(fl, bw * ai) / 1e9 * 0.6))
plt.axvline(fl / bw, ls=":", c="gray"); plt.xlabel("FLOP per byte"); plt.ylabel("attainable GFLOP/s")
plt.title("SmolLM2-135M fp32 on this machine"); plt.tight_layout(); plt.show()

# %% [markdown]
# ## 4. Measured decode speed against the bound
#
# The bound is bandwidth / weight bytes. We time three things side by side (median of repeats, after warm-up):
# the naive baseline (recomputes the whole sequence every token), the KV-cached runner, and a loop that does
# *only* the weight GEMVs of one token (the floor the hardware actually allows).

# %%
prompt, new = list(range(100, 116)), (8 if QUICK else 64)
t_naive = time_median(lambda: generate_greedy_naive(model, prompt, new), repeats=1 if QUICK else 3, device=device)
t_cached = time_median(lambda: generate_greedy_fast(model, prompt, new), repeats=2 if QUICK else 5, device=device)
t_floor = time_median(lambda: weights_only_step(model), repeats=5 if QUICK else 20, device=device) if device == "cpu" else float("nan")
bound = bw / roofline.weight_bytes(cfg, 4)
speeds = {"bandwidth bound": bound, "weights-only GEMVs": 1 / t_floor,
          "KV cache + fast path": new / t_cached, "naive (no cache)": new / t_naive}
for k, v in speeds.items():
    print(f"{k:20s} {v:7.1f} tok/s  ({v/bound:5.1%} of the bound)")
plt.figure(figsize=(6, 2.8)); plt.barh(list(speeds), list(speeds.values())); plt.xlabel("tokens/s (batch 1, fp32)")
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 5. What is the gap made of?
#
# Profile one cached decode step: the matrix multiplies (`aten::addmm` / `aten::mm` / `aten::linear`) are the
# weight traffic; everything else (RoPE, norms, softmax, the cache writes, Python between ops) is overhead
# that a fused implementation removes.

# %%
from torch.profiler import profile, ProfilerActivity
from minillm.stages.kv_cache import KVCache, forward_cached
cache = KVCache(cfg, 1, 64, device=device)
forward_cached(model, torch.tensor([prompt], device=device), cache)
step = torch.tensor([[prompt[-1]]], device=device)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3):
        forward_cached(model, step, cache)
        cache.truncate(cache.lengths - 1)   # roll back: every profiled step sees the same context
rows = prof.key_averages()
total = sum(r.self_cpu_time_total for r in rows)
mm = sum(r.self_cpu_time_total for r in rows if r.key in ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul"))
print(f"matrix multiplies: {mm/total:.0%} of CPU op time; the other {1-mm/total:.0%} is overhead")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))

# %% [markdown]
# ## 6. Why a faster GPU is not a faster decoder
#
# From A100 to H100 the FLOP/s grow 3.17x and the bandwidth 1.64x[^h100-a100]. What an H100 does add for decode is FP8:
# one-byte weights halve the bytes, so Llama-3-8B's bound on an H100 goes from 223.2 to 446.4 tok/s[^fp8]; lesson 01's
# interview card has the rest.
#
# Decode tokens/s at batch 1 is bounded by bandwidth / bytes. For a 7B model in fp16 (14 GB[^7b]):
#
# [^7b]: counted by minillm.perf.roofline: 7e9 * 2 / 1e9
# [^h100-a100]: counted by minillm.perf.roofline: GPUS["H100 SXM"]["flops"] / GPUS["A100 80GB"]["flops"]; GPUS["H100 SXM"]["bandwidth"] / GPUS["A100 80GB"]["bandwidth"]
# [^fp8]: counted by minillm.perf.roofline: 1 / decode_step_seconds(LLAMA3_8B, "H100 SXM", 2); 1 / decode_step_seconds(LLAMA3_8B, "H100 SXM", 1)

# %%
base = roofline.GPUS["A100 80GB"]
for name, g in roofline.GPUS.items():
    print(f"{name:10s} FLOP/s x{g['flops']/base['flops']:.1f}  bandwidth x{g['bandwidth']/base['bandwidth']:.2f}  "
          f"-> 7B fp16 decode bound {g['bandwidth']/14e9:5.0f} tok/s")
