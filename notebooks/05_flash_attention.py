# %% [markdown]
# # 05 · FlashAttention: online softmax, tiles, and why it is faster
#
# Lesson: `lessons/05-flash-attention.md`. Code: `minillm/attention/flash.py` (naive baseline, tiled
# PyTorch twin, differentiable `flash_attention`) and `kernels/flash_attention.py` (the Triton kernel).
#
# This notebook
# 1. works the online-softmax update by hand on four numbers,
# 2. checks the tiled twin and the Triton kernel against naive attention (GQA, causal offset, fp32/fp16/bf16),
# 3. measures memory: naive materialises N x N matrices, the tiled version does not,
# 4. counts HBM bytes the way the lesson does,
# 5. checks the backward pass (training works) and what autograd keeps for it,
# 6. on a GPU only: times naive, PyTorch SDPA and our kernel.
#
# On a CPU the Triton kernel runs under `TRITON_INTERPRET=1` (numpy, slow: correctness only).
# `MINILLM_QUICK=1` shrinks every size.

# %%
import os, sys, json
from pathlib import Path

import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must be set before the kernel module is imported
ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "minillm").is_dir())
sys.path.insert(0, str(ROOT))

import matplotlib.pyplot as plt
from minillm.course.calculators import hbm_bytes
from minillm.course.notebook import start
from minillm.perf.memory import peak_rss_growth, saved_for_backward_bytes
from minillm.attention.flash import flash_attention, flash_attention_torch, naive_attention_in_dtype, naive_attention_in_dtype_lse
from kernels.flash_attention import triton_flash_attention_forward

device, QUICK = start()                        # cuda when present; prints the machine

# %% [markdown]
# ## 1. Online softmax on four numbers
#
# One query row has scores `s = [2, 1, 3, 0]` against four keys whose values are (1-dimensional)
# `v = [10, 20, 30, 40]`. We see the keys in two tiles of two. Softmax seems to need the whole row
# (the denominator sums over all of it), but three running numbers are enough:
# `m` (the largest score so far), `l` (the sum of `exp(s - m)` so far) and `acc` (the sum of
# `exp(s - m) * v` so far). When a tile raises the maximum, everything summed so far was computed
# against the old maximum, so it is multiplied by `alpha = exp(m_old - m_new)`.

# %%
import math

scores, values = [2.0, 1.0, 3.0, 0.0], [10.0, 20.0, 30.0, 40.0]
m, l, acc = -math.inf, 0.0, 0.0
for tile in ([0, 1], [2, 3]):
    m_new = max(m, *(scores[i] for i in tile))
    alpha = math.exp(m - m_new)                      # exp(-inf) = 0 on the first tile
    p = [math.exp(scores[i] - m_new) for i in tile]
    l = l * alpha + sum(p)
    acc = acc * alpha + sum(pi * values[i] for pi, i in zip(p, tile))
    m = m_new
    print(f"tile {tile}: m={m:.0f}  alpha={alpha:.4f}  p={[round(x, 4) for x in p]}  l={l:.4f}  acc={acc:.4f}")
print(f"online : O = acc / l = {acc / l:.6f}   LSE = m + log(l) = {m + math.log(l):.6f}")

weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
print(f"direct : O = {float(weights @ torch.tensor(values, dtype=torch.float64)):.6f}   "
      f"LSE = {float(torch.logsumexp(torch.tensor(scores, dtype=torch.float64), 0)):.6f}")
print("softmax weights:", [round(float(w), 4) for w in weights])
from minillm.attention.flash import online_softmax_steps
print("same (m, l, acc) as flash_attention.online_softmax_steps:", online_softmax_steps(scores, values, 2)[-1] == (m, l, acc))

# %% [markdown]
# ![FlashAttention's tiles in HBM and SRAM, and the running max and sum of one row](../lessons/figures/flash_tiles.png)
#
# *Only one tile of keys and values visits the fast memory at a time; each query row carries its running max `m`, sum `l` and `acc` from tile to tile.*
#
# ### The same update on tensors: several rows, two tiles of keys
#
# Now every query row keeps its own `m`, `l` and `acc`, and the values are vectors. Written with torch
# primitives over two tiles of keys, the result must equal softmax over the whole row, and the output and
# log-sum-exp of `flash_attention_torch` run with the same tile size. Change the tile size or the scores'
# scale and re-run.

# %%
gen = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(n, 64, generator=gen) for n in (4, 32, 32))      # 4 query rows, 32 keys
tile = 16                                                               # two tiles of keys
m, l, acc = torch.full((4,), -math.inf), torch.zeros(4), torch.zeros(4, 64)
for K_t, V_t in zip(K.split(tile), V.split(tile)):
    s = Q @ K_t.T / math.sqrt(64)                                       # (4, tile): this tile's scores only
    m_new = torch.maximum(m, s.amax(1))
    alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
    l = l * alpha + p.sum(1)
    acc = acc * alpha[:, None] + p @ V_t
    m = m_new
O, lse = acc / l[:, None], m + torch.log(l)
lib_o, lib_lse = flash_attention_torch(Q[None, None], K[None, None], V[None, None], causal=False, block_m=tile, block_n=tile)
print(f"two tiles by hand vs softmax: max |diff| = {(O - torch.softmax(Q @ K.T / math.sqrt(64), -1) @ V).abs().max():.1e}")
print(f"two tiles by hand vs flash_attention_torch: max |diff| = {(O - lib_o[0, 0]).abs().max():.1e}")
print(f"two tiles by hand vs flash_attention_torch.lse: max |diff| = {(lse - lib_lse[0, 0]).abs().max():.1e}")

# %% [markdown]
# ## 2. The same update on tiles of a real attention problem
#
# `flash_attention_torch` applies exactly that update to (block_m x block_n) tiles of S = QK^T, with
# batch and heads as tensor dimensions; the Triton kernel runs one program per query tile and head.
# Below: 9 query heads sharing 3 KV heads (SmolLM2's layout), 40 new queries after a 90-token
# cached prefix (causal offset), head dim 64. Reference: naive attention in fp32.

# %%
gen = torch.Generator().manual_seed(0)
B, Hq, Hkv, Tq, Tk, D = 2, 9, 3, 40, 130, 64
q32 = torch.randn(B, Hq, Tq, D, generator=gen).to(device)
k32 = torch.randn(B, Hkv, Tk, D, generator=gen).to(device)
v32 = torch.randn(B, Hkv, Tk, D, generator=gen).to(device)

rows = []
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    q, k, v = (t.to(dtype) for t in (q32, k32, v32))
    ref_o, ref_lse = naive_attention_in_dtype_lse(q.float(), k.float(), v.float(), causal=True)
    naive_o = naive_attention_in_dtype(q, k, v, causal=True)
    tiled_o, tiled_lse = flash_attention_torch(q, k, v, causal=True, block_m=16, block_n=32)
    tri_o, tri_lse = triton_flash_attention_forward(q, k, v, causal=True)
    err = lambda a, b: (a.float() - b.float()).abs().max().item()
    rows.append((str(dtype)[6:], err(naive_o, ref_o), err(tiled_o, ref_o), err(tri_o, ref_o),
                 err(tiled_lse, ref_lse), err(tri_lse, ref_lse)))
print(f"{'dtype':9} {'naive':>9} {'tiled':>9} {'triton':>9} {'lse tiled':>10} {'lse triton':>10}   (max |x - fp32 naive|)")
for r in rows:
    print(f"{r[0]:9} " + " ".join(f"{x:9.2e}" for x in r[1:4]) + " " + " ".join(f"{x:10.2e}" for x in r[4:]))

# %% [markdown]
# In fp32 all three agree to ~1e-6 (rounding order only). In fp16/bf16 the tiled versions are *more*
# accurate than naive in the same dtype: they keep m, l and acc in fp32, while naive rounds S and P to
# the low precision. The tests hold every case to `max|out - ref| <= 2 * max|naive_same_dtype - ref| + 1e-5`.
#
# ## 3. Memory: the N x N matrix versus one tile
#
# Each point is one causal forward (1 head, D=64, fp32) in a fresh process; the peak is the resident-set
# high-water mark (reset through `/proc/self/clear_refs`) minus the resident set before the call.

# %%
sizes = [512, 1024] if QUICK else ([1024, 4096, 16384] if device == "cuda" else [1024, 2048, 4096])
live = []
for n in sizes:
    if device == "cuda":
        peaks = {}
        q, k, v = (torch.randn(1, 1, n, 64, device="cuda") for _ in range(3))
        for name, fn in (("naive", lambda: naive_attention_in_dtype(q, k, v)), ("tiled", lambda: triton_flash_attention_forward(q, k, v)[0])):
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
            fn(); torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:                                      # each call in a fresh process: see minillm/perf/memory.py
        calls = {"naive": "naive_attention_in_dtype(q, k, v, causal=True)",
                 "tiled": "flash_attention_torch(q, k, v, causal=True, block_m=256, block_n=256)"}
        peaks = {}
        for name, call in calls.items():
            setup = "\n".join(["import torch",
                               "from minillm.attention.flash import flash_attention_torch, naive_attention_in_dtype",
                               "q, k, v = (torch.randn(1, 1, 64, 64) for _ in range(3))", call,   # warm-up
                               f"q, k, v = (torch.randn(1, 1, {n}, 64) for _ in range(3))"])
            peaks[name] = peak_rss_growth(setup, call)["peak_bytes"] / 2**20
    live.append((n, peaks["naive"], peaks["tiled"]))
    print(f"N={n:6}  naive {peaks['naive']:8.2f} MiB   tiled {peaks['tiled']:6.2f} MiB   one N x N fp32 matrix {n*n*4/2**20:8.2f} MiB")

saved = ROOT / "results" / "flash-attention.json"
fig, ax = plt.subplots(figsize=(6, 4))
if saved.exists():
    doc = json.loads(saved.read_text())
    full = [r for r in doc["results"] if "naive_peak_mib" in r]
    ax.loglog([r["n"] for r in full], [r["naive_peak_mib"] for r in full], "o-", label="naive (results/flash-attention.json)")
    ax.loglog([r["n"] for r in full], [r["tiled_peak_mib"] for r in full], "s-", label="tiled (results/flash-attention.json)")
    print("committed run, N=8192: naive", round(doc["summary"]["naive_peak_mib_at_8192"], 1), "MiB, tiled",
          round(doc["summary"]["tiled_peak_mib_at_8192"], 2), "MiB, ratio", round(doc["summary"]["peak_mem_ratio_at_8192"], 1))
ax.loglog([r[0] for r in live], [r[1] for r in live], "x", ms=10, label=f"naive, this run ({device})")
ax.loglog([r[0] for r in live], [r[2] for r in live], "+", ms=10, label=f"tiled, this run ({device})")
ax.set(xlabel="sequence length N", ylabel="peak extra memory (MiB)", title="Causal attention forward, 1 head, D=64, fp32")
ax.legend(fontsize=8); plt.show()

# %% [markdown]
# Naive grows 4x[^quadratic] per doubling of N (it holds about 2.3 N x N fp32 matrices at its peak[^peak-matrices]: S, the
# boolean causal mask and the masked copy of S); the tiled version stays at a few MiB: the output, the LSE and one tile.
#
# [^quadratic]: counted by minillm.perf.roofline: 2 ** 2
# [^peak-matrices]: measured in results/flash-attention.json: summary.naive_peak_mib_at_8192 / (8192 ** 2 * 4 / 2 ** 20)
#
# ## 4. HBM bytes, counted
#
# Per (batch, head), fp16, N queries = N keys, D = 64, query tile 128 (the kernel's CUDA default).
# Naive is the article's three kernels: write S, read S, write P, read P. Flash reads Q once,
# writes O and the LSE once, and re-reads K and V once per query tile.

# %%
print(f"{'N':>6} {'S matrix MiB':>13} {'naive MiB':>10} {'flash MiB':>10} {'ratio':>6} {'flash causal':>13} {'ratio':>6}")
for n in (1024, 2048, 4096, 8192, 16384):
    full, causal = hbm_bytes(n, 64, causal=False), hbm_bytes(n, 64, causal=True)
    print(f"{n:6} {full['score_matrix_bytes']/2**20:13.0f} {full['naive_bytes']/2**20:10.1f} {full['flash_bytes']/2**20:10.1f} "
          f"{full['naive_bytes']/full['flash_bytes']:6.2f} {causal['flash_bytes']/2**20:13.1f} {causal['naive_bytes']/causal['flash_bytes']:6.2f}")

# %% [markdown]
# The N x N matrix at N = 8192 in fp16 is the article's 128 MB[^score-matrix]. Note what the count shows: flash
# traffic is *not* O(N): K and V are re-read once per query tile, N^2 * D / block_m elements. What
# vanished is the 4 N^2 term of S and P. The ratio approaches 2 * block_m / D = 4 for D = 64
# (about 8 when causal, since tiles above the diagonal are skipped); on a real GPU the L2 cache
# absorbs much of the K/V re-reading, so measured traffic is lower still.
#
# [^score-matrix]: counted by minillm.perf.roofline: 8192 ** 2 * 2 / 2 ** 20
#
# ## 5. Backward: training works
#
# The forward saves only q, k, v, o and the LSE (N floats per head). The backward rebuilds each tile of
# P = exp(S - LSE) from them. That is not checkpointing's trade of time for memory: the FlashAttention paper
# (arXiv 2205.14135, section 3.1 and Fig. 2) finds this backward *faster* than the standard one despite the extra
# FLOPs, because S, P, dP and dS never travel through HBM (lesson 05, section 4). Gradients against autograd through naive attention (fp32), and what
# each version keeps alive between forward and backward:

# %%
q, k, v = (t.clone().requires_grad_() for t in (q32[:1], k32[:1], v32[:1]))
do = torch.randn_like(q)
grads = torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)
ref = torch.autograd.grad(naive_attention_in_dtype(q, k, v, causal=True), (q, k, v), do)
for name, g, r in zip("qkv", grads, ref):
    print(f"d{name}: max |flash - autograd(naive)| = {(g - r).abs().max().item():.2e}")

n_saved = 1024 if QUICK else 4096
qkv = [torch.randn(1, 1, n_saved, 64, requires_grad=True) for _ in range(3)]
naive_b = saved_for_backward_bytes(lambda q, k, v: naive_attention_in_dtype(q, k, v, causal=True), *qkv)
flash_b = saved_for_backward_bytes(lambda q, k, v: flash_attention(q, k, v, causal=True, backend="torch"), *qkv)
print(f"N={n_saved}: autograd keeps {naive_b/2**20:.1f} MiB for naive (P is N x N) vs {flash_b/2**20:.2f} MiB for flash")

# %% [markdown]
# ## 6. On a GPU: speed
#
# TFLOP/s (4 * B * H * N^2 * D, halved when causal) of naive attention, PyTorch SDPA's flash backend
# and our Triton kernel, timed with CUDA events around each call after an L2 flush
# (`minillm/perf/kernel_timing.py`); from N = 4096 also the backward against SDPA's. On a CPU
# this section only reports what the committed JSON holds.

# %%
if device == "cuda":
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from minillm.attention.flash import time_triton_backward
    from minillm.perf.kernel_timing import time_kernel      # CUDA events, L2 flushed: the kernel, not the launch

    def sdpa(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    for n in ([1024] if QUICK else [1024, 4096, 16384]):
        b = max(1, 16384 // n)
        q, k, v = (torch.randn(b, 16, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * 16 * n * n * 64 * 0.5
        line = []
        for name, fn in (("naive", lambda: naive_attention_in_dtype(q, k, v, True)), ("sdpa", lambda: sdpa(q, k, v, True)),
                         ("triton", lambda: triton_flash_attention_forward(q, k, v, True))):
            line.append(f"{name} {flops / time_kernel(fn, samples=10, warmup=3)['median_s'] / 1e12:6.1f}")
        print(f"N={n:6} causal bf16 D=64 forward TFLOP/s: " + "  ".join(line))
        if n >= 4096:
            r = time_triton_backward(q, k, v, True, sdpa)
            print(f"         backward ms: sdpa flash {r['sdpa_flash_backward_ms']:.3f}  triton {r['triton_backward_ms']:.3f}"
                  f"  (triton at {r['backward_fraction_of_sdpa']:.2f}x of sdpa's speed)")
else:
    doc = json.loads(saved.read_text()) if saved.exists() else {"summary": {}}
    print("no CUDA device here; committed summary:", {k: v for k, v in doc["summary"].items() if k.startswith("gpu")})

# %% [markdown]
# ## Takeaways
#
# - Online softmax: keep (m, l, acc) per row, rescale by exp(m_old - m_new) whenever the max grows.
#   The result is exact, not an approximation (section 1, section 2).
# - Memory: naive needs ~2.3 N^2 floats at its peak[^peak-again]; the tiled version needs O(N D) plus one tile (section 3).
# - IO: S and P never touch HBM; the remaining traffic is K/V re-reads, N^2 D / block_m (section 4).
# - Training: the backward recomputes P tile by tile from the saved LSE (section 5); per the paper that makes it
#   faster than the standard backward, not slower, so it is not a memory-for-time trade.
#
# [^peak-again]: measured in results/flash-attention.json: summary.naive_peak_mib_at_8192 / (8192 ** 2 * 4 / 2 ** 20)
