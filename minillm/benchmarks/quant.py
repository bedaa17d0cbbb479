"""Weight quantisation on SmolLM2: perplexity, weight bytes and decode speed per method.

    python -m minillm bench quant [--quick] [--json results/quant.json]

Baseline caveat: the "fp32" model is SmolLM2's Q4_1 GGUF dequantised, so its weights already
sit on a 16-level grid per block of 32 (Q4_1: llama.cpp's block_q4_1, read by minillm/gguf_file.py).
Asymmetric int4 with group 32, aligned to those blocks, can nearly reproduce it; the main
comparisons use group 128 (and a g32 row shows the effect). Every method quantises only the
linear layers in the 30 blocks; the tied embedding / LM head stays fp32 in every row.

Perplexity: evaluation_text() (never used for calibration) in 512-token windows, through
LLM.generate's prompt_logprobs. GPTQ / AWQ calibrate on windows of calibration_text().
Decode tokens/s: LLM.generate on one short prompt, greedy, whatever runner LLM has. On a CPU a
QuantLinear multiplies by its packed int8 / int4 weight with torch's kernels (minillm/quant/
cpu_kernels.py; vectorised for bf16 activations, scalar loops for fp32); decode_tok_s_reference is
the same row on the reference path (dequantise W on every call, then F.linear), timed alternating
with it. Rows ending in -bf16 quantise the bf16 model and run bf16 activations.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch

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
}
BF16_KEYS = ("bf16", "int8-bf16", "int4-g128-bf16")     # the bf16 model: weights and activations
QUICK_KEYS = ("fp32", "int8", "int4-g128", "nf4", "gptq-4bit-g128", "awq-4bit-g128", "int4-g128-bf16")
FULL_ORDER = ("fp32", "int8", "int4-g128", "nf4", "gptq-4bit-g128", "awq-4bit-g128", "int3-g128", "gptq-3bit-g128",
              "awq-3bit-g128", "int4-g128-sym", "nf4-dq", "bf16", "int4-g32", "int8-bf16", "int4-g128-bf16")


def settings(quick: bool) -> dict:
    if quick:
        return dict(eval_windows=1, window=128, calib_windows=2, calib_window=128, decode_tokens=4,
                    decode_repeats=1, keys=QUICK_KEYS)
    return dict(eval_windows=8, window=512, calib_windows=4, calib_window=512, decode_tokens=8,
                decode_repeats=1, keys=FULL_ORDER)


def build(base, key: str, calibration_ids) -> tuple[torch.nn.Module, float]:
    """A (quantised) copy of the fp32 base model, bf16 for BF16_KEYS, and the seconds quantisation took."""
    from ..quant import drop_fused_projections, quantize_model

    model = copy.deepcopy(base)
    drop_fused_projections(model)          # every row runs LLM's cached forward (not the fused fast path)
    if key in BF16_KEYS:
        model.to(torch.bfloat16)
    spec = SPECS[key]
    if spec is None:
        return model, 0.0
    method, kwargs = spec
    t0 = time.perf_counter()
    if method in ("gptq", "awq"):
        kwargs = dict(kwargs, calibration_ids=calibration_ids)
    quantize_model(model, method, **kwargs)
    return model, time.perf_counter() - t0


def measure(llm, model, cfg: dict) -> dict:
    from ..evaluate import perplexity
    from ..quant import weight_bytes
    from ..quant.linear import QuantLinear
    from ..sampling import SamplingParams

    llm.model = model
    ppl = perplexity(llm, window=cfg["window"], max_windows=cfg["eval_windows"])
    sizes = weight_bytes(model)
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "What is a quantised model?"}])
    params = SamplingParams(temperature=0, max_tokens=cfg["decode_tokens"], ignore_eos=True)
    has_kernels = any(isinstance(m, QuantLinear) and m.cpu_unsupported is None for m in model.modules())
    seconds = decode_seconds(lambda: llm.generate([prompt], params, use_tqdm=False), cfg["decode_repeats"],
                             reference=has_kernels)
    return {"ppl": ppl, "linear_MB": sizes["linear_bytes"] / 1e6, "bits_per_param": sizes["bits_per_param"],
            "vs_fp16": sizes["bits_per_param"] / 16, "model_MB": sizes["model_bytes"] / 1e6,
            **{key: cfg["decode_tokens"] / s for key, s in seconds.items()}}


def decode_seconds(generate, repeats: int, reference: bool) -> dict:
    """Median seconds of generate() on the default path ("decode_tok_s": the CPU kernels where they
    apply) and, if reference, on the reference path too ("decode_tok_s_reference"), the two paths
    alternating run by run so that a drift in machine load hits both."""
    from ..quant.cpu_kernels import reference_path

    paths = {"decode_tok_s": contextlib.nullcontext}
    if reference:
        paths["decode_tok_s_reference"] = reference_path
    times = {key: [] for key in paths}
    for run in range(repeats + 1):                        # run 0: warm-up
        for key, path in paths.items():
            with path():
                t0 = time.perf_counter()
                generate()
                if run:
                    times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}


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


def run(quick: bool, partial_path=None) -> dict:
    """partial_path: rewrite a JSON document there after every row (a long run can be inspected
    or salvaged while it is still going)."""
    from ..llm import LLM
    from ..quant import calibration_windows

    cfg = settings(quick)
    llm = LLM(model="smollm2", dtype="float32", device="cpu")
    base = llm.model
    calibration_ids = calibration_windows(llm.get_tokenizer(), cfg["calib_windows"], cfg["calib_window"])
    rows = []
    for key in cfg["keys"]:
        model, quant_s = build(base, key, calibration_ids)
        row = {"method": key, **measure(llm, model, cfg), "quantize_s": quant_s}
        rows.append(row)
        print(common.format_table([row]), flush=True)
        if partial_path:
            common.write_json(common.document(NAME, _config(cfg, quick), rows, summarise(rows)), partial_path)
    llm.model = base
    summary = summarise(rows)
    summary["w4a16_kernel"] = kernel_benchmark(quick)      # GPU only; says so when not measured
    return common.document(NAME, _config(cfg, quick), rows, summary)


def _config(cfg: dict, quick: bool) -> dict:
    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32: the baseline)",
            "eval": f"evaluation_text(), {cfg['eval_windows']} windows of {cfg['window']} tokens",
            "calibration": f"calibration_text(), {cfg['calib_windows']} windows of {cfg['calib_window']} tokens",
            "decode": f"LLM.generate (cached forward, fused fast path off for every row), 1 prompt, "
                      f"{cfg['decode_tokens']} greedy tokens, median of {cfg['decode_repeats']} after 1 warm-up; "
                      f"rows with CPU kernels also on the reference path, alternating",
            "gptq": "asymmetric, act-order, blocksize 128, damp 0.01, true-sequential",
            "awq": "asymmetric, alpha grid 0..0.95 step 0.05, clip search 10 steps; v->o pair skipped (GQA)",
            "quantized": "linear layers of the 30 blocks; tied embedding / LM head kept fp32 (bf16 in -bf16 rows)",
            "quick": quick, **{k: v for k, v in cfg.items() if k != "keys"}}


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


def kernel_benchmark(quick: bool = False) -> dict:
    """GPU only: the fused W4A16 Triton kernel against an fp16 matmul (cuBLAS) at decode-sized
    batches, for 4096 x 4096 and 11008 x 4096 weights (Llama-7B's attention and FFN shapes).
    The article's claim: 4-bit weights make decode 2-3x faster because decode moves weights."""
    if not torch.cuda.is_available():
        return {"measured": False, "why": "no CUDA GPU on this machine"}
    from kernels.w4a16 import w4a16_matmul
    from ..quant import int4

    rows = []
    for out_f, in_f in ((4096, 4096), (11008, 4096)):
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.float16) * 0.02
        t = int4.quantize(w.float(), 4, 128, symmetric=False)
        for batch in ((1, 16) if quick else (1, 2, 4, 8, 16)):
            x = torch.randn(batch, in_f, device="cuda", dtype=torch.float16)
            fp16_s = common.time_median(lambda: x @ w.T, repeats=50, warmup=10, device="cuda")
            int4_s = common.time_median(lambda: w4a16_matmul(x, t["packed"], t["scale"], t["zero"], group=128),
                                        repeats=50, warmup=10, device="cuda")
            weight_gb = out_f * in_f * 2 / 1e9
            rows.append({"shape": f"{out_f}x{in_f}", "batch": batch, "fp16_us": 1e6 * fp16_s, "w4a16_us": 1e6 * int4_s,
                         "speedup": fp16_s / int4_s, "fp16_GB_s": weight_gb / fp16_s})
    return {"measured": True, "gpu": torch.cuda.get_device_name(0), "results": rows}
