"""Pitfall 5, fp16 instead of bf16: SmolLM2's real activations against each format's range.

A float32 forward over the evaluation text records every layer's largest activation (residual stream,
FFN hidden) and the share of values below fp16's smallest normal; the same weights run in bf16 and fp16
give the logit error, overflow and underflow counts, top-1 agreement and perplexity against float32.
No timing: every number is a value of the model, so it does not depend on the machine's speed.
"""
from __future__ import annotations

import torch

from minillm.evaluate import evaluation_text, token_windows
from minillm.quant.precision import BF16, FP16, measure, overflow_scale
from .common import document, quick_mode

NAME = "precision"


def run(quick: bool) -> dict:
    from minillm import LLM

    quick = quick or quick_mode()
    windows, window = (1, 128) if quick else (2, 512)
    llm = LLM(model="smollm2", dtype="float32", device="cpu")
    ids = llm.get_tokenizer().encode(evaluation_text())
    tokens = torch.tensor(token_windows(ids, window, windows))           # (windows, window)
    ranges, runs = measure(llm.model, tokens)
    results = [{"part": "layer", **vars(r)} for r in ranges] + [{"part": "dtype", **vars(r)} for r in runs]
    by = {r.dtype: r for r in runs}
    summary = {
        "fp16_max": FP16.max, "fp16_smallest_normal": FP16.smallest_normal, "bf16_max": BF16.max,
        "largest_activation": max(max(r.residual_max, r.ffn_hidden_max) for r in ranges),
        "largest_activation_layer": max(ranges, key=lambda r: max(r.residual_max, r.ffn_hidden_max)).layer,
        "fp16_overflow_headroom": overflow_scale(ranges),
        "max_share_below_fp16_normal": max(r.below_fp16_normal for r in ranges),
        "perplexity": {d: r.perplexity for d, r in by.items()},
        "argmax_agreement": {d: r.argmax_agreement for d, r in by.items() if d != "float32"},
        "logit_rel_err": {d: r.logit_rel_err for d, r in by.items() if d != "float32"},
        "nonfinite": {d: r.nonfinite_activations for d, r in by.items() if d != "float32"},
    }
    plot(ranges, "results/precision.png")
    config = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32)", "text": "evaluation_text()",
              "windows": windows, "window": window, "plot": "results/precision.png",
              "note": "became_zero counts values nonzero in fp32 and exactly zero in the 16-bit run "
                      "(underflow or cancellation)"}
    return document(NAME, config, results, summary)


def plot(ranges, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    layers = [r.layer for r in ranges]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.semilogy(layers, [r.residual_max for r in ranges], "o-", label="max |residual stream|")
    ax.semilogy(layers, [r.ffn_hidden_max for r in ranges], "s-", label="max |FFN hidden|")
    ax.axhline(FP16.max, color="red", ls="--", label="fp16 largest (65504)")
    ax.axhline(FP16.smallest_normal, color="orange", ls=":", label="fp16 smallest normal (6.1e-5)")
    ax.set_xlabel("layer")
    ax.set_ylabel("|activation| (log)")
    ax.set_title("SmolLM2-135M activations vs fp16's range (bf16 reaches 3.4e38)")
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
