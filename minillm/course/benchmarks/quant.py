"""Weight quantisation on SmolLM2: perplexity, weight bytes and decode speed per method.

    python -m minillm bench quant [--quick] [--part weights|activations] [--json results/quant.json]

Baseline caveat: the "fp32" model is SmolLM2's Q4_1 GGUF dequantised, so its weights already
sit on a 16-level grid per block of 32 (Q4_1: llama.cpp's block_q4_1, read by minillm/loading/gguf_file.py).
Asymmetric int4 with group 32, aligned to those blocks, can nearly reproduce it; the main
comparisons use group 128 (and a g32 row shows the effect). Every method quantises only the
linear layers in the 30 blocks; the tied embedding / LM head stays full precision in these rows.

Perplexity (results): evaluation_text() (never used for calibration) in 512-token windows, through
LLM.generate's prompt_logprobs. GPTQ / AWQ calibrate on windows of calibration_text(). Rows ending
in -bf16 quantise the bf16 model and run bf16 activations.

Speed (summary.speed): batch-1 LLM.generate, greedy, one chat prompt, every model as LLM runs it:
fp32 and bf16 on the compiled float step (lesson 02), the quantised bf16 models (with LLM's int8 LM
head) on the compiled step over packed weights (fast_decode item 8), each also on the reference
path (cpu_kernels.reference_path: dequantise W on every call, eager loop). All configurations run in
turn within every repeat (interleaved), after one warm-up round; medians. Beside each, the perplexity
of that exact model with prompts fed in 64-token chunks (so every chunk runs the packed kernels, at
most 64 rows), on its fast and its reference path.
Engine (summary.engine): the batching engine, bf16 float against int4 weights, equal requests.
Activations (summary.activations, `--part activations`): weight AND activation quantisation. Perplexity of W8A8
(int8 weights per output channel, int8 activations per token, torch._int_mm) plainly and with SmoothQuant (alpha 0.5),
and of FP8 (e4m3) weights, in fp32, beside bf16 and W8A16 (int8-bf16) and W8A8 on the bf16 model; SmoothQuant's alpha
swept; where the outliers are and what smoothing does to each projection input (outlier_sites); torch._int_mm against
the bf16 GEMM; and the engine's prefill, batch and batch-1 tok/s for bf16, W8A16 and W8A8 (activation_speed).
KV cache (summary.kv_cache): perplexity with the paged engine's KV cache in the model dtype, int8 and
fp8 (e4m3), prompts in 32-token chunks so that each chunk attends over the stored (quantised) cache.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch

from minillm.quant.w8a8 import SMOOTHQUANT_ALPHA

from . import common

NAME = "quant"

# key -> (method, quantize_model kwargs); None = no quantisation (dtype only)
SPECS = {
    "fp32": None,
    "bf16": None,
    "int8": ("int8", {}),
    "int4-g128-sym": ("int4", {"group_size": 128, "symmetric": True}),
    "int4-g128": ("int4", {"group_size": 128}),
    "int4-g32": ("int4", {"group_size": 32}),
    "nf4": ("nf4", {}),
    "nf4-dq": ("nf4", {"double_quant": True}),
    "gptq-4bit-g128": ("gptq", {"group_size": 128}),
    "awq-4bit-g128": ("awq", {"group_size": 128}),
    "int3-g128": ("int4", {"bits": 3, "group_size": 128}),
    "gptq-3bit-g128": ("gptq", {"bits": 3, "group_size": 128}),
    "awq-3bit-g128": ("awq", {"bits": 3, "group_size": 128}),
    "int8-bf16": ("int8", {}),
    "int4-g128-bf16": ("int4", {"group_size": 128}),
    "gptq-4bit-g128-bf16": ("gptq", {"group_size": 128}),
    "awq-4bit-g128-bf16": ("awq", {"group_size": 128}),
    "nf4-bf16": ("nf4", {}),
    # weight AND activation (the activations part): W8A8 plain and SmoothQuant'd, FP8 (e4m3) weights
    "w8a8": ("w8a8", {}),
    "w8a8-sq": ("w8a8", {"alpha": SMOOTHQUANT_ALPHA}),
    "fp8": ("fp8", {}),
    "w8a8-sq-bf16": ("w8a8", {"alpha": SMOOTHQUANT_ALPHA}),
}
BF16_KEYS = ("bf16", "int8-bf16", "int4-g128-bf16", "gptq-4bit-g128-bf16", "awq-4bit-g128-bf16", "nf4-bf16",
             "w8a8-sq-bf16")
# Batch-1 speed: the two float dtypes and the bf16 quantised models, each with LLM's int8 LM head
SPEED_KEYS = ("fp32", "bf16", "int8-bf16", "int4-g128-bf16", "gptq-4bit-g128-bf16", "awq-4bit-g128-bf16", "nf4-bf16")
QUICK_SPEED_KEYS = ("fp32", "bf16", "int8-bf16", "int4-g128-bf16")
QUICK_KEYS = ("fp32", "int8", "int4-g128", "nf4", "gptq-4bit-g128", "awq-4bit-g128", "int4-g128-bf16")
FULL_ORDER = ("fp32", "int8", "int4-g128", "nf4", "gptq-4bit-g128", "awq-4bit-g128", "int3-g128", "gptq-3bit-g128",
              "awq-3bit-g128", "int4-g128-sym", "nf4-dq", "bf16", "int4-g32", "int8-bf16", "int4-g128-bf16")


PARTS = ("weights", "activations")         # `bench quant --part`: weight-only rows, or W8A8 / FP8 (default: both)
ACTIVATION_KEYS = ("fp32", "w8a8", "w8a8-sq", "fp8", "bf16", "int8-bf16", "w8a8-sq-bf16")
ALPHAS = (0.25, 0.4, 0.5, 0.6, 0.75, 0.9)   # SmoothQuant's migration strength, swept (0.5: the paper's usual value)
# the engine's speed, bf16: float, weight-only int8 (W8A16) and W8A8, each served as LLM(quantization=) serves it
ACTIVATION_SPEED_KEYS = {"bf16": None, "W8A16": "int8-bf16", "W8A8": "w8a8-sq-bf16"}


def settings(quick: bool) -> dict:
    if quick:
        return dict(eval_windows=1, window=128, calib_windows=2, calib_window=128, decode_tokens=4,
                    decode_repeats=1, keys=QUICK_KEYS, speed_keys=QUICK_SPEED_KEYS, chunked_windows=2,
                    engine_requests=2, engine_tokens=4, alphas=(0.5,), prefill_lengths=(64,), batch_rows=(4,),
                    batch_tokens=4, speed_repeats=1)
    return dict(eval_windows=8, window=512, calib_windows=4, calib_window=512, decode_tokens=64,
                decode_repeats=5, keys=FULL_ORDER, speed_keys=SPEED_KEYS, chunked_windows=2,
                engine_requests=16, engine_tokens=64, alphas=ALPHAS, prefill_lengths=(512, 1024, 2048),
                batch_rows=(16, 64), batch_tokens=32, speed_repeats=3)


def build(base, key: str, calibration_ids) -> tuple[torch.nn.Module, float]:
    """A (quantised) copy of the fp32 base model, bf16 for BF16_KEYS, and the seconds quantisation took."""
    from minillm.quant import drop_fused_projections, quantize_model

    model = copy.deepcopy(base)
    drop_fused_projections(model)          # every row runs LLM's cached forward (not the fused fast path)
    if key in BF16_KEYS:
        model.to(torch.bfloat16)
    spec = SPECS[key]
    if spec is None:
        return model, 0.0
    method, kwargs = spec
    t0 = time.perf_counter()
    if method in ("gptq", "awq") or "alpha" in kwargs:          # alpha: W8A8 with SmoothQuant, which calibrates
        kwargs = dict(kwargs, calibration_ids=calibration_ids)
    quantize_model(model, method, **kwargs)
    return model, time.perf_counter() - t0


def measure(llm, model, cfg: dict) -> dict:
    from minillm.evaluate import perplexity
    from minillm.quant import weight_bytes

    llm.model = model
    ppl = perplexity(llm, window=cfg["window"], max_windows=cfg["eval_windows"])
    sizes = weight_bytes(model)
    return {"ppl": ppl, "linear_MB": sizes["linear_bytes"] / 1e6, "bits_per_param": sizes["bits_per_param"],
            "vs_fp16": sizes["bits_per_param"] / 16, "model_MB": sizes["model_bytes"] / 1e6}


def speed(models: dict, tokenizer, cfg: dict) -> dict:
    """Batch-1 LLM.generate tok/s of every model, fast and (where a CPU kernel applies: not NF4)
    reference path, interleaved round by round after a warm-up round; medians. Also each model's
    perplexity in 64-token chunks (at least two windows: the engine runs them, in chunks) on both
    paths, and the bytes a decode step reads (linear layers and LM head)."""
    from minillm.evaluate import perplexity
    from minillm.llm import LLM
    from minillm.quant import decode_step_bytes, quantize_lm_head
    from minillm.quant.cpu_kernels import reference_path
    from minillm.quant.linear import QuantLinear
    from minillm.engine.sampling import SamplingParams

    llms, references, step_bytes = {}, {}, {}
    for key, model in models.items():
        quantised = any(isinstance(m, QuantLinear) for m in model.modules())
        if quantised:
            quantize_lm_head(model)                    # as LLM(quantization=...) does on a CPU
        step_bytes[key] = decode_step_bytes(model)                    # before LLM adds fused views
        kernels = any(isinstance(m, QuantLinear) and m.cpu_unsupported is None for m in model.layers.modules())
        llms[key] = (LLM(model=model, tokenizer=tokenizer, device="cpu", max_num_batched_tokens=64), kernels)
        if kernels:         # the reference side: its own LLM, whose engine is built (and always run) in reference_path
            references[key] = LLM(model=model, tokenizer=tokenizer, device="cpu", max_num_batched_tokens=64)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is a quantised model?"}])
    params = SamplingParams(temperature=0, max_tokens=cfg["decode_tokens"], ignore_eos=True)
    runs = [(key, path) for key, (_, q) in llms.items() for path in (("fast", "reference") if q else ("fast",))]
    times = {run: [] for run in runs}
    for round_ in range(cfg["decode_repeats"] + 1):                # round 0: warm-up (compiles)
        for key, path in runs:
            llm = references[key] if path == "reference" else llms[key][0]
            with reference_path(llm.model) if path == "reference" else contextlib.nullcontext():
                t0 = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)
                if round_:
                    times[(key, path)].append(time.perf_counter() - t0)
            assert len(out[0].outputs[0].token_ids) == cfg["decode_tokens"]
    rows = []
    for key, (llm, kernels) in llms.items():
        row = {"method": key, "decode_tok_s": cfg["decode_tokens"] / statistics.median(times[(key, "fast")]),
               "step_MB": step_bytes[key] / 1e6}
        ppl = {"fast": perplexity(llm, window=cfg["window"], max_windows=cfg["chunked_windows"])}
        if kernels:
            row["decode_tok_s_reference"] = cfg["decode_tokens"] / statistics.median(times[(key, "reference")])
            with reference_path(llm.model):
                ppl["reference"] = perplexity(references[key], window=cfg["window"], max_windows=cfg["chunked_windows"])
            row["ppl_chunked_reference"] = ppl["reference"]
            row["ppl_fast_vs_reference_pct"] = 100 * (ppl["fast"] / ppl["reference"] - 1)
        row["ppl_chunked"] = ppl["fast"]
        rows.append(row)
        print(common.format_table([row]), flush=True)
    floats = [r for r in rows if r["method"] in ("fp32", "bf16")]
    best = max(floats, key=lambda r: r["decode_tok_s"])
    for r in rows:
        r["vs_faster_float"] = r["decode_tok_s"] / best["decode_tok_s"]
    return {"faster_float": best["method"], "results": rows,
            "vs_faster_float": {r["method"]: r["vs_faster_float"] for r in rows}}


def engine_throughput(models: dict, tokenizer, cfg: dict) -> dict:
    """The batching engine's output tok/s on equal requests (same prompt length and output length),
    bf16 float against int4 weights (with the int8 LM head), alternating, medians of 3."""
    from minillm.llm import LLM
    from minillm.engine.sampling import SamplingParams

    words = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun".split()
    prompts = [{"prompt_token_ids": tokenizer.encode(" ".join(words[i % 5:] + words[:i % 5]))[:16]}
               for i in range(cfg["engine_requests"])]
    params = SamplingParams(temperature=0, max_tokens=cfg["engine_tokens"], ignore_eos=True)
    llms = {key: LLM(model=models[key], tokenizer=tokenizer, device="cpu") for key in ("bf16", "int4-g128-bf16")}
    times = {key: [] for key in llms}
    for round_ in range(4):
        for key, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if round_:
                times[key].append(time.perf_counter() - t0)
    tokens = cfg["engine_requests"] * cfg["engine_tokens"]
    rows = {key: tokens / statistics.median(t) for key, t in times.items()}
    return {"requests": cfg["engine_requests"], "output_tokens": cfg["engine_tokens"], "tok_s": rows,
            "int4_vs_bf16": rows["int4-g128-bf16"] / rows["bf16"]}


def kv_cache_rows(base, tokenizer, cfg: dict) -> dict:
    """Perplexity with the KV cache in the model dtype (bf16), int8 and fp8, prompts in 32-token
    chunks so that every chunk attends over the cache as stored; and the bytes one block takes."""
    from minillm.evaluate import perplexity
    from minillm.llm import LLM
    from minillm.model.runner import PagedKVCache

    model = copy.deepcopy(base).to(torch.bfloat16)
    out = {}
    for kv in ("auto", "int8", "fp8"):
        llm = LLM(model=model, tokenizer=tokenizer, device="cpu", kv_cache_dtype=kv, enable_chunked_prefill=True,
                  max_num_batched_tokens=32)
        name = "bf16" if kv == "auto" else kv
        ppl = perplexity(llm, window=cfg["window"], max_windows=cfg["chunked_windows"])
        out[name] = {"ppl": ppl, "block_bytes": PagedKVCache.bytes_per_block(model.cfg, 16, torch.bfloat16, kv)}
        del llm
    for name in ("int8", "fp8"):
        out[name]["ppl_vs_bf16_pct"] = 100 * (out[name]["ppl"] / out["bf16"]["ppl"] - 1)
        out[name]["bytes_vs_bf16"] = out[name]["block_bytes"] / out["bf16"]["block_bytes"]
    return out


# ---- the activations part: W8A8, SmoothQuant, FP8 ------------------------------------------------

SITES = {"qkv": ("attn.wq", ("attn.wq", "attn.wk", "attn.wv")), "gate_up": ("ffn.w_gate", ("ffn.w_gate", "ffn.w_up")),
         "down": ("ffn.w_down", ("ffn.w_down",))}      # a projection input: the module it enters, the weights reading it


@torch.no_grad()
def outlier_sites(base, calibration_ids: torch.Tensor, eval_ids: torch.Tensor,
                  alpha: float = SMOOTHQUANT_ALPHA) -> dict:
    """Why plain W8A8 loses on this model, and what SmoothQuant recovers, at each projection input of every block
    of the float model, each layer alone on the float model's own inputs (not the sequential, quantised inputs
    quantize_model calibrates on). a_j = max |x_j| over the calibration tokens. Per site and layer:
    range = max_j a_j / median_j a_j; levels = the mean over held-out tokens of 127 * median_j |x_tj| / max_j |x_tj|
    (the int8 levels the median channel gets under the per-token scale), before and after dividing x by the
    smoothing factors (from a, alpha); err = ||y_W8A8 - y|| / ||y|| on the held-out tokens, y = x W^T in fp32,
    plainly and smoothed (x / s against W * s)."""
    from minillm.quant import w8a8

    model = copy.deepcopy(base).float()
    blocks = list(model.layers)
    absmax = {(i, site): None for i in range(len(blocks)) for site in SITES}
    out = {site: [] for site in SITES}
    phase = {"name": "calibrate"}

    def weight(block, site):
        return torch.cat([block.get_submodule(n).weight.detach().float() for n in SITES[site][1]])   # (out, in)

    def hook(i, site):
        def record(_module, inputs, _output):
            x = inputs[0].detach().float().flatten(0, -2)                                   # (N, in)
            if phase["name"] == "calibrate":
                a = x.abs().amax(dim=0)
                absmax[i, site] = a if absmax[i, site] is None else torch.maximum(absmax[i, site], a)
                return
            a, w = absmax[i, site], weight(blocks[i], site)
            s = w8a8.smoothing_factors(a, [w], alpha)                                     # (in,)
            y = x @ w.t()                                                                  # (N, out)

            def err(xq, wq):
                return ((w8a8.linear(xq, *w8a8.quantize_rows(wq)) - y).norm() / y.norm()).item()

            def levels(v):
                v = v.abs()
                return (127 * v.median(dim=1).values / v.amax(dim=1).clamp(min=1e-30)).mean().item()

            out[site].append({"layer": i, "range": (a.max() / a.median()).item(), "levels_plain": levels(x),
                              "levels_smoothed": levels(x / s), "err_plain": err(x, w), "err_smoothed": err(x / s, w * s)})
        return record

    handles = [blocks[i].get_submodule(SITES[site][0]).register_forward_hook(hook(i, site))
               for i in range(len(blocks)) for site in SITES]
    try:
        for window in calibration_ids:
            model(window[None])
        phase["name"] = "measure"
        for window in eval_ids:
            model(window[None])
    finally:
        for h in handles:
            h.remove()
    summary = {}
    for site, layers in out.items():
        by_layer = {}
        for r in layers:                                     # several eval windows: the mean per layer
            by_layer.setdefault(r["layer"], []).append(r)
        per_layer = [{k: statistics.fmean(r[k] for r in rs) if k != "layer" else layer for k in rs[0]}
                     for layer, rs in sorted(by_layer.items())]
        worst = max(per_layer, key=lambda r: r["err_plain"])
        summary[site] = {**{f"median_{k}": statistics.median(r[k] for r in per_layer)
                            for k in ("range", "levels_plain", "levels_smoothed", "err_plain", "err_smoothed")},
                         "max_range": max(r["range"] for r in per_layer),
                         "worst_layer": worst["layer"], "worst_err_plain": worst["err_plain"],
                         "worst_err_smoothed": worst["err_smoothed"], "per_layer": per_layer}
    return {"alpha": alpha, "sites": summary,
            "how": "each block's projections alone on the float model's inputs; range and smoothing factors from the "
                   "calibration windows, errors and levels on held-out evaluation windows (mean per layer)"}


def alpha_sweep(base, calibration_ids, llm, cfg: dict) -> dict:
    """Perplexity of W8A8 with SmoothQuant at each migration strength in cfg["alphas"] (fp32 model, fp32 activations
    quantised to int8), beside plain W8A8's (no smoothing) in the same run."""
    from minillm.evaluate import perplexity
    from minillm.quant import drop_fused_projections, quantize_model

    out = {}
    for alpha in (None, *cfg["alphas"]):
        model = copy.deepcopy(base)
        drop_fused_projections(model)
        quantize_model(model, "w8a8", **({} if alpha is None else {"calibration_ids": calibration_ids, "alpha": alpha}))
        llm.model = model
        out["plain" if alpha is None else str(alpha)] = perplexity(llm, window=cfg["window"], max_windows=cfg["eval_windows"])
        print(f"w8a8 alpha {alpha}: ppl {out['plain' if alpha is None else str(alpha)]:.3f}", flush=True)
    llm.model = base
    best = min((a for a in out if a != "plain"), key=out.get)
    return {"ppl": out, "best_alpha": float(best), "best_vs_plain": out[best] / out["plain"]}


def activation_speed(base, tokenizer, calibration_ids, cfg: dict) -> dict:
    """The engine (LLM, bf16 activations) on the float model, weight-only int8 (W8A16, with the int8 LM head) and
    W8A8 with SmoothQuant (its LM head W8A8), each as LLM(quantization=) serves it: prefill tok/s of one prompt of
    each length in cfg["prefill_lengths"] (max_tokens 1: prompt tokens / time to the first token), output tok/s of
    cfg["batch_rows"] equal requests (16-token prompts, cfg["batch_tokens"] tokens each) and of one request
    (cfg["decode_tokens"] tokens). Every model runs each workload in turn within a round, after a warm-up round;
    medians of cfg["speed_repeats"] rounds. Also the perplexity of each served model (cfg["chunked_windows"]
    windows) and whether its batched steps ran compiled."""
    from minillm.engine.sampling import SamplingParams
    from minillm.evaluate import evaluation_text, perplexity
    from minillm.llm import LLM
    from minillm.quant import quantize_lm_head

    ids = tokenizer.encode(evaluation_text())
    longest = max(*cfg["prefill_lengths"], cfg["window"])          # the served perplexity reads windows too
    llms = {}
    for name, key in ACTIVATION_SPEED_KEYS.items():
        model = copy.deepcopy(base).to(torch.bfloat16) if key is None else build(base, key, calibration_ids)[0]
        if key is not None:
            quantize_lm_head(model, "w8a8" if SPECS[key][0] == "w8a8" else "int8")     # as LLM(quantization=) does
        llms[name] = LLM(model=model, tokenizer=tokenizer, device="cpu", max_model_len=longest + 16)
    greedy = dict(temperature=0, ignore_eos=True)
    work = {f"prefill-{n}": ([{"prompt_token_ids": ids[:n]}], SamplingParams(max_tokens=1, **greedy), n)
            for n in cfg["prefill_lengths"]}
    for rows in cfg["batch_rows"]:
        prompts = [{"prompt_token_ids": ids[1000 + 16 * i:1016 + 16 * i]} for i in range(rows)]
        work[f"rows-{rows}"] = (prompts, SamplingParams(max_tokens=cfg["batch_tokens"], **greedy), rows * cfg["batch_tokens"])
    work["rows-1"] = ([{"prompt_token_ids": ids[:16]}], SamplingParams(max_tokens=cfg["decode_tokens"], **greedy),
                      cfg["decode_tokens"])
    times = {(name, w): [] for name in llms for w in work}
    for round_ in range(cfg["speed_repeats"] + 1):                       # round 0: warm-up (compiles)
        for w, (prompts, params, _) in work.items():
            for name, llm in llms.items():
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                if round_:
                    times[name, w].append(time.perf_counter() - t0)
    tok_s = {name: {w: tokens / statistics.median(times[name, w]) for w, (_, _, tokens) in work.items()} for name in llms}
    out = {"tok_s": tok_s, "rounds": cfg["speed_repeats"],
           "W8A8_vs_bf16": {w: tok_s["W8A8"][w] / tok_s["bf16"][w] for w in work},
           "W8A8_vs_W8A16": {w: tok_s["W8A8"][w] / tok_s["W8A16"][w] for w in work},
           "W8A16_vs_bf16": {w: tok_s["W8A16"][w] / tok_s["bf16"][w] for w in work},
           "compiled_batched_steps": {name: llm.engine.runner.compiled_batched_steps for name, llm in llms.items()},
           "ppl_served": {name: perplexity(llm, window=cfg["window"], max_windows=cfg["chunked_windows"])
                          for name, llm in llms.items()}}
    print(common.format_table([{"model": n, **{w: round(v, 1) for w, v in t.items()}} for n, t in tok_s.items()]),
          flush=True)
    return out


def int8_gemm(quick: bool) -> dict:
    """torch._int_mm (int8 x int8 -> int32) against the bf16 GEMM (F.linear) at SmolLM2's gate-up shape
    (M, 576) x (576, 3072), GFLOP/s, medians; and which 8-bit integer instructions the CPU lists
    (/proc/cpuinfo: AVX-512 VNNI, AVX-VNNI, AMX-INT8). Which of them torch's kernel uses is its own choice."""
    from minillm.kernel_support.c_library import cpu_flags
    from minillm.perf.timing import time_median

    flags = cpu_flags().split()
    w = torch.randn(3072, 576)
    qw, wb = w.to(torch.int8), w.to(torch.bfloat16)
    rows = []
    for m in ((16, 64) if quick else (16, 64, 512, 2048)):
        qx, xb = torch.randint(-127, 128, (m, 576), dtype=torch.int8), torch.randn(m, 576, dtype=torch.bfloat16)
        flops = 2 * m * 576 * 3072
        t_int = time_median(lambda: torch._int_mm(qx, qw.t()), repeats=5 if quick else 30, warmup=2)
        t_bf16 = time_median(lambda: torch.nn.functional.linear(xb, wb), repeats=5 if quick else 30, warmup=2)
        rows.append({"rows": m, "int8_GFLOP_s": flops / t_int / 1e9, "bf16_GFLOP_s": flops / t_bf16 / 1e9,
                     "int8_vs_bf16": t_bf16 / t_int})
    return {"cpu_flags": {f: f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16")}, "results": rows}


def activations(base, tokenizer, calibration_ids, rows: list[dict], cfg: dict, llm, quick: bool) -> dict:
    """The activations part's summary: perplexity of W8A8 (plain, SmoothQuant), FP8 and their bf16 peers (rows, from
    measure), the alpha sweep, the outlier sites, the engine's speed and the int8 GEMM."""
    from minillm.evaluate import token_windows, evaluation_text

    ppl = {r["method"]: r["ppl"] for r in rows}
    eval_ids = torch.tensor(token_windows(tokenizer.encode(evaluation_text()), cfg["window"], 2))
    out = {"ppl": {k: ppl[k] for k in ACTIVATION_KEYS if k in ppl}}
    if "fp32" in ppl:
        out["ppl_increase_pct"] = {k: 100 * (ppl[k] / ppl["fp32"] - 1) for k in ("w8a8", "w8a8-sq", "fp8") if k in ppl}
    if "bf16" in ppl:
        out["ppl_increase_pct_bf16"] = {k: 100 * (ppl[k] / ppl["bf16"] - 1) for k in ("int8-bf16", "w8a8-sq-bf16")
                                        if k in ppl}
    out["alpha_sweep"] = alpha_sweep(base, calibration_ids, llm, cfg)
    out["outliers"] = outlier_sites(base, calibration_ids, eval_ids, alpha=SMOOTHQUANT_ALPHA)
    out["int8_gemm"] = int8_gemm(quick)
    out["engine"] = activation_speed(base, tokenizer, calibration_ids, cfg)
    return out


def summarise(rows: list[dict]) -> dict:
    ppl = {r["method"]: r["ppl"] for r in rows}
    out = {"ppl": ppl, "vs_fp16": {r["method"]: r["vs_fp16"] for r in rows}}
    base = ppl.get("fp32")
    if base:
        out["ppl_increase_pct"] = {k: 100 * (v / base - 1) for k, v in ppl.items()}
    targets = {}
    if "int8" in ppl and base:
        targets["int8_within_1pct"] = ppl["int8"] <= 1.01 * base
    for bits, rtn in ((4, "int4-g128"), (3, "int3-g128")):
        for m in ("gptq", "awq"):
            key = f"{m}-{bits}bit-g128"
            if key in ppl and rtn in ppl:
                targets[f"{key}_below_{rtn}"] = ppl[key] < ppl[rtn]
    four_bit = [r for r in rows if r["method"] in ("int4-g128", "int4-g128-sym", "nf4", "nf4-dq",
                                                   "gptq-4bit-g128", "awq-4bit-g128")]
    if four_bit:
        targets["4bit_storage_at_most_0.30x_fp16"] = all(r["vs_fp16"] <= 0.30 for r in four_bit)
    out["targets"] = targets
    return out


def run(quick: bool, partial_path=None, part: str | None = None) -> dict:
    """partial_path: rewrite a JSON document there after every row (a long run can be inspected
    or salvaged while it is still going). part: "weights" (the weight-only rows, speed, engine, KV cache),
    "activations" (W8A8, SmoothQuant, FP8: summary.activations) or None (both)."""
    from minillm.llm import LLM
    from minillm.quant import calibration_windows

    if part not in (None, *PARTS):
        raise ValueError(f"part = {part!r}; allowed: {', '.join(map(repr, PARTS))} or none (both)")
    cfg = settings(quick)
    llm = LLM(model="smollm2", dtype="float32", device="cpu")
    base = llm.model
    tokenizer = llm.get_tokenizer()
    calibration_ids = calibration_windows(tokenizer, cfg["calib_windows"], cfg["calib_window"])
    measured = (() if part == "activations" else cfg["keys"]) + (() if part == "weights" else ACTIVATION_KEYS)
    timed = () if part == "activations" else cfg["speed_keys"]
    rows, speed_models = [], {}
    for key in dict.fromkeys(measured + timed):
        model, quant_s = build(base, key, calibration_ids)
        if key in measured:
            row = {"method": key, **measure(llm, model, cfg), "quantize_s": quant_s}
            rows.append(row)
            print(common.format_table([row]), flush=True)
        if key in timed:
            speed_models[key] = model
        del model
        if partial_path:
            common.write_json(common.document(NAME, _config(cfg, quick, part), rows, summarise(rows)), partial_path)
    llm.model = base
    summary = summarise(rows)
    if part != "activations":
        summary["speed"] = speed(speed_models, tokenizer, cfg)
        summary["engine"] = engine_throughput(speed_models, tokenizer, cfg)
        summary["kv_cache"] = kv_cache_rows(base, tokenizer, cfg)
        summary["w4a16_kernel"] = kernel_benchmark(quick)      # GPU only; says so when not measured
    if part != "weights":
        summary["activations"] = activations(base, tokenizer, calibration_ids, rows, cfg, llm, quick)
    return common.document(NAME, _config(cfg, quick, part), rows, summary)


def _config(cfg: dict, quick: bool, part: str | None = None) -> dict:
    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32: the baseline)",
            "eval": f"evaluation_text(), {cfg['eval_windows']} windows of {cfg['window']} tokens",
            "calibration": f"calibration_text(), {cfg['calib_windows']} windows of {cfg['calib_window']} tokens",
            "speed": f"batch-1 LLM.generate, 1 chat prompt, {cfg['decode_tokens']} greedy tokens (ignore_eos), "
                     f"median of {cfg['decode_repeats']} interleaved rounds after 1 warm-up round; quantised "
                     f"models with an int8 LM head, fast and reference path; perplexity in 64-token chunks over "
                     f"{cfg['chunked_windows']} windows",
            "gptq": "asymmetric, act-order, blocksize 128, damp 0.01, true-sequential",
            "awq": "asymmetric, alpha grid 0..0.95 step 0.05, clip search 10 steps; v->o pair skipped (GQA)",
            "quantized": "linear layers of the 30 blocks; tied embedding / LM head kept fp32 (bf16 in -bf16 rows); "
                         "the speed rows add LLM's int8 LM head",
            "w8a8": "per-token dynamic int8 activations x per-channel int8 weights (torch._int_mm); -sq: SmoothQuant "
                    "alpha 0.5 on the calibration windows, folded into the norms and w_up; fp8: e4m3 weights, one "
                    "scale per output channel, dequantised on this CPU (weight-only)",
            "part": part or "weights and activations", "quick": quick, **{k: v for k, v in cfg.items() if k != "keys"}}


def plot(doc: dict, path=None):
    """Perplexity against bits per parameter of the linear layers: every method (left, log axes)
    and the crowded 4-bit region (right)."""
    import matplotlib.pyplot as plt

    rows = doc["results"]
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        ax.scatter(r["bits_per_param"], r["ppl"], s=30)
        ax.annotate(r["method"], (r["bits_per_param"], r["ppl"]), fontsize=8, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bits per parameter (linear layers, scales included)")
    ax.set_ylabel("perplexity (evaluation text)")
    ax.set_title("SmolLM2-135M: weight quantisation")
    four = [r for r in rows if 3.9 <= r["bits_per_param"] <= 5]
    base = next((r["ppl"] for r in rows if r["method"] == "fp32"), None)
    for i, r in enumerate(sorted(four, key=lambda r: r["ppl"])):
        zoom.scatter(r["bits_per_param"], r["ppl"], s=30)
        zoom.annotate(r["method"], (r["bits_per_param"], r["ppl"]), fontsize=8,
                      xytext=(6, -10 if i % 2 else 4), textcoords="offset points")
    if base:
        zoom.axhline(base, color="gray", ls="--", lw=1, label="fp32 baseline")
        zoom.legend(fontsize=8, loc="upper right")
    zoom.set_xlabel("bits per parameter")
    zoom.set_title("4-bit methods")
    for a in (ax, zoom):
        a.grid(alpha=0.3, which="both")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def kernel_benchmark(quick: bool = False, device: str = "cuda", shapes=((4096, 4096), (11008, 4096), (4096, 11008)),
                     batches=None, samples: int = 50) -> dict:
    """GPU only: 4-bit weights (int4 g128 with zero points, RTN) through QuantLinear's fused Triton path
    against an fp16 matmul (cuBLAS) at decode-sized batches, for Llama-2-7B's shapes 4096 x 4096, 11008 x 4096
    and 4096 x 11008. Per row: the path the model runs (w4a16_linear: up to 8 rows the tuner times the
    split-K GEMV against the tensor-core kernel, above it the tensor-core kernel; `w4a16_kernel` says which
    ran), the first GPU run's
    kernel (tensor cores at every batch, fixed tiles, no split-K) and, at batch 1, the GEMV on each word
    layout. Every row also checks the path's output against dequantise-then-matmul in fp32 with the tests'
    tolerance ("correct"). The article's claim: 4-bit weights make decode 2-3x faster because decode moves weights.
    device="cpu" with TRITON_INTERPRET=1 and small shapes runs the same code, for the tests."""
    if device == "cuda" and not torch.cuda.is_available():
        return {"measured": False, "why": "no CUDA GPU on this machine"}
    from kernels.w4a16 import w4a16_matmul
    from kernels.w4a16_gemv import w4a16_gemv

    from minillm.quant import quantize_linear
    from minillm.kernel_support.tuning import choose_config, chosen_configs, failed_configs
    from minillm.quant.w4a16 import GEMV_CONFIGS, gemv_operands, operands, w4a16_linear
    from minillm.perf.kernel_timing import copy_bandwidth, time_kernel

    copy = copy_bandwidth(device, mbytes=1024 if device == "cuda" else 16)
    rows = []
    for out_f, in_f in shapes:
        torch.manual_seed(0)
        linear = torch.nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.float16)
        torch.nn.init.normal_(linear.weight, std=0.02)
        w = linear.weight.detach()
        layer = quantize_linear(linear, "int4", group_size=128)
        ops = operands(layer)
        int4_bytes = layer.weight_bytes()
        dequantized = layer.dequantize().to(device)                          # (out, in) fp32: the reference
        for batch in batches or ((1, 16) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)):
            x = torch.randn(batch, in_f, device=device, dtype=torch.float16)
            ref = x.float() @ dequantized.T                                  # (batch, out) fp32
            naive_err = ((x @ dequantized.half().T).float() - ref).abs().max().item()
            kernel_err = (w4a16_linear(x, layer).float() - ref).abs().max().item()   # tunes on this first call
            fp16 = time_kernel(lambda: x @ w.T, device=device, samples=samples)
            int4_t = time_kernel(lambda: w4a16_linear(x, layer), device=device, samples=samples)
            first = time_kernel(lambda: w4a16_matmul(x, ops["packed"], ops["scale"], ops["zero"], group=128),
                                device=device, samples=samples)
            fp16_s, int4_s = fp16["median_s"], int4_t["median_s"]
            row = {"shape": f"{out_f}x{in_f}", "batch": batch, "fp16_us": 1e6 * fp16_s, "w4a16_us": 1e6 * int4_s,
                   "fp16_p10_p90_us": [1e6 * fp16["p10_s"], 1e6 * fp16["p90_s"]],
                   "w4a16_p10_p90_us": [1e6 * int4_t["p10_s"], 1e6 * int4_t["p90_s"]],
                   "w4a16_kernel": layer._w4a16_config["kernel"],                 # what the tuner chose
                   "first_run_kernel_us": 1e6 * first["median_s"],
                   "max_abs_err_vs_dequantised_fp32": kernel_err,
                   # the tests' rule: within twice fp16 cuBLAS's own error plus one rounding of the output
                   "correct": kernel_err <= 2 * naive_err + torch.finfo(torch.float16).eps * ref.abs().max().item(),
                   "speedup": fp16_s / int4_s, "fp16_GB_s": out_f * in_f * 2 / 1e9 / fp16_s,
                   "w4a16_GB_s": int4_bytes / 1e9 / int4_s,
                   "w4a16_fraction_of_copy_bandwidth": int4_bytes / int4_s / copy["bytes_per_s"],
                   "fp16_TFLOP_s": 2 * batch * out_f * in_f / fp16_s / 1e12,
                   "timing": int4_t["method"]}
            if batch == 1:                                                   # the word layouts side by side
                for layout in (0, 1):
                    g = gemv_operands(layer, layout)

                    def run(config, g=g):
                        return w4a16_gemv(x, g["words"], g["scale"], g["zero"], group=128, layout=g["layout"],
                                          **{k: v for k, v in config.items() if k != "kernel"})
                    config = choose_config((f"gemv-layout-{layout}", batch, out_f, in_f, device), GEMV_CONFIGS, run)
                    row[f"gemv_layout_{layout}_us"] = 1e6 * time_kernel(lambda: run(config), device=device,
                                                                         samples=samples)["median_s"]
            rows.append(row)
        layer.__dict__.pop("_gemv_packs", None)
    return {"measured": True, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "copy_GB_s": copy["bytes_per_s"] / 1e9,
            "timing": copy["method"], "int4_bytes": "codes + fp16 scales + uint8 zero points (QuantLinear.weight_bytes)",
            "chosen_configs": chosen_configs(), "failed_configs": failed_configs(), "results": rows}


def end_to_end_decode(shape: str = "llama2-7b", device: str = "cuda", new_tokens: int = 64, prompt_tokens: int = 16,
                      cfg=None, repeats: int = 3, tune_kernels: bool = True) -> dict:
    """Batch-1 greedy decode of a random-weight model of a published shape (model.llama.published_model; or
    `cfg`, for a small check on CPU) with fp16 weights, then the same model with int4 g128 (RTN) weights:
    tokens/s of each (median of `repeats` runs after a warm-up, the clock read after a synchronize) and
    the weight bytes each reads per token. Both run the same cached forward (kv_cache.generate_greedy,
    the modules as they are), so only the weights differ; on CUDA the int4 layers run the fused W4A16 kernel.
    tune_kernels: passed to the engine (False: its build times nothing, e.g. a CPU smoke run, where the
    timing step would compile both 2-byte builds of the decode step)."""
    from minillm.stages.kv_cache import generate_greedy
    from minillm.model.llama import published_model, random_model_on
    from minillm.quant import quantize_model
    from . import gpu_engine
    from .batching import run_engine

    model = (random_model_on(cfg, device, torch.float16) if cfg is not None
             else published_model(shape, device, torch.float16))
    prompt = list(range(1, prompt_tokens + 1))

    def weight_bytes() -> int:
        return sum(t.numel() * t.element_size() for t in (*model.layers.parameters(), *model.layers.buffers()))

    graphs = str(device).startswith("cuda") and gpu_engine.has_enforce_eager()
    row = {"shape": shape if cfg is None else "custom", "device": str(device), "new_tokens": new_tokens,
           "timing": f"perf_counter around {new_tokens}-token decodes, synchronized, median of {repeats} after a warm-up",
           "engine_mode": "CUDA graphs" if graphs else "eager",
           "engine_timing": f"decode tok/s = 1 / time per output token of one {new_tokens}-token request through "
                            f"the engine (LLM, max_num_seqs=1), median of {repeats} after a warm-up"}
    for weights in ("fp16", "int4"):
        if weights == "int4":
            quantize_model(model, "int4", group_size=128)
        greedy = generate_greedy(model, [prompt], new_tokens)[0]             # warm-up (tunes the kernels)
        seconds = common.time_median(lambda: generate_greedy(model, [prompt], new_tokens), repeats=repeats,
                                      warmup=0, device=device)
        row[f"{weights}_tok_s"] = new_tokens / seconds
        row[f"{weights}_layer_weight_GB"] = weight_bytes() / 1e9
        # The same model in the engine: with CUDA graphs one replay per token, so launches stop hiding the weights
        llm = gpu_engine.make_llm(model, torch.device(device), eager=not graphs, tune_kernels=tune_kernels,
                                  max_model_len=prompt_tokens + new_tokens + 1, max_num_seqs=1)
        runs = [run_engine(llm, [prompt], [new_tokens]) for _ in range(repeats + 1)][1:]
        row[f"{weights}_engine_tok_s"] = 1 / statistics.median(r["tpot"][0] for r in runs)
        row[f"{weights}_engine_graph_replays"] = gpu_engine.graph_replays(llm)
        row[f"{weights}_engine_tokens_equal_greedy"] = runs[0]["tokens"][0] == greedy
        del llm, runs
        gpu_engine.free(torch.device(device))
    row["int4_vs_fp16"] = row["int4_tok_s"] / row["fp16_tok_s"]
    row["int4_vs_fp16_engine"] = row["int4_engine_tok_s"] / row["fp16_engine_tok_s"]
    return row
