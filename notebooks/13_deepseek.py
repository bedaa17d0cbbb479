# %% [markdown]
# # 13 · DeepSeek's ideas: latent attention and a mixture of experts
#
# *Lesson: [lessons/13-deepseek.md](../lessons/13-deepseek.md).* Interview question: **MLA 为什么能省 KV Cache？MoE
# 模型参数那么多，为什么推理还快？**

# %%
import torch
import torch.nn.functional as F
from minillm import LLM, SamplingParams
from minillm.course.calculators import experts_touched, moe_step_weight_bytes
from minillm.model.llama import ModelConfig, naive_attention_fp32, random_model, tiny_config
from minillm.model.mla import MLAShape, absorbed_query, split_kv_up
from minillm.model.moe import MoEShape, balance_bias_update, expert_load, grouped, imbalance, per_token, route
from minillm.model.positions import rope_cos_sin
from minillm.parallel.calculator import ep_bytes_per_token
from minillm.parallel.checks import experts_vs_one
from minillm.parallel.launch import launch
from minillm.course.notebook import start
device, QUICK = start("cpu")                   # the engine's latent cache and the gloo ranks run on CPU here

# %% [markdown]
# ## 1. What MLA caches
#
# Per token and layer: one latent `c` (kv_lora_rank values) and one RoPE key shared by all heads. Every head's
# key and value are linear in `c` (`wkv_b`). DeepSeek-V3's widths against caching its heads expanded:

# %%
v3 = ModelConfig.named("deepseek-v3")
s = v3.mla
latent = s.cache_width
expanded = v3.n_heads * (s.qk_head_dim + s.v_head_dim)
print(f"DeepSeek-V3 per token and layer: latent {s.kv_lora_rank} + RoPE key {s.qk_rope_head_dim} = {latent} values; "
      f"every head's K and V expanded: {expanded} values ({expanded / latent:.1f}x)")

# %% [markdown]
# ## 2. Absorption, by hand
#
# One head: its no-position score is `q_nope . (W_uk c)`, which equals `(W_uk^T q_nope) . c`. Move the query into the
# latent space once and score it against the cached latents directly: no key is ever built.

# %%
torch.manual_seed(0)
shape = MLAShape(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
w_kv_b = torch.randn(6 * (16 + 12), 32, dtype=torch.float64)            # 6 heads
w_uk, w_uv = split_kv_up(w_kv_b, shape, 6)                                # (6, 16, 32), (6, 12, 32)
q = torch.randn(6, 16 + 8, dtype=torch.float64)                           # one token's query, RoPE part rotated
c, k_rope = torch.randn(32, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
naive = torch.stack([q[h, :16] @ (w_uk[h] @ c) + q[h, 16:] @ k_rope for h in range(6)])
absorbed = absorbed_query(q, w_uk, shape) @ torch.cat([c, k_rope])
print(f"per-head scores, naive vs absorbed: max |difference| = {(naive - absorbed).abs().max().item():.1e}")

# %% [markdown]
# The whole layer both ways: a tiny MLA model's first attention layer on 40 tokens.

# %%
model = random_model(tiny_config(n_kv_heads=6, head_dim=8, mla=shape), seed=0)
attn = model.layers[0].attn
x = torch.randn(1, 40, 96)
cos, sin = rope_cos_sin(torch.arange(40), 8, 10000.0)
with torch.no_grad():
    diff = (attn(x, cos, sin, naive_attention_fp32) - attn(x, cos, sin, naive_attention_fp32, absorbed=True)).abs().max()
print(f"layer output, naive expansion vs absorbed: max |difference| = {diff.item():.1e}")

# %% [markdown]
# ## 3. A DeepSeek-V3 checkpoint through the engine
#
# A tiny random-weight DeepSeek-V3 made by transformers' own config class, saved as a checkpoint folder, loaded by
# minillm: its greedy tokens through the engine (the latent paged cache, batching, the experts) against transformers'.

# %%
import tempfile
import transformers
from minillm.loading.loader import fetch_smollm2

hf_cfg = transformers.DeepseekV3Config(
    vocab_size=256, hidden_size=96, intermediate_size=192, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=6, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
    first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=512)
torch.manual_seed(0)
hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
with torch.no_grad():
    for name, p in hf.named_parameters():
        p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.2 * torch.randn(p.shape))
folder = tempfile.mkdtemp()
hf.save_pretrained(folder)
smollm2 = fetch_smollm2()
transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name).save_pretrained(folder)

prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
want = []
with torch.no_grad():
    for p in prompts:
        ids = list(p)
        for _ in range(8):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        want.append(ids[len(p):])
llm = LLM(model=folder, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64, tune_kernels=False)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8,
                    ignore_eos=True), use_tqdm=False)
got = [list(o.outputs[0].token_ids) for o in outs]
print(f"engine tokens: {got}")
print(f"same tokens as transformers: {got == want}")
print(f"latent pool: k {tuple(llm.engine.kv.k.shape)} (layers, blocks, block size, 1 head, r + d_rope); "
      f"v is a view of it: {llm.engine.kv.v.data_ptr() == llm.engine.kv.k.data_ptr()}")

# %% [markdown]
# ## 4. Routing, by hand and by the library
#
# DeepSeek-V3's router: a sigmoid score per expert; experts chosen on score + bias inside the best groups; weighted by
# the scores without the bias. Mixtral's: softmax, top k, renormalised.

# %%
moe = MoEShape(n_experts=16, top_k=4, expert_ffn_dim=8, router="sigmoid", n_group=4, topk_group=2, routed_scale=2.5)
logits = torch.randn(5, 16)
bias = torch.zeros(16)
weights, experts = route(logits, moe, bias)
scores = logits.sigmoid()
group_rank = scores.view(5, 4, 4).topk(2, dim=-1).values.sum(-1)                 # each group: its two best scores
kept = group_rank.topk(2, dim=-1).indices                                          # the 2 best groups
allowed = torch.zeros(5, 16, dtype=torch.bool)
for t in range(5):
    for g in kept[t]:
        allowed[t, 4 * g:4 * g + 4] = True
by_hand = scores.masked_fill(~allowed, -1).topk(4, dim=-1).indices
print(f"same experts as the library: {torch.equal(by_hand.sort(-1).values, experts.sort(-1).values)}")

# %% [markdown]
# Grouped experts (one GEMM per expert) against the per-token definition, on a MoE layer of the tiny model:

# %%
cfg = tiny_config(moe=MoEShape(n_experts=16, top_k=4, expert_ffn_dim=24, router="sigmoid", n_shared=1, n_group=4,
                               topk_group=2, first_dense=1))
layer = random_model(cfg, seed=1).layers[1].ffn
x = torch.randn(64, 96)
with torch.no_grad():
    w, e = layer.routing(x)
    diff = (grouped(x, w, e, layer.w_gate, layer.w_up, layer.w_down) - per_token(x, w, e, layer.w_gate, layer.w_up, layer.w_down)).abs().max()
print(f"grouped vs per-token: max |difference| = {diff.item():.1e}")
print(f"tokens per expert: {expert_load(e, 16).tolist()}")

# %% [markdown]
# ## 5. What a decode step reads
#
# A step of B tokens runs every expert at least one token chose. DeepSeek-V3's router on random scores against the
# even-routing formula, and the FP8 weights the step reads:

# %%
v3_moe = v3.moe
for batch in (1, 4, 16, 64, 256):
    seen = sum(len(set(route(torch.randn(batch, 256), v3_moe)[1].flatten().tolist())) for _ in range(5)) / 5
    print(f"batch {batch:3d}: experts touched per layer {seen:6.1f} (formula {experts_touched(batch, 256, 8):6.1f}); "
          f"weights read {moe_step_weight_bytes('deepseek-v3', batch, 1) / 1e9:6.1f} GB")

# %% [markdown]
# ## 6. Balancing without a loss: DeepSeek-V3's bias
#
# A router that leans towards the high-numbered experts; after every step each overloaded expert's bias drops by gamma.

# %%
shape16 = MoEShape(n_experts=16, top_k=4, expert_ffn_dim=8, router="sigmoid")
skew, bias = torch.linspace(-1.5, 1.5, 16), torch.zeros(16)
for step in range(60):
    load = expert_load(route(torch.randn(256, 16) + skew, shape16, bias)[1], 16)
    if step in (0, 10, 30, 59):
        print(f"step {step:2d}: busiest / mean = {imbalance(load):.2f}")
    bias = balance_bias_update(bias, load, gamma=0.02)

# %% [markdown]
# ## 7. Expert parallelism on two processes
#
# Each rank holds half the routed experts and runs its own sequence; in every MoE layer it sends each token's row to
# the expert's rank and gets the output back (all-to-all). Logits against one process, bytes against the formula:

# %%
ep_cfg = tiny_config(n_layers=3, n_kv_heads=6, head_dim=8, mla=shape,
                     moe=MoEShape(n_experts=16, top_k=4, expert_ffn_dim=32, router="sigmoid", n_shared=1, first_dense=1))
tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(3))
ranks = launch(experts_vs_one, 2, ep_cfg, tokens)
for r, out in enumerate(ranks):
    print(f"rank {r}: {out['experts_here']} experts here; all-to-all {out['counts']['all_to_all.bytes']:,} bytes "
          f"(even-routing formula {128 * ep_bytes_per_token(ep_cfg, 2, 4):,.0f}); against one process max |difference| = "
          f"{out['max_abs_diff']:.1e}")
