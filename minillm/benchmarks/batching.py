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
    results, tokens = [], {}
    for name, fn in [
        ("hf_sequential", lambda: run_hf(hf, prompts, outputs, 1, tok.eos_token_id)),
        ("hf_batched", lambda: run_hf(hf, prompts, outputs, HF_BATCH, tok.eos_token_id)),
        ("static", lambda: run_static(base.model, prompts, outputs, HF_BATCH)),
        ("continuous", lambda: run_engine(base, prompts, outputs)),
    ]:
        r = fn()
        tokens[name] = r["tokens"]
        extra = {"padding_waste": r["waste"]} if "waste" in r else {}
        results.append(summarise(name, r["wall"], sum(outputs), r["ttft"], r["tpot"], extra))
    best = LLM(model="smollm2", dtype=dtype, device="cpu", max_num_seqs=64, max_num_batched_tokens=512,
               enable_chunked_prefill=True, enable_prefix_caching=True)
    run_engine(best, prompts[:1], [2])                                  # warm-up (and caches the system prompt)
    r = run_engine(best, prompts, outputs)
    tokens["continuous_chunked_prefix"] = r["tokens"]
    results.append(summarise("continuous_chunked_prefix", r["wall"], sum(outputs), r["ttft"], r["tpot"],
                             {"prefix_cached_tokens": r["cached"]}))
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
