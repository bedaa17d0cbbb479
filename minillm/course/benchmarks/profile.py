"""Where a decode step's time goes: torch.profiler over LLM.generate, time per token by op class.

    python -m minillm bench profile [--quick] [--json results/profile.json]

Configurations: batch 1 on LLM's contiguous path (fp32 and bf16 on the compiled float step; the bf16
model with int8 and with int4 weights on the compiled step over packed weights), and the batching engine
with 16 and 48 equal requests (fp32 and bf16). Each runs once to warm up (compiles), then once under the
profiler. A short prompt and many new tokens, so the prompt is a small share; it is included.

Every op's *self* time (its own time, children excluded, so nothing is counted twice) goes to one class:

    weight matmuls   aten mm / addmm / mv / linear / mkldnn, the int8 / int4 packed-weight kernels, the prepacked
                     GEMM and the few-row kernel (minillm ops)
    attention        torch's fused SDPA, bmm / baddbmm, softmax
    compiled code    the self time of a torch.compile region: the C++ loops Inductor generated (batch 1:
                     the norms, RoPE, row-wise GEMVs and attention of the compiled step; the engine: its
                     fused decode attention); their extern calls (the packed kernels) are ops of their
                     own and counted above
    copies, gathers  copy_, index / index_select / index_put_, cat, gather, clone, to, contiguous, ...
    other ops        every other aten op (elementwise, argmax, sampling, ...)
    outside ops      wall time minus all op time: Python (the scheduler, the runner, the sampler's
                     Python), the profiler's own cost, and anything the profiler does not see

The profiler adds its own overhead (more ops, more of it), so ms per token here is above the plain
timing of other benchmarks; the shares are what this measures.

What a faster quantised GEMV alone could buy (summary.read_at_bandwidth): for each quantised batch-1
model, its ms per token with the weight matmuls' time replaced by reading the bytes a decode step reads
(quant.decode_step_bytes) at the fastest bandwidth sampled in this run (roofline.BandwidthProbe, after
every batch-1 configuration), everything else as profiled; against the bf16 model's profiled ms per
token. A kernel cannot read faster than that, so if even this ratio is below a goal, the goal needs
less work around the matmuls too, not only a better kernel.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from . import common

NAME = "profile"

CLASSES = ("weight matmuls", "attention", "compiled code", "copies, gathers", "other ops", "outside ops")
MATMUL = ("aten::mm", "aten::addmm", "aten::mv", "aten::linear", "aten::matmul", "aten::_weight_int8pack_mm",
          "aten::_weight_int4pack_mm_for_cpu", "aten::dot")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
             "aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::softmax", "aten::_safe_softmax",
             "minillm::cpu_decode_attention")
COPIES = ("aten::copy_", "aten::index", "aten::index_select", "aten::index_put_", "aten::_index_put_impl_",
          "aten::cat", "aten::gather", "aten::scatter", "aten::scatter_", "aten::clone", "aten::to",
          "aten::_to_copy", "aten::contiguous", "aten::stack", "aten::embedding", "aten::take")
COMPILED = ("Torch-Compiled Region", "CompiledFxGraph", "## Call CompiledFxGraph", "CompiledFunction")


def op_class(name: str) -> str:
    if name in MATMUL or name.startswith(("mkldnn::", "mkl::", "aten::mkldnn", "quantized::", "minillm::prepacked_linear",
                                          "minillm::blocked_gemm")):
        return "weight matmuls"
    if name in ATTENTION:
        return "attention"
    if any(name.startswith(c) for c in COMPILED) or name.startswith("cpp_fused") or name.startswith("graph_"):
        return "compiled code"
    if name in COPIES:
        return "copies, gathers"
    if name.startswith("aten::") or name.startswith("prims::"):
        return "other ops"
    return "outside ops"          # user annotations (record_function ranges): Python between the ops


def settings(quick: bool) -> dict:
    if quick:
        return dict(new_tokens=4, engine_tokens=4, batches=(4,), batch1=("float32", "bfloat16", "int4-bf16"),
                    engine_dtypes=("float32",))
    return dict(new_tokens=64, engine_tokens=32, batches=(16, 48),
                batch1=("float32", "bfloat16", "int8-bf16", "int4-bf16"), engine_dtypes=("float32", "bfloat16"))


def build(base, key: str):
    """The fp32 base model, the bf16 copy, or the bf16 copy quantised (LLM's CPU default: int8 LM head)."""
    from minillm.quant import quantize_model

    model = copy.deepcopy(base)
    if key.endswith("bf16") or key == "bfloat16":
        model.to(torch.bfloat16)
    if key in ("int8-bf16", "int4-bf16"):
        from minillm.quant import drop_fused_projections
        drop_fused_projections(model)
        quantize_model(model, key.split("-")[0], group_size=128, lm_head="int8")
    return model


def profile_generate(llm, prompts: list, params) -> dict:
    """Warm-up, then one profiled llm.generate: ms per generated token, in total and by class."""
    from torch.profiler import ProfilerActivity, profile

    llm.generate(prompts, params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    by_class = dict.fromkeys(CLASSES, 0.0)
    for event in prof.key_averages():
        by_class[op_class(event.key)] += event.self_cpu_time_total / 1e3        # us -> ms
    inside = sum(by_class.values()) - by_class["outside ops"]
    by_class["outside ops"] = max(0.0, wall * 1e3 - inside)
    row = {"tokens": tokens, "ms_per_token": 1e3 * wall / tokens}
    row.update({f"{c} ms": v / tokens for c, v in by_class.items()})
    row.update({f"{c} %": 100 * v / (wall * 1e3) for c, v in by_class.items()})
    return row


def read_at_bandwidth(rows: list[dict], step_bytes: dict[str, int], bandwidth: float) -> dict:
    """rows: batch-1 profile rows, one with model "bfloat16"; step_bytes: model -> weight bytes a decode
    token reads, for the quantised models; bandwidth in bytes/s. -> per quantised model: its ms per token
    as profiled and as it would be with its weight matmuls reading at `bandwidth`, both against bf16."""
    bf16 = next(r for r in rows if r["batch"] == 1 and r["model"] == "bfloat16")["ms_per_token"]
    out = {}
    for r in rows:
        if r["batch"] != 1 or r["model"] not in step_bytes:
            continue
        read_ms = 1e3 * step_bytes[r["model"]] / bandwidth
        best = r["ms_per_token"] - r["weight matmuls ms"] + read_ms
        out[r["model"]] = {"weight_MB": step_bytes[r["model"]] / 1e6,
                           "weight_matmuls_ms": r["weight matmuls ms"],
                           "weight_matmuls_GBps": step_bytes[r["model"]] / r["weight matmuls ms"] / 1e6,
                           "read_at_bandwidth_ms": read_ms, "ms_per_token": r["ms_per_token"],
                           "ms_per_token_if_read_at_bandwidth": best,
                           "vs_bf16": bf16 / r["ms_per_token"], "vs_bf16_if_read_at_bandwidth": bf16 / best}
    return out


def run(quick: bool, json_path: str | None = None) -> dict:
    """json_path: where the document will be written; the figure goes beside it (x.json -> x.png)."""
    from minillm.perf import roofline
    from minillm.llm import LLM
    from minillm.quant import decode_step_bytes
    from minillm.quant.linear import QuantLinear
    from minillm.engine.sampling import SamplingParams

    cfg = settings(quick)
    base_llm = LLM(model="smollm2", dtype="float32", device="cpu")
    base, tokenizer = base_llm.model, base_llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse."}])
    rows, step_bytes = [], {}
    probe = roofline.BandwidthProbe(256 if quick else 512, dtype=torch.bfloat16)
    probe.sample()
    for key in cfg["batch1"]:
        model = build(base, key)
        if any(isinstance(m, QuantLinear) for m in model.modules()):
            step_bytes[key] = decode_step_bytes(model)
        llm = LLM(model=model, tokenizer=tokenizer, device="cpu")
        params = SamplingParams(temperature=0, max_tokens=cfg["new_tokens"], ignore_eos=True)
        row = {"config": f"batch 1, {key}", "batch": 1, "model": key, **profile_generate(llm, [prompt], params)}
        rows.append(row)
        probe.sample()
        print(common.format_table([row], ["config", "ms_per_token"] + [f"{c} %" for c in CLASSES]), flush=True)
    words = tokenizer.encode(" ".join(["the lighthouse keeper wrote a letter to the sea"] * 3))[:16]
    for dtype in cfg["engine_dtypes"]:
        for batch in cfg["batches"]:
            llm = LLM(model=build(base, dtype), tokenizer=tokenizer, device="cpu", max_num_seqs=batch)
            params = SamplingParams(temperature=0, max_tokens=cfg["engine_tokens"], ignore_eos=True)
            prompts = [{"prompt_token_ids": words} for _ in range(batch)]
            row = {"config": f"engine, {batch} requests, {dtype}", "batch": batch, "model": dtype,
                   **profile_generate(llm, prompts, params)}
            rows.append(row)
            print(common.format_table([row], ["config", "ms_per_token"] + [f"{c} %" for c in CLASSES]), flush=True)
    path = common.figure_path(json_path, "", "profile.png", quick)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    plot(rows, path)
    config = {"model": "SmolLM2-135M-Instruct", "prompt_tokens": len(prompt), **cfg, "plot": str(path),
              "quick": quick}
    summary = {"shares_pct": {r["config"]: {c: r[f"{c} %"] for c in CLASSES} for r in rows},
               "bandwidth_GBps": probe.best / 1e9, "bandwidth_samples_GBps": [b / 1e9 for b in probe.samples],
               "read_at_bandwidth": read_at_bandwidth(rows, step_bytes, probe.best)}
    return common.document(NAME, config, rows, summary)


def plot(rows: list[dict], path) -> None:
    """A stacked bar per configuration: ms per generated token, by op class."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [r["config"] for r in rows]
    bottom = [0.0] * len(rows)
    for c in CLASSES:
        values = [r[f"{c} ms"] for r in rows]
        ax.barh(labels, values, left=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per generated token (under the profiler)")
    ax.set_title("SmolLM2-135M decode on this CPU: where the time goes")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
