"""Lessons 02: what the KV cache buys, prefill vs decode, and batch-1 decode against HF and the bound.

Four measurements, all on SmolLM2-135M in one run (medians after warm-up):
1. decode tokens/s without a cache (the baseline recomputes everything) vs with it, for
   N generated tokens; and the latency of ONE step at a given position (quadratic vs flat);
2. cache bytes allocated vs the article's formula;
3. prefill tokens/s and decode tokens/s separately, batch 1 and 16, with achieved FLOP/s and
   bytes/s, next to the machine's measured GEMM FLOP/s and GEMV bandwidth;
4. batch-1 greedy decode through LLM.generate (the engine) vs transformers' generate (KV cache
   on), same prompt, same dtype, and vs the bandwidth bound; plus each step of the fast path
   on its own (unfused cache -> fused projections + RoPE table + SDPA -> + torch.mv GEMV ->
   + compiled GEMV -> + compiled decode step), to show what each step bought.
"""
from __future__ import annotations

import os
import time

import torch

from minillm.course.calculators import kv_cache_bytes
from minillm.perf import roofline
from minillm.stages.kv_cache import KVCache, generate_greedy, generate_greedy_naive, prefill_decode, step_latency
from .common import document, figure_path, time_median

NAME = "kv-cache"
PROMPT = "Write a detailed essay about the history of the printing press and its effect on Europe."


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = [r["position"] for r in rows]
    plt.figure(figsize=(6, 3.5))
    plt.plot(pos, [r["no_cache_step_ms"] for r in rows], "o-", label="no cache (recompute all)")
    plt.plot(pos, [r["cache_step_ms"] for r in rows], "o-", label="KV cache")
    plt.xlabel("position of the new token"); plt.ylabel("ms per token")
    plt.title("SmolLM2-135M fp32, batch 1"); plt.legend(); plt.tight_layout()
    plt.savefig(path, dpi=120); plt.close()


def dense_hf_model(dtype: torch.dtype):
    """transformers' LlamaForCausalLM with plain dense weights in `dtype`, from the same GGUF.
    (Loaded straight from a GGUF, transformers 5 keeps the weights packed and computes in fp32
    with casts; a dense copy is the fair peer for a dtype comparison.)"""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from minillm.loading.loader import fetch_smollm2

    path = fetch_smollm2()
    packed = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = packed.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = LlamaForCausalLM(config)
    dense.load_state_dict(packed.state_dict())
    return dense.to(dtype).eval()


def batch1_vs_hf(dtype_name: str, new_tokens: int) -> dict:
    """Greedy batch-1 decode of one chat prompt, each step of the fast path switched on in turn,
    and transformers' generate (KV cache on, dense weights, same dtype); interleaved runs, medians."""
    from minillm import LLM, SamplingParams
    from minillm.stages.fast_decode import FastDecoder

    llm = LLM(model="smollm2", dtype=dtype_name, device="cpu")
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": PROMPT}])
    ids = llm.get_tokenizer().encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    hf = dense_hf_model(getattr(torch, dtype_name))
    x = torch.tensor([ids])

    def theirs():
        with torch.no_grad():
            hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    def fast(decoder):
        return lambda: decoder.generate_greedy(ids, new_tokens)
    compiled_step = FastDecoder(llm.model, gemv="compiled", compiled_step=True)   # llm.model: fused by LLM
    compiled_step.tune()                # the explicit timing step: bf16's faster compiled build here (fp32: none)
    systems = {   # what each step adds, in order (lesson 02, "what each step bought")
        "cached_unfused": lambda: generate_greedy(llm.model, [ids], new_tokens),
        "fused_rope_sdpa": fast(FastDecoder(llm.model, gemv="linear", compiled_step=False)),
        "plus_gemv": fast(FastDecoder(llm.model, gemv="mv", compiled_step=False)),
        "plus_compiled_gemv": fast(FastDecoder(llm.model, gemv="compiled", compiled_step=False)),
        "plus_compiled_step": fast(compiled_step),
        "llm_generate": lambda: llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False),
        "hf": theirs,
    }
    times = {name: [] for name in systems}
    probe = roofline.BandwidthProbe(512, dtype=getattr(torch, dtype_name))
    for fn in systems.values():
        fn()                                                    # warm-up
    for _ in range(3):                  # interleaved, so that machine noise hits every system alike
        for name, fn in systems.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            probe.sample()              # the bandwidth moves on a VM: sampled between the runs, the fastest kept
    tok_s = {name: new_tokens / sorted(v)[1] for name, v in times.items()}
    elem = torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
    bound = probe.best / roofline.weight_bytes(llm.config, elem)
    row = {"dtype": dtype_name, "new_tokens": new_tokens, "prompt_tokens": len(ids),
           **{f"{name}_tok_s": v for name, v in tok_s.items()}, "bandwidth_GBps": probe.best / 1e9,
           "bandwidth_samples_GBps": [b / 1e9 for b in probe.samples], "bound_tok_s": bound,
           "decode_build": compiled_step.build}                    # the compiled step's build (2-byte: tuned)
    row["ours_vs_hf"] = tok_s["llm_generate"] / tok_s["hf"]
    row["fraction_of_bound"] = tok_s["llm_generate"] / bound
    return row


def run(quick: bool, json_path: str | None = None) -> dict:
    """json_path: where the document will be written; the latency plot goes beside it
    (x.json -> x-latency.png), so that a run on another machine does not overwrite this one's."""
    from minillm.loading.loader import load_model

    model, _ = load_model("smollm2", dtype="float32", device="cpu")
    cfg = model.cfg
    results = []
    # 1. no cache vs cache: whole generations (short ones only without cache: it is quadratic)
    prompt = list(range(100, 116))
    for n in ([16, 32] if quick else [32, 64, 128, 256]):
        t_naive = time_median(lambda: generate_greedy_naive(model, prompt, n), repeats=1, warmup=0)
        t_cache = time_median(lambda: generate_greedy(model, [prompt], n), repeats=3)
        results.append({"part": "generate", "new_tokens": n, "no_cache_tok_s": n / t_naive,
                        "cache_tok_s": n / t_cache, "speedup": t_naive / t_cache})
    latency = []
    for p in ([32, 128] if quick else [32, 128, 512, 1024, 2048]):
        latency.append({"part": "step", "position": p, "no_cache_step_ms": 1e3 * step_latency(model, p, False),
                        "cache_step_ms": 1e3 * step_latency(model, p, True)})
    results += latency
    os.makedirs("results", exist_ok=True)
    plot = figure_path(json_path, "-latency", "kv-cache-latency.png", quick)
    os.makedirs(os.path.dirname(plot) or ".", exist_ok=True)
    _plot(latency, plot)
    # 2. bytes: allocated vs formula
    cache = KVCache(cfg, 4, 1024)
    formula = kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 1024, 4, 4)
    results.append({"part": "bytes", "allocated_MB": cache.nbytes / 1e6, "formula_MB": formula / 1e6})
    del cache
    # 3. prefill vs decode
    probe = roofline.BandwidthProbe(256 if quick else 512)
    shapes = [(1, 128), (16, 128)] if quick else [(1, 128), (1, 512), (1, 2048), (16, 128), (16, 512)]
    for batch, length in shapes:
        probe.sample()
        results.append({"part": "prefill_vs_decode", **prefill_decode(model, batch, length, 4 if quick else 16)})
    probe.sample()
    machine = {"gemm_GFLOPs": roofline.measure_flops(1024 if quick else 2048) / 1e9,
               "bandwidth_GBps": probe.best / 1e9,
               "bandwidth_samples_GBps": [b / 1e9 for b in probe.samples]}
    del probe
    del model
    # 4. batch-1 decode vs transformers
    summary = {"machine_gemm_GFLOPs": machine["gemm_GFLOPs"], "machine_bandwidth_GBps": machine["bandwidth_GBps"],
               "machine_bandwidth_samples_GBps": machine["bandwidth_samples_GBps"],
               "batch1_vs_hf": {}, "bandwidth_bound_fraction": {}}
    for dtype_name in ("float32", "bfloat16"):
        row = batch1_vs_hf(dtype_name, 16 if quick else 128)
        results.append({"part": "batch1", **row})
        summary["batch1_vs_hf"][dtype_name] = row["ours_vs_hf"]
        summary["bandwidth_bound_fraction"][dtype_name] = row["fraction_of_bound"]
    gen = [r for r in results if r["part"] == "generate"]
    summary["cache_speedup_at_max_tokens"] = gen[-1]["speedup"]
    summary["builds_16bit"] = {r["dtype"]: r["decode_build"] for r in results   # the compiled 2-byte step's
                               if r["part"] == "batch1" and r["dtype"] != "float32"}   # build this machine chose
    config = {"model": "smollm2", "threads": torch.get_num_threads(), "plot": plot,
              "no_cache_note": "whole-generation timing without cache stops at 256 tokens (quadratic); "
                               "single-step latency goes to position 2048"}
    return document(NAME, config, results, summary)
