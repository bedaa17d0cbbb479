CELLS = [
("md", r"""
# 03 · GQA and MQA: fewer K/V heads, smaller cache

*Lesson: [lessons/03-gqa.md](../lessons/03-gqa.md).* Interview question: **KV Cache 显存怎么算？为什么长上下文会爆显存？**
and the article's MQA / GQA section.
"""),
("code", r"""
import os
import torch
from minillm.gqa import grouped_attention, convert_kv_heads
from minillm.model import naive_attention_fp32
from minillm.benchmarks.gqa import kv_table, max_batch
from minillm import LLM
from minillm.evaluate import perplexity
QUICK = os.environ.get("MINILLM_QUICK", "0") not in ("", "0")
device = "cuda" if torch.cuda.is_available() else "cpu"
"""),
("md", r"""
## 1. Attention over shared K/V heads, without copying them

The baseline repeats each K/V head for the query heads of its group. `grouped_attention` folds the group
into the query axis instead: same numbers, each K/V head read once.
"""),
("code", r"""
for hq, hkv in [(9, 9), (9, 3), (9, 1)]:
    q, k, v = torch.randn(1, hq, 6, 64), torch.randn(1, hkv, 40, 64), torch.randn(1, hkv, 40, 64)
    mask = torch.ones(6, 40, dtype=torch.bool).tril(34)[None, None]
    err = (grouped_attention(q, k, v, mask) - naive_attention_fp32(q, k, v)).abs().max().item()
    print(f"{hq} query heads / {hkv} KV heads: max |difference| = {err:.1e}")
"""),
("md", r"""
## 2. KV bytes per token (fp16) as MHA, as shipped, as MQA
"""),
("code", r"""
for r in kv_table():
    print(f"{r['model']:13s} MHA {r['MHA_KiB']:6.0f} KiB   shipped ({r['shipped_kv_heads']:2d} KV heads) {r['shipped_KiB']:6.0f} KiB   "
          f"MQA {r['MQA_KiB']:5.0f} KiB   at 32K tokens: {r['shipped_GB_at_32k']:5.1f} GB")
"""),
("md", r"""
## 3. SmolLM2 converted to MQA by mean-pooling its 3 K/V heads into 1

The cache shrinks 3x[^mqa], but without uptraining the model has never seen the averaged heads.

[^mqa]: measured in results/gqa.json: results(part="smollm2", kv_heads=3).KiB_per_token_bf16 / results(part="smollm2", kv_heads=1).KiB_per_token_bf16
"""),
("code", r"""
llm = LLM(model="smollm2", device=device)
base = llm.model
windows = 2 if QUICK else 24
ppl = {}
for kv in (3, 1):
    llm.model = base if kv == 3 else convert_kv_heads(base, kv)
    ppl[kv] = perplexity(llm, window=256, max_windows=windows)
    print(f"{kv} KV heads: perplexity {ppl[kv]:.2f}, max batch at 2048 tokens in 1 GiB (bf16): {max_batch(llm.model.cfg, 1 << 30, 2048)}")
print(f"MQA without uptraining costs {ppl[1]/ppl[3]-1:+.0%} perplexity")
llm.model = base
"""),
]
