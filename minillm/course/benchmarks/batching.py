"""Lesson 07: continuous batching vs one-at-a-time and static batching, on SmolLM2, one run.

Workload (offline: every request arrives at t = 0, greedy, ignore_eos so each request gets
exactly the tokens it asks for): chat prompts that share one system prompt, followed by a
passage of Python's documentation. Two workloads (`--workload`, WORKLOADS below): "main", 64
requests with prompt lengths log-uniform in [16, 512] tokens and output lengths in [16, 256]; and
"held-out", 24 requests, prompts in [10, 300], outputs in [16, 128], drawn with another seed (a
workload nothing here was tuned on; it skips the knob settings). Quick mode shrinks all of it.
The step plot goes next to the JSON (`--json results/x.json` -> results/x-steps.png).

Systems (SYSTEMS below), all in one dtype (`--dtype`, bfloat16 by default: this CPU multiplies
bf16 matrices with AMX, several times its fp32 GEMM rate, so bf16 is how one would serve on it; every
system, transformers included, runs in the same dtype). They separate three effects that a
single "continuous vs static" ratio mixes:
  1. scheduling at the same maximum batch: continuous_16 vs hf_batched and static (16 rows each);
  2. the batch size alone: continuous (64 rows) vs continuous_16;
  3. implementation speed: static vs hf_batched (same batches, same padding).
And the ladder from transformers one request at a time to the engine at 64 rows (LADDER), one
change per step, each step's factor measured in the same run.

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

from .common import document, figure_path

NAME = "batching"
HF_BATCH = 16
KNOB_REPEATS = 3          # the knob settings run the whole workload in the first KNOB_REPEATS rounds
SYSTEMS = {
    "hf_sequential": "transformers generate, one request at a time (KV cache on)",
    "fast_sequential": "minillm, one request after another on lesson 02's batch-1 stage (contiguous "
                       "KV cache, fused projections, compiled decode step; minillm/stages/reference.py)",
    "continuous_1": "minillm engine, max_num_seqs=1: paged KV cache, one request at a time",
    "hf_batched": f"transformers generate on left-padded batches of {HF_BATCH}, each run until its longest "
                  f"request is done",
    "static": f"minillm static batching (minillm/stages/static_batching.py), the same batches of {HF_BATCH}",
    "continuous_16": f"minillm engine, max_num_seqs={HF_BATCH}: continuous batching at the static batch size",
    "continuous": "minillm engine, max_num_seqs=64, whole prompts per step (chunked prefill off, 2048-token budget)",
    "continuous_chunked_prefix": "continuous + chunked prefill (512-token budget) + prefix caching",
}
# One change per step, from transformers one request at a time to the engine at 64 rows.
LADDER = (("hf_sequential", "transformers generate, one request at a time"),
          ("fast_sequential", "+ minillm's batch-1 fast path (contiguous KV cache, compiled decode step)"),
          ("continuous_1", "+ paged KV cache and the engine's step, still one request at a time"),
          ("continuous_16", f"+ continuous batching, up to {HF_BATCH} requests per step"),
          ("continuous", "+ up to 64 requests per step"))
# The knobs of pitfall 6, one at a time around continuous_chunked_prefix's settings (the center);
# max_num_seqs is the ladder's continuous_1 / continuous_16 / continuous.
CENTER = dict(max_num_seqs=64, max_num_batched_tokens=512, block_size=16, enable_chunked_prefill=True,
              enable_prefix_caching=True)
KNOBS = (("max_num_batched_tokens", (128, 512, 2048)), ("block_size", (8, 16, 64)))
# name -> (requests, prompt token range, output token range, seed, knob settings run)
WORKLOADS = {"main": (64, (16, 512), (16, 256), 0, True),
             "held-out": (24, (10, 300), (16, 128), 1, False)}
SYSTEM = ("You are a careful assistant for Python programmers. Answer precisely, quote the "
          "documentation when it helps, and keep answers short.")


def make_workload(tokenizer, num_requests: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int = 0) -> tuple[list[list[int]], list[int]]:
    from minillm.evaluate import evaluation_text

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
    ttft, tpot, tokens, computed = [], [], [], 0
    for first in range(0, len(prompts), batch_size):
        idx = list(range(first, min(first + batch_size, len(prompts))))
        longest = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), longest), pad_id)                    # left padding
        mask = torch.zeros(len(idx), longest, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[b, longest - len(prompts[i]):] = 1
        steps = max(outputs[i] for i in idx)
        computed += len(idx) * steps                                     # rows x steps, as in static batching
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
    return {"wall": wall, "ttft": ttft, "tpot": tpot, "tokens": tokens, "useful": sum(outputs), "computed": computed}


def run_static(model, prompts, outputs, batch_size: int) -> dict:
    from minillm.stages.static_batching import generate_static

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
    from minillm import SamplingParams

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


def run_one_at_a_time(llm, prompts, outputs) -> dict:
    """One request after another on lesson 02's batch-1 stage (minillm/stages/reference.py: contiguous KV
    cache, compiled decode step), outside the engine. TTFT from the first request's arrival."""
    from minillm import SamplingParams
    from minillm.stages.reference import stream_contiguous

    t0 = time.time()
    p0 = time.perf_counter()
    reqs = []
    for p, m in zip(prompts, outputs):
        (req,) = llm.make_requests([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        for _ in stream_contiguous(llm, req):
            pass
        reqs.append(req)
    wall = time.perf_counter() - p0
    return {"wall": wall, "ttft": [r.metrics.first_token_time - t0 for r in reqs],
            "tpot": [r.metrics.time_per_output_token for r in reqs], "tokens": [r.output_token_ids for r in reqs]}


def run_fresh_engine(llm, prompts, outputs) -> dict:
    """run_engine on a new engine (empty KV pool and prefix cache) after a one-request warm-up
    (which, with prefix caching on, caches the shared system prompt); the pool is freed after."""
    llm._engine = None
    run_engine(llm, prompts[:1], [2])
    result = run_engine(llm, prompts, outputs)
    llm._engine = None
    return result


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (of an even count, the slower of the two middle ones)."""
    return sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]


def spread(runs: list[dict], useful: int) -> dict:
    """Throughput of the median run and the range over all runs: the run-to-run noise."""
    walls = [r["wall"] for r in runs]
    return {"output_tok_s": useful / median_run(runs)["wall"], "output_tok_s_min": useful / max(walls),
            "output_tok_s_max": useful / min(walls), "runs_s": walls}


def ladder(tok_s: dict) -> list[dict]:
    """LADDER's steps with each one's throughput and its factor over the step before."""
    rows = []
    for i, (system, step) in enumerate(LADDER):
        factor = tok_s[system] / tok_s[LADDER[i - 1][0]] if i else None
        rows.append({"system": system, "step": step, "output_tok_s": tok_s[system], "factor": factor})
    return rows


def knob_row(knob: str, value: int, runs: list[dict], center: dict, useful: int) -> dict:
    """One knob setting over its repeats. beyond_noise: its throughput range does not overlap
    the center's, i.e. the difference exceeds the run-to-run spread."""
    r, row = median_run(runs), spread(runs, useful)
    beyond = (row["output_tok_s_max"] < center["output_tok_s_min"]
              or row["output_tok_s_min"] > center["output_tok_s_max"])
    return {"knob": knob, "value": value, **row, "ttft_p50_s": percentiles(r["ttft"])["p50"],
            "tpot_p50_ms": 1e3 * percentiles(r["tpot"])["p50"], "preemptions": max(x["preempted"] for x in runs),
            "beyond_noise": beyond}


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


def run(quick: bool, dtype: str = "bfloat16", workload: str = "main", json_path: str | None = None) -> dict:
    """json_path: where the document will be written; the step plot goes beside it (x.json -> x-steps.png;
    default results/batching-steps.png, results/quick/... when quick)."""
    import os

    from minillm import LLM
    from .kv_cache import dense_hf_model

    if workload not in WORKLOADS:
        raise ValueError(f"workload = {workload!r}; allowed: {', '.join(map(repr, WORKLOADS))}")
    started = time.perf_counter()
    n, prange, orange, seed, with_knobs = WORKLOADS[workload]
    if quick:
        n, prange, orange = 6, (64, 160), (4, 16)
    base = LLM(model="smollm2", dtype=dtype, device="cpu", max_num_seqs=64,
               max_num_batched_tokens=2048, enable_chunked_prefill=False)
    tok = base.get_tokenizer()
    prompts, outputs = make_workload(tok, n, prange, orange, seed)
    useful = sum(outputs)
    hf = dense_hf_model(getattr(torch, dtype))

    def engine(**args):
        """An LLM on base's weights with other engine settings."""
        return LLM(model=base.model, tokenizer=base.tokenizer, **{**base.engine_config.to_kwargs(), "device": "cpu", **args})

    # warm-up: one short request through every path (two for the compiled decode step: the
    # second cache size makes its shapes dynamic, so the timed runs do not recompile)
    run_hf(hf, prompts[:1], [2], 1, tok.eos_token_id)
    run_static(base.model, prompts[:1], [2], 1)
    run_one_at_a_time(base, prompts[:2], [3, 3])
    one = engine(max_num_seqs=1)
    sliced = {"hf_sequential": lambda p, o: run_hf(hf, p, o, 1, tok.eos_token_id),
              "fast_sequential": lambda p, o: run_one_at_a_time(base, p, o),
              "continuous_1": lambda p, o: run_fresh_engine(one, p, o),
              "hf_batched": lambda p, o: run_hf(hf, p, o, HF_BATCH, tok.eos_token_id),
              "static": lambda p, o: run_static(base.model, p, o, HF_BATCH)}
    whole = {"continuous_16": engine(max_num_seqs=HF_BATCH), "continuous": base,
             "continuous_chunked_prefix": engine(**CENTER)}
    knob_llms = {} if quick or not with_knobs else {f"{knob}={value}": engine(**dict(CENTER, **{knob: value}))
                                  for knob, values in KNOBS for value in values if value != CENTER[knob]}
    engines = {**whole, **knob_llms}
    repeats = KNOB_REPEATS if knob_llms else 0
    # Interleaved rounds: this VM's speed drifts over minutes, so no system may run
    # all of its work in a different stretch of time from the others. Round r runs slice r of the
    # workload (HF_BATCH requests) through the `sliced` systems and the WHOLE workload through the
    # `whole` ones (and the knob settings, in the first KNOB_REPEATS rounds), every other round in
    # reverse order so that no system always runs first. A sliced system's time is the sum of its
    # slices (its TTFT: as if the slices ran back to back from t = 0); a whole one reports its
    # median run and the range of its runs.
    rounds = [range(first, min(first + HF_BATCH, n)) for first in range(0, n, HF_BATCH)]
    parts = {name: [] for name in sliced}
    runs = {name: [] for name in engines}
    for r, idx in enumerate(rounds):
        names = [*sliced, *whole, *(knob_llms if r < repeats else [])]
        for name in names[::-1] if r % 2 else names:
            if name in sliced:
                parts[name].append(sliced[name]([prompts[i] for i in idx], [outputs[i] for i in idx]))
            else:
                runs[name].append(run_fresh_engine(engines[name], prompts, outputs))
    results, tokens = [], {}
    for name, slices in parts.items():
        r = merge_slices(slices)
        tokens[name] = r["tokens"]
        results.append(summarise(name, r["wall"], useful, r["ttft"], r["tpot"],
                                 {"padding_waste": 1 - r["useful"] / r["computed"]} if "useful" in r else {}))
    for name in whole:
        r = median_run(runs[name])
        tokens[name] = r["tokens"]
        extra = spread(runs[name], useful)
        if name == "continuous_chunked_prefix":
            extra["prefix_cached_tokens"] = r["cached"]
        results.append(summarise(name, r["wall"], useful, r["ttft"], r["tpot"], extra))
    plot = figure_path(json_path, "-steps", "batching-steps.png", quick)
    os.makedirs(os.path.dirname(plot), exist_ok=True)
    shown = median_run(runs["continuous_chunked_prefix"])
    _plot(shown["steps"], shown["t0"], plot)
    knobs = []
    if knob_llms:
        center_runs = runs["continuous_chunked_prefix"][:repeats]               # the same rounds as the knobs
        center = spread(center_runs, useful)
        for knob, values in KNOBS:
            knobs += [knob_row(knob, value, center_runs if value == CENTER[knob] else runs[f"{knob}={value}"],
                               center, useful) for value in values]
    by = {row["system"]: row["output_tok_s"] for row in results}
    same = {name: float(np.mean([a == b for a, b in zip(tokens[name], tokens["static"])])) for name in tokens}
    summary = {
        # end to end: these mix the max batch (64 vs 16 rows), implementation speed and scheduling
        "ratio_continuous_vs_hf_sequential": by["continuous"] / by["hf_sequential"],
        "ratio_continuous_vs_hf_batched": by["continuous"] / by["hf_batched"],
        "ratio_continuous_vs_static": by["continuous"] / by["static"],
        "ratio_chunked_prefix_vs_static": by["continuous_chunked_prefix"] / by["static"],
        # 1. scheduling at the same max batch of HF_BATCH rows
        "ratio_continuous16_vs_hf_batched": by["continuous_16"] / by["hf_batched"],
        "ratio_continuous16_vs_static": by["continuous_16"] / by["static"],
        # 2. the max batch alone: the same engine, 64 vs HF_BATCH rows
        "ratio_continuous64_vs_continuous16": by["continuous"] / by["continuous_16"],
        # 3. implementation: the same batches and padding, minillm's code vs transformers'
        "ratio_static_vs_hf_batched": by["static"] / by["hf_batched"],
        # implementation with no batching at all: one request at a time, paged engine vs transformers
        "ratio_continuous1_vs_hf_sequential": by["continuous_1"] / by["hf_sequential"],
        "ladder": ladder(by), "ladder_product": by[LADDER[-1][0]] / by[LADDER[0][0]],
        "output_tok_s": by, "requests_with_tokens_equal_to_static": same, "knobs": knobs}
    config = {"workload": workload, "seed": seed, "requests": n, "prompt_tokens": prange, "output_tokens": orange,
              "hf_batch": HF_BATCH,
              "prompt_lengths": [len(p) for p in prompts], "output_lengths": outputs,
              "dtype": dtype, "greedy": True, "arrival": "all at t=0", "systems": SYSTEMS,
              "rounds": len(rounds), "knob_repeats": repeats,
              "schedule": f"{len(rounds)} rounds; each runs one slice of {HF_BATCH} requests through "
                          f"{', '.join(sliced)} (their time: the sum of the slices, i.e. the whole workload once) "
                          f"and the whole workload through {', '.join(whole)} (median run and range) and, in the "
                          f"first {repeats} rounds, through each knob setting; odd rounds in reverse order",
              "knob_center": CENTER, "plot": plot, "benchmark_minutes": (time.perf_counter() - started) / 60}
    return document(NAME, config, results + [dict(part="knob", **k) for k in knobs], summary)
