# %% [markdown]
# # 03 · GQA and MQA: fewer K/V heads, smaller cache
#
# *Lesson: [lessons/03-gqa.md](../lessons/03-gqa.md).* Interview question: **KV Cache 显存怎么算？为什么长上下文会爆显存？**
# and the article's MQA / GQA section.

# %%
import torch
from minillm.attention.gqa import grouped_attention, convert_kv_heads
from minillm.model.llama import naive_attention_fp32
from minillm.model import shapes
from minillm.stages.kv_cache import KVCache
from minillm import LLM
from minillm.evaluate import perplexity
from minillm.course.notebook import start
device, QUICK = start()                        # cuda when present; prints the machine

# %% [markdown]
# ## 1. Attention over shared K/V heads, without copying them
#
# The baseline repeats each K/V head for the query heads of its group. `grouped_attention` folds the group
# into the query axis instead: same numbers, each K/V head read once.
#
# First by hand, with torch primitives: 9 query heads share 3 K/V heads, so query head `h` reads K/V
# head `h // 3`. `repeat_interleave` makes those copies explicit; then it is ordinary attention, with the
# 6 new queries sitting at the last 6 of 40 positions (causal). Change the head counts and re-run.

# %%
torch.manual_seed(0)
q, k, v = torch.randn(1, 9, 6, 64), torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64)
group = q.shape[1] // k.shape[1]                              # query heads per K/V head
k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # (1, 9, 40, 64) copies
print(f"query head 4 reads K/V head {4 // group}: {torch.equal(k_rep[:, 4], k[:, 4 // group])}")
mask = torch.ones(6, 40, dtype=torch.bool).tril(40 - 6)       # query t sees keys 0 .. 34 + t
scores = (q @ k_rep.transpose(-1, -2)) / q.shape[-1] ** 0.5   # (1, 9, 6, 40)
by_hand = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v_rep
err = (by_hand - grouped_attention(q, k, v, mask[None, None])).abs().max().item()
print(f"by hand vs minillm.attention.gqa.grouped_attention: max |difference| = {err:.1e}")
print(f"K/V bytes read: {k_rep.nbytes + v_rep.nbytes} with copies, {k.nbytes + v.nbytes} without")

# %% [markdown]
# The same check over MHA, GQA and MQA head layouts, against the baseline's attention:

# %%
for hq, hkv in [(9, 9), (9, 3), (9, 1)]:
    q, k, v = torch.randn(1, hq, 6, 64), torch.randn(1, hkv, 40, 64), torch.randn(1, hkv, 40, 64)
    mask = torch.ones(6, 40, dtype=torch.bool).tril(34)[None, None]
    err = (grouped_attention(q, k, v, mask) - naive_attention_fp32(q, k, v)).abs().max().item()
    print(f"{hq} query heads / {hkv} KV heads: max |difference| = {err:.1e}")

# %% [markdown]
# ## 2. KV bytes per token (fp16) as MHA, as shipped, as MQA
#
# Llama-2-7B ships as MHA, so its first two columns agree: of the Llama 2 models only the 70B (and the unreleased 34B)
# use GQA (Llama 2 paper, arXiv 2307.09288, §2.2 and Table 1), whatever the source article says (lesson 03's card).

# %%
def kv_bytes(cfg, kv_heads, tokens=1, bytes_per_value=2):
    return 2 * cfg.n_layers * kv_heads * cfg.head_dim * tokens * bytes_per_value    # K and V, every layer

models = {"Llama-2-7B": shapes.LLAMA2_7B, "Llama-2-70B": shapes.LLAMA2_70B, "Llama-3-8B": shapes.LLAMA3_8B,
          "Qwen2.5-7B": shapes.QWEN25_7B, "SmolLM2-135M": shapes.SMOLLM2_135M}
for name, cfg in models.items():
    print(f"{name:13s} MHA {kv_bytes(cfg, cfg.n_heads) / 1024:6.0f} KiB   shipped ({cfg.n_kv_heads:2d} KV heads) "
          f"{kv_bytes(cfg, cfg.n_kv_heads) / 1024:6.0f} KiB   MQA {kv_bytes(cfg, 1) / 1024:5.0f} KiB   "
          f"at 32K tokens: {kv_bytes(cfg, cfg.n_kv_heads, 32768) / 1e9:5.1f} GB")

# %% [markdown]
# ## 3. SmolLM2 converted to MQA by mean-pooling its 3 K/V heads into 1
#
# The cache shrinks 3x[^mqa], but without uptraining the model has never seen the averaged heads.
#
# [^mqa]: measured in results/gqa.json: results(part="smollm2", kv_heads=3).KiB_per_token_bf16 / results(part="smollm2", kv_heads=1).KiB_per_token_bf16

# %%
llm = LLM(model="smollm2", device=device)
base = llm.model
windows = 2 if QUICK else 24
ppl = {}
for kv in (3, 1):
    llm.model = base if kv == 3 else convert_kv_heads(base, kv)
    ppl[kv] = perplexity(llm, window=256, max_windows=windows)
    cfg = llm.model.cfg
    batch = (1 << 30) // kv_bytes(cfg, cfg.n_kv_heads, 2048)              # bf16 caches of 2048 tokens in 1 GiB
    assert KVCache(cfg, batch, 2048, torch.bfloat16).nbytes <= 1 << 30     # the real allocation agrees
    print(f"{kv} KV heads: perplexity {ppl[kv]:.2f}, max batch at 2048 tokens in 1 GiB (bf16): {batch}")
print(f"MQA without uptraining costs {ppl[1]/ppl[3]-1:+.0%} perplexity")
llm.model = base

# %% [markdown]
# ## 4. The families readers deploy: each a small switch in the same layer
#
# Llama, Mistral, Qwen2 and Qwen3 differ by a few config fields (lesson 03, "What changes between model families"):
# Qwen2 adds biases on q, k and v; Qwen3 normalises every head of q and k and sets head_dim apart from
# hidden / heads; Llama-3.1 rescales RoPE's low frequencies; Mistral-7B v0.1 attends within a sliding window (32
# tokens here, against prompts of 200). Below, a tiny random-weight model of each family is made
# with its own transformers config class, saved as an HF folder, loaded by minillm, and compared with transformers.

# %%
import json, tempfile
import transformers
from minillm.loading.loader import load_model
transformers.utils.logging.disable_progress_bar()

tiny = dict(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
families = {
    "llama-3.1": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                  dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "mistral-w32": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=32)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
}
ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=llm.get_tokenizer().tok)   # a folder needs a tokenizer.json
for name, (config_class, model_class, extra) in families.items():
    torch.manual_seed(0)
    hf = model_class(config_class(**tiny, **extra)).eval()
    with torch.no_grad():
        for p_name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in p_name else 0.2 * torch.randn_like(p))
    folder = tempfile.mkdtemp()
    hf.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    ours, _ = load_model(folder, dtype="float32", device="cpu")
    c = ours.cfg
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    print(f"{name:11s} qkv_bias={c.qkv_bias!s:5s} qk_norm={c.qk_norm!s:5s} head_dim={c.head_dim} window={c.sliding_window} "
          f"rope_scaling={(c.rope_scaling or {}).get('rope_type')}: max |logit difference| vs transformers = {diff:.1e}")

# %% [markdown]
# A config asking for what the forward does not implement is refused by name, never ignored: Qwen2's windows on
# some layers only (full attention on the others), for one.

# %%
hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**tiny, use_sliding_window=True, sliding_window=32,
                                                              max_window_layers=1)).eval()
folder = tempfile.mkdtemp()
hf.save_pretrained(folder)
hf_tokenizer.save_pretrained(folder)
try:
    load_model(folder, dtype="float32", device="cpu")
except ValueError as e:
    print("refused:", e)
