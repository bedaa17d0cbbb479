# %% [markdown]
# # 02 · KV cache, prefill vs decode, fast batch-1 decode
#
# *Lesson: [lessons/02-kv-cache.md](../lessons/02-kv-cache.md).* Interview questions:
# **Prefill 和 Decode 两个阶段的 trade-off 各是什么？** and **KV Cache 显存怎么算？**
#
# Run with `MINILLM_QUICK=1` for a fast CPU pass; unset for the full measurements.

# %%
import time
import torch
import matplotlib.pyplot as plt
from minillm.loading.loader import load_model
from minillm.stages.kv_cache import (KVCache, forward_cached, generate_greedy, generate_greedy_naive, prefill_decode,
                                     step_latency)
from minillm.course.calculators import kv_cache_bytes
from minillm.perf.timing import time_median
from minillm.course.notebook import start
device, QUICK = start()                        # cuda when present; prints the machine
model, tok = load_model("smollm2", dtype="float32", device=device)

# %% [markdown]
# ## 1. Same tokens, less work
#
# Step *t* of decoding needs the keys and values of all earlier tokens. They never change, so we keep
# them: the baseline recomputes them every step, the cached path computes only the new token's.
#
# A KV cache in a few lines, from the model's own layers: a dict from layer to its (K, V), each new
# token's K and V appended with `torch.cat`. The prefill fills it with the whole prompt; each decode step
# runs one token whose query attends to everything stored. Its greedy tokens must be those of
# `minillm.stages.kv_cache.generate_greedy`, the preallocated cache the library uses.

# %%
from minillm.model.llama import naive_attention_fp32
from minillm.model.positions import rope_cos_sin

@torch.no_grad()
def forward_with_dict_cache(model, tokens, cache):
    # tokens (1, T) continue the sequence; cache {layer: (K, V)}, each (1, Hkv, S, D), grows by T
    start = cache[0][0].shape[2] if cache else 0
    cos, sin = rope_cos_sin(torch.arange(start, start + tokens.shape[1], device=tokens.device),
                            model.cfg.head_dim, model.cfg.rope_theta)
    h = model.embed(tokens)                                              # (1, T, dim)
    for i, layer in enumerate(model.layers):
        q, k, v = layer.attn.project_qkv(layer.attn_norm(h), cos, sin)  # only the new tokens' K, V
        if i in cache:
            k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
        cache[i] = (k, v)
        out = naive_attention_fp32(q, k, v)                             # new queries see every stored key
        h = h + layer.attn.wo(out.transpose(1, 2).flatten(2))
        h = h + layer.ffn(layer.ffn_norm(h))
    return model.logits(h)[:, -1]                                       # (1, vocab): the last position

def greedy_with_dict_cache(model, prompt, n):
    cache, out = {}, []
    logits = forward_with_dict_cache(model, torch.tensor([prompt], device=device), cache)   # prefill
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = forward_with_dict_cache(model, torch.tensor([[out[-1]]], device=device), cache)  # decode
    return out, cache

prompt = tok.encode("The three laws of robotics are")
mine, cache = greedy_with_dict_cache(model, prompt, 8)
print("layer 0 K after prefill + 8 steps:", tuple(cache[0][0].shape), "(batch, KV heads, positions, head dim)")
print("dict cache vs kv_cache.generate_greedy, identical:", mine == generate_greedy(model, [prompt], 8)[0])

# %% [markdown]
# ![KV cache memory against length and batch; FLOPs per token with and without a cache](../lessons/figures/kv_growth.png)
#
# *The cache grows linearly with length and batch, while recomputing without it costs a forward over the whole sequence for every token.*

# %%
n = 16 if QUICK else 64
naive = generate_greedy_naive(model, prompt, n)
cached = generate_greedy(model, [prompt], n)[0]
print("identical:", naive == cached)
print(tok.decode(cached))

# %% [markdown]
# ## 2. Cost of one token against its position: quadratic vs flat
#
# Without a cache the token at position *p* costs a forward pass over *p + 1* tokens; with it, one token
# attending to *p* stored keys.
#
# On a GPU the same comparison starts out much closer: a short recompute reads the weights once, exactly as a decode
# step does, so it stays memory-bound until the position passes the ridge point (hundreds of tokens). The roofline gives
# Llama-3-8B on an H100 a 1.00x gain from the cache at 256 new tokens and 6.75x at 4,096[^gpu-gen] (lesson 02's interview
# card); what this cell prints is the machine that runs it.
#
# [^gpu-gen]: counted by minillm.perf.roofline: generation_seconds(LLAMA3_8B, "H100 SXM", 2, 16, 256, use_cache=False) / generation_seconds(LLAMA3_8B, "H100 SXM", 2, 16, 256); generation_seconds(LLAMA3_8B, "H100 SXM", 2, 16, 4096, use_cache=False) / generation_seconds(LLAMA3_8B, "H100 SXM", 2, 16, 4096)

# %%
positions = [16, 64] if QUICK else ([32, 128, 512, 2048, 4096] if device == "cuda" else [32, 128, 256, 512, 1024])
no_cache = [1e3 * step_latency(model, p, cached=False) for p in positions]
cache = [1e3 * step_latency(model, p, cached=True) for p in positions]
for p, a, b in zip(positions, no_cache, cache):
    print(f"position {p:5d}: no cache {a:8.1f} ms   cache {b:6.1f} ms   x{a/b:5.1f}")
plt.figure(figsize=(6, 3.2)); plt.plot(positions, no_cache, "o-", label="no cache"); plt.plot(positions, cache, "o-", label="KV cache")
plt.xlabel("position"); plt.ylabel("ms per token"); plt.legend(); plt.tight_layout(); plt.show()

# %% [markdown]
# ## 3. What the cache costs: the article's formula
#
# KV bytes = 2 (K and V) × layers × kv_heads × head_dim × seq_len × batch × dtype_bytes.

# %%
per_token = kv_cache_bytes(32, 32, 128, 1, 1, 2)
print(f"Llama-7B fp16: {per_token/1024:.0f} KiB/token, {kv_cache_bytes(32,32,128,1000,1,2)/2**30:.2f} GiB at 1000 tokens, "
      f"{kv_cache_bytes(32,32,128,100_000,1,2)/2**30:.1f} GiB at 100K tokens")
cfg = model.cfg
c = KVCache(cfg, 4, 1024)
print(f"SmolLM2 fp32, batch 4 x 1024: allocated {c.nbytes/1e6:.1f} MB, formula {kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 1024, 4, 4)/1e6:.1f} MB")
print(f"SmolLM2 weights fp32: {cfg.num_parameters()*4/1e6:.0f} MB; the cache passes them at "
      f"{cfg.num_parameters()*4 / kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 1, 1, 4):.0f} tokens")
del c

# %% [markdown]
# ## 4. Prefill vs decode: two different workloads
#
# Prefill pushes many tokens through each weight (matrix × matrix): it runs near the machine's FLOP/s.
# Decode pushes one token per sequence through each weight (matrix × vector): it runs near the memory
# bandwidth, and batching decodes is how to use the idle FLOPs.

# %%
shapes = [(1, 64), (8, 64)] if QUICK else [(1, 128), (1, 512), (1, 2048), (16, 128), (16, 512)] + ([(64, 512), (256, 512)] if device == "cuda" else [])
rows = [prefill_decode(model, b, L, 4 if QUICK else 16) for b, L in shapes]
for r in rows:
    print(f"batch {r['batch']:2d} prompt {r['prompt_len']:5d}: prefill {r['prefill_tok_s']:8.0f} tok/s ({r['prefill_GFLOPs']:5.0f} GFLOP/s)   "
          f"decode {r['decode_tok_s']:6.1f} tok/s ({r['decode_GBps']:5.1f} GB/s, {r['decode_GFLOPs']:5.1f} GFLOP/s)")

# %% [markdown]
# ## 5. Fast batch-1 decode
#
# `minillm/stages/fast_decode.py` keeps the math and removes overhead: fused q/k/v and gate/up projections, a
# precomputed RoPE table, torch's fused attention. Same tokens, fewer launches.

# %%
from minillm import LLM, SamplingParams
llm = LLM(model="smollm2", dtype="float32", device=device)
ids = llm.get_tokenizer().encode("Write a detailed essay about the printing press.")
n = 16 if QUICK else 128
reps = 1 if QUICK else 3                     # timed repeats; quick mode's timings are not read
p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
fast = llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False)[0].outputs[0].token_ids
print("fast path == cached baseline:", fast == generate_greedy(llm.model, [ids], n)[0])
t_fast = time_median(lambda: llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False), repeats=reps, device=device)
t_plain = time_median(lambda: generate_greedy(llm.model, [ids], n), repeats=reps, device=device)
print(f"cached, unfused: {n/t_plain:.1f} tok/s   fast path: {n/t_fast:.1f} tok/s")

# %% [markdown]
# ### The GEMV is the step: count its bytes
#
# At batch 1 every projection is a matrix-vector product that reads each weight once. Time one with the
# library kernel (`torch.mv`: MKL for fp32 on CPU) and with the same product written as a row-wise dot
# product, `(W * x).sum(-1)` in fp32, which `torch.compile` turns into one generated loop instead of a
# library call. Bytes moved / time = the bandwidth each one reaches; compare with a plain read of the
# same bytes (`roofline.measure_bandwidth`). 30 copies of the matrix, used in turn, keep it out of cache
# as in the real model.

# %%
from minillm.perf import roofline
from minillm.stages.fast_decode import gemv_compiled
W = [torch.randn(3072, 576, device=device) for _ in range(30)]         # the fused gate/up shape, fp32
x = torch.randn(576, device=device)
kernels = {"torch.mv": torch.mv} if device == "cuda" else {"torch.mv": torch.mv, "compiled row-wise dot": gemv_compiled}
for name, gemv in kernels.items():
    torch.testing.assert_close(gemv(W[0], x), torch.mv(W[0], x), rtol=1e-4, atol=1e-4)
    t = time_median(lambda: [gemv(w, x) for w in W], repeats=5, device=device) / len(W)
    print(f"{name:22s} {t * 1e6:7.1f} us  {W[0].nbytes / t / 1e9:5.1f} GB/s")
print(f"plain read bound       {roofline.measure_bandwidth(128 if QUICK else 512, device=device) / 1e9:5.1f} GB/s")

# %% [markdown]
# ### What each step bought
#
# The same generation with each step of the fast path switched on in turn (`gemv=`: how a one-token
# projection runs; `compiled_step`: the whole decode step of a layer compiled once for all 30 layers,
# CPU only). Every row gives the baseline's tokens in fp32 (`tests/stages/test_fast_decode.py`).

# %%
from minillm.stages.fast_decode import generate_greedy_fast
steps = {"fused, F.linear": dict(gemv="linear", compiled_step=False),
         "+ torch.mv": dict(gemv="mv", compiled_step=False)}
if device == "cpu":
    steps["+ compiled GEMV"] = dict(gemv="compiled", compiled_step=False)
    steps["+ compiled decode step"] = dict(gemv="compiled", compiled_step=True)
ref = generate_greedy(llm.model, [ids], n)[0]
for name, kw in steps.items():
    same = generate_greedy_fast(llm.model, ids, n, **kw) == ref                 # also the warm-up (compiles)
    t = time_median(lambda: generate_greedy_fast(llm.model, ids, n, **kw), repeats=reps, device=device)
    print(f"{name:24s} {n / t:6.1f} tok/s   same tokens as the baseline: {same}")
