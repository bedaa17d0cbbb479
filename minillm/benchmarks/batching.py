"""Lesson 07: continuous batching vs one-at-a-time and static batching, on SmolLM2, one run.

Workload (offline: every request arrives at t = 0, greedy, ignore_eos so each request gets
exactly the tokens it asks for): chat prompts that share one system prompt, followed by a
passage of Python's documentation; prompt lengths log-uniform in [64, 512] tokens, output
lengths log-uniform in [16, 256] tokens. Quick mode shrinks all of it.

Systems, all in one dtype (`--dtype`, bfloat16 by default: this CPU multiplies bf16 matrices
with AMX, ~9x its fp32 GEMM rate, so bf16 is how one would serve on it; every system, transformers
included, runs in the same dtype):
  (a) hf_sequential   transformers' generate, one request at a time (KV cache on)
  (b) hf_batched      transformers' generate on left-padded batches of HF_BATCH requests; each
                      batch runs until its longest request is done
  (c) static          minillm's static batching (minillm/static_batching.py), same batches
  (d) continuous      minillm's engine, whole prompts per step (chunked prefill off)
  (e) continuous_chunked_prefix   the engine with chunked prefill and prefix caching on

The systems run interleaved in rounds (see run()), because this VM's speed drifts over minutes.
Throughput counts only the tokens the requests asked for (tokens a padded row computes after
its request is done are waste, not output). TTFT is first token time - arrival; TPOT is the
mean time between a request's output tokens.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from .common import document

NAME = "batching"
HF_BATCH = 16
SYSTEM = ("You are a careful assistant for Python programmers. Answer precisely, quote the "
          "documentation when it helps, and keep answers short.")


def make_workload(tokenizer, num_requests: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int = 0) -> tuple[list[list[int]], list[int]]:
    from ..evaluate import evaluation_text

    rng = np.random.default_rng(seed)
    body = tokenizer.encode(evaluation_text())
    head = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise this passage:"}],
        add_generation_prompt=False).rsplit("<|im_end|>", 1)[0] + "\n")
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
    prompts, outputs = [], []
    for _ in range(num_requests):
        n = int(math.exp(rng.uniform(*np.log(prompt_range))))
        start = int(rng.integers(0, len(body) - n))
        prompts.append(head + body[start:start + max(1, n - len(head) - len(tail))] + tail)
        outputs.append(int(math.exp(rng.uniform(*np.log(output_range)))))
    return prompts, outputs


def percentiles(values) -> dict:
    v = np.asarray([x for x in values if x is not None], dtype=float)
    return {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))} if v.size else {}


def summarise(name, wall, useful, ttft, tpot, extra=None) -> dict:
    row = {"system": name, "seconds": wall, "output_tokens": useful, "output_tok_s": useful / wall,
           "ttft_p50_s": percentiles(ttft).get("p50"), "ttft_p99_s": percentiles(ttft).get("p99"),
           "tpot_p50_ms": 1e3 * percentiles(tpot).get("p50", float("nan")),
           "tpot_p99_ms": 1e3 * percentiles(tpot).get("p99", float("nan"))}
    row.update(extra or {})
    return row


class StepClock:
    """A transformers logits processor that only records when each decoding step happens."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_hf(hf, prompts, outputs, batch_size: int, pad_id: int) -> dict:
    from transformers import LogitsProcessorList

    t0 = time.perf_counter()
    ttft, tpot, tokens = [], [], []
    for first in range(0, len(prompts), batch_size):
        idx = list(range(first, min(first + batch_size, len(prompts))))
        longest = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), longest), pad_id)                    # left padding
        mask = torch.zeros(len(idx), longest, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[b, longest - len(prompts[i]):] = 1
        steps = max(outputs[i] for i in idx)
        clock = StepClock()
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
        for b, i in enumerate(idx):
            tokens.append(gen[b, longest:longest + outputs[i]].tolist())
            ttft.append(clock.times[0] - t0)
            own = clock.times[:outputs[i]]
            tpot.append((own[-1] - own[0]) / (len(own) - 1) if len(own) > 1 else None)
    wall = time.perf_counter() - t0
    return {"wall": wall, "ttft": ttft, "tpot": tpot, "tokens": tokens}


def run_static(model, prompts, outputs, batch_size: int) -> dict:
    from ..static_batching import generate_static

    t0 = time.perf_counter()
    res = generate_static(model, prompts, outputs, batch_size)
    wall = time.perf_counter() - t0
    ttft = [t - t0 for t in res["first_token_time"]]
    tpot = [(f - s) / (n - 1) if n > 1 else None
            for f, s, n in zip(res["finish_time"], res["first_token_time"], outputs)]
    return {"wall": wall, "ttft": ttft, "tpot": tpot, "tokens": res["token_ids"],
            "useful": res["useful_tokens"], "computed": res["computed_tokens"],
            "waste": 1 - res["useful_tokens"] / res["computed_tokens"]}


def run_engine(llm, prompts, outputs) -> dict:
    from .. import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    reqs = llm.make_requests([{"prompt_token_ids": p} for p in prompts], params)
    engine = llm.engine
    engine.step_log.clear()
    t0 = time.time()
    p0 = time.perf_counter()
    for r in reqs:
        r.metrics.arrival_time = t0
    engine.run(reqs)
    wall = time.perf_counter() - p0
    return {"wall": wall, "ttft": [r.metrics.time_to_first_token for r in reqs],
            "tpot": [r.metrics.time_per_output_token for r in reqs],
            "tokens": [r.output_token_ids for r in reqs], "steps": list(engine.step_log), "t0": p0,
            "cached": sum(r.num_cached_tokens for r in reqs), "preempted": sum(r.num_preemptions for r in reqs)}


def merge_slices(slices: list[dict]) -> dict:
    """Results of consecutive slices of one workload -> one result, as if run back to back."""
    merged = {"wall": 0.0, "ttft": [], "tpot": [], "tokens": []}
    for r in slices:
        merged["ttft"] += [merged["wall"] + t for t in r["ttft"]]
        merged["wall"] += r["wall"]
        merged["tpot"] += r["tpot"]
        merged["tokens"] += r["tokens"]
        for key in ("useful", "computed"):
            if key in r:
                merged[key] = merged.get(key, 0) + r[key]
    return merged


def fresh_engine(llm):
    """The same LLM with a new engine on first use: an empty KV pool and prefix cache."""
    llm._engine = None
    return llm


def _plot(steps, t0, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["time"] - t0 for s in steps]
    dec = [s["num_decodes"] for s in steps]
    pre = [s["num_tokens"] - s["num_decodes"] for s in steps]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 4.5), sharex=True)
    a.plot(t, [s["num_running"] for s in steps], label="running requests")
    a.plot(t, [s["num_waiting"] for s in steps], label="waiting requests")
    a.set_ylabel("requests"); a.legend(fontsize=8)
    b.plot(t, dec, ".", ms=3, label="decode tokens")
    b.plot(t, pre, ".", ms=3, label="prefill tokens")
    b.set_yscale("symlog"); b.set_ylabel("tokens in the step"); b.set_xlabel("seconds")
    b.legend(fontsize=8)
    fig.suptitle("continuous batching + chunked prefill + prefix caching: every step")
    fig.tight_layout(); fig.savefig(path, dpi=120); plt.close(fig)


def run(quick: bool, dtype: str = "bfloat16") -> dict:
    import os

    from .. import LLM
    from .kv_cache import dense_hf_model

    n, prange, orange = (6, (64, 160), (4, 16)) if quick else (64, (16, 512), (16, 256))
    base = LLM(model="smollm2", dtype=dtype, device="cpu", max_num_seqs=64,
               max_num_batched_tokens=2048, enable_chunked_prefill=False)
    tok = base.get_tokenizer()
    prompts, outputs = make_workload(tok, n, prange, orange)
    hf = dense_hf_model(getattr(torch, dtype))
    # warm-up: one short request through every system
    run_hf(hf, prompts[:1], [2], 1, tok.eos_token_id)
    run_static(base.model, prompts[:1], [2], 1)
    run_engine(base, prompts[:1], [2])
    # Interleaved rounds: this VM's speed drifts by up to +-30% over minutes, so no system may run
    # all of its work in a different stretch of time from the others. Round r runs slice r of the
    # workload (HF_BATCH requests) through (a), (b), (c), then the WHOLE workload through (d) and
    # (e). A sliced system's time is the sum of its slices (its TTFT: as if the slices ran back to
    # back from t = 0); (d) and (e) report their median run.
    rounds = [range(first, min(first + HF_BATCH, n)) for first in range(0, n, HF_BATCH)]
    sliced = {"hf_sequential": lambda idx: run_hf(hf, [prompts[i] for i in idx], [outputs[i] for i in idx], 1,
                                                  tok.eos_token_id),
              "hf_batched": lambda idx: run_hf(hf, [prompts[i] for i in idx], [outputs[i] for i in idx], HF_BATCH,
                                               tok.eos_token_id),
              "static": lambda idx: run_static(base.model, [prompts[i] for i in idx], [outputs[i] for i in idx],
                                               HF_BATCH)}
    best = LLM(model=base.model, tokenizer=base.tokenizer, device="cpu", max_num_seqs=64, max_num_batched_tokens=512,
               enable_chunked_prefill=True, enable_prefix_caching=True)    # same weights, (e)'s settings
    parts = {name: [] for name in sliced}
    engine_runs = {"continuous": [], "continuous_chunked_prefix": []}
    for idx in rounds:
        for name, fn in sliced.items():
            parts[name].append(fn(idx))
        engine_runs["continuous"].append(run_engine(base, prompts, outputs))
        best = fresh_engine(best)
        run_engine(best, prompts[:1], [2])                              # warm-up (and caches the system prompt)
        engine_runs["continuous_chunked_prefix"].append(run_engine(best, prompts, outputs))
    results, tokens = [], {}
    for name, slices in parts.items():
        r = merge_slices(slices)
        tokens[name] = r["tokens"]
        extra = {"padding_waste": 1 - r["useful"] / r["computed"]} if "useful" in r else {}
        results.append(summarise(name, r["wall"], sum(outputs), r["ttft"], r["tpot"], extra))
    for name, runs in engine_runs.items():
        r = sorted(runs, key=lambda x: x["wall"])[len(runs) // 2]
        tokens[name] = r["tokens"]
        extra = {"runs_s": [x["wall"] for x in runs]}
        if name == "continuous_chunked_prefix":
            extra["prefix_cached_tokens"] = r["cached"]
        results.append(summarise(name, r["wall"], sum(outputs), r["ttft"], r["tpot"], extra))
    plot = "results/quick/batching-steps.png" if quick else "results/batching-steps.png"
    os.makedirs(os.path.dirname(plot), exist_ok=True)
    _plot(r["steps"], r["t0"], plot)
    # the knobs of pitfall 6, one at a time around the engine's defaults
    knobs = []
    if not quick:
        for knob, values in (("max_num_seqs", [4, 16, 64]), ("max_num_batched_tokens", [128, 512, 2048]),
                             ("block_size", [8, 16, 64])):
            for value in values:
                args = dict(max_num_seqs=64, max_num_batched_tokens=512, block_size=16,
                            enable_chunked_prefill=True, enable_prefix_caching=True)
                args[knob] = value
                llm = LLM(model="smollm2", dtype=dtype, device="cpu", **args)
                run_engine(llm, prompts[:1], [2])
                k = run_engine(llm, prompts, outputs)
                knobs.append({"knob": knob, "value": value, "output_tok_s": sum(outputs) / k["wall"],
                              "ttft_p50_s": percentiles(k["ttft"])["p50"],
                              "tpot_p50_ms": 1e3 * percentiles(k["tpot"])["p50"], "preemptions": k["preempted"]})
                del llm
    by = {row["system"]: row["output_tok_s"] for row in results}
    same = {name: float(np.mean([a == b for a, b in zip(tokens[name], tokens["static"])])) for name in tokens}
    summary = {"ratio_continuous_vs_hf_sequential": by["continuous"] / by["hf_sequential"],
               "ratio_continuous_vs_hf_batched": by["continuous"] / by["hf_batched"],
               "ratio_continuous_vs_static": by["continuous"] / by["static"],
               "ratio_chunked_prefix_vs_static": by["continuous_chunked_prefix"] / by["static"],
               "output_tok_s": by, "requests_with_tokens_equal_to_static": same, "knobs": knobs}
    config = {"requests": n, "prompt_tokens": prange, "output_tokens": orange, "hf_batch": HF_BATCH,
              "prompt_lengths": [len(p) for p in prompts], "output_lengths": outputs,
              "dtype": dtype, "greedy": True, "arrival": "all at t=0", "plot": plot}
    return document(NAME, config, results + [dict(part="knob", **k) for k in knobs], summary)
