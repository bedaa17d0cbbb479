"""Lesson 03: KV bytes per token as MHA / GQA / MQA, SmolLM2 converted to MQA, max batch per budget."""
from __future__ import annotations

import torch

from minillm.attention.gqa import convert_kv_heads
from minillm.course.calculators import kv_cache_bytes
from minillm.evaluate import perplexity
from minillm.model.llama import ModelConfig
from minillm.model.shapes import SMOLLM2_135M
from minillm.stages.kv_cache import KVCache
from .common import document

NAME = "gqa"

# name: (layers, query heads, kv heads as shipped, head_dim) from each model's config.json
MODELS = {
    "Llama-2-7B": (32, 32, 32, 128),
    "Llama-2-70B": (80, 64, 8, 128),
    "Llama-3-8B": (32, 32, 8, 128),
    "Qwen2.5-7B": (28, 28, 4, 128),
    "SmolLM2-135M": (30, 9, 3, 64),
}


def kv_table() -> list[dict]:
    rows = []
    for name, (layers, heads, kv, hd) in MODELS.items():
        per = lambda h: kv_cache_bytes(layers, h, hd, 1, 1, 2) / 1024   # KiB per token, fp16
        rows.append({"part": "kv_per_token", "model": name, "shipped_kv_heads": kv,
                     "MHA_KiB": per(heads), "shipped_KiB": per(kv), "MQA_KiB": per(1),
                     "shipped_GB_at_32k": kv_cache_bytes(layers, kv, hd, 32768, 1, 2) / 1e9})
    return rows


def max_batch(cfg: ModelConfig, budget_bytes: int, seq_len: int, dtype=torch.bfloat16) -> int:
    """Largest batch whose preallocated cache fits the budget, checked by allocating it."""
    elem = torch.tensor([], dtype=dtype).element_size()
    batch = int(budget_bytes // kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, seq_len, 1, elem))
    if batch:
        assert KVCache(cfg, batch, seq_len, dtype).nbytes <= budget_bytes
    return batch


def run(quick: bool) -> dict:
    from minillm import LLM

    results = kv_table()
    llm = LLM(model="smollm2", dtype="float32", device="cpu")
    base = llm.model
    budget, seq_len = 1 << 30, 2048
    windows = 4 if quick else 24
    summary = {"budget_GiB": 1, "seq_len": seq_len, "ppl": {}, "max_batch": {}}
    for label, kv in (("GQA-3 (shipped)", 3), ("MQA-1 (mean-pooled, no uptraining)", 1)):
        llm.model = base if kv == base.cfg.n_kv_heads else convert_kv_heads(base, kv)
        ppl = perplexity(llm, window=256, max_windows=windows)
        cfg = llm.model.cfg
        elem_bf16 = 2
        row = {"part": "smollm2", "variant": label, "kv_heads": kv, "ppl": ppl,
               "KiB_per_token_bf16": kv_cache_bytes(cfg.n_layers, kv, cfg.head_dim, 1, 1, elem_bf16) / 1024,
               "max_batch_1GiB_2048": max_batch(cfg, budget, seq_len)}
        results.append(row)
        summary["ppl"][f"kv{kv}"] = ppl
        summary["max_batch"][f"kv{kv}"] = row["max_batch_1GiB_2048"]
    mha = SMOLLM2_135M.replace(n_kv_heads=9)
    summary["max_batch"]["kv9_mha"] = max_batch(mha, budget, seq_len)
    results.append({"part": "smollm2", "variant": "MHA-9 (if it had been trained so)", "kv_heads": 9,
                    "KiB_per_token_bf16": kv_cache_bytes(30, 9, 64, 1, 1, 2) / 1024,
                    "max_batch_1GiB_2048": summary["max_batch"]["kv9_mha"]})
    summary["mqa_ppl_increase"] = summary["ppl"]["kv1"] / summary["ppl"]["kv3"] - 1
    config = {"ppl_text": "evaluation_text()", "window": 256, "windows": windows, "kv_dtype_for_bytes": "bf16"}
    return document(NAME, config, results, summary)
