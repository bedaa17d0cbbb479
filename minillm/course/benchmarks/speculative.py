"""Speculative decoding on SmolLM2-135M: acceptance, tokens per target call, wall-clock speedup.

For each prompt kind (input-grounded text editing, factual QA, creative writing), temperature
(0, 0.7, 1.0), draft ("ngram", "draft", "layerskip") and k = 1, 2, 4, 8, one request of 40 new
tokens (ignore_eos, so every run emits the same number) is decoded plainly and speculatively.
Each speculative run is paired with a plain run of the same request just before it (the machine
is shared, so its load drifts; pairing keeps both sides of a ratio under the same load).
Before the grid, two small tables justify the drafts that need a choice:
  - draft_choice: candidate draft models derived from SmolLM2: step-time ratio c to the target
    and greedy agreement with it (teacher-forced) -> the predicted best speedup;
  - layer_importance: greedy agreement when exactly one layer is skipped (full run only).
After the grid, two tables the batch-1 goal and the server question need:
  - batch1: LLM.generate of one request, plain vs n-gram (k = 4, and the adaptive policy), in fp32
    and bf16, on copy / edit / code prompts (the answer is in the prompt) and a creative one at T = 0.8;
  - engine: B = 1..64 copies of a prompt through the continuous-batching engine, plain vs n-gram
    every step vs the adaptive policy: throughput, latency, the crossover batch size.
"""
from __future__ import annotations

import statistics
import time

import torch

from minillm.course.calculators import expected_speedup
from minillm.engine.sampling import SamplingParams
from minillm.model.llama import Llama
from minillm.perf.roofline import expected_tokens_per_call
from minillm.speculative.core import METHODS, SpecStats, bf16_copy, default_skipped_layers, layer_subset, make_draft
from minillm.stages.fast_decode import FastDecoder
from minillm.stages.kv_cache import generate_greedy
from minillm.stages.reference import stream_contiguous
from minillm.stages.speculative_loop import Stepper, speculative_stream
from . import common

NAME = "speculative"

PARAGRAPH = ("The old lighthouse stood on the edge of the cliff for more then two hundred years. Every night "
             "its lamp turned slowly, and ships that past the rocks trusted it's light to guide them home. In "
             "the winter storms the keeper climbed the stairs evry hour to clean the glass and trim the wick.")

# One prompt per kind. "grounded" is editing a given text: the answer copies most of the input,
# which is what prompt lookup feeds on (SmolLM2-135M rewrites code rather than copy it, so a
# code-editing prompt would not be input-grounded for this model).
PROMPTS = {
    "grounded": "Fix the spelling mistakes in this paragraph and return the corrected paragraph:\n\n" + PARAGRAPH,
    "qa": "What causes the seasons on Earth? Answer in a few sentences.",
    "creative": "Write a short poem about a lighthouse keeper who talks to the sea.",
}


# Batch-1 goal rows and the engine's crossover: input-grounded prompts (the answer is in the prompt)
# and a creative one sampled at T = 0.8. The copy passage and the code are held out: no test or
# other benchmark uses them.
COPY_PASSAGE = ("A river does not run in a straight line. It bends around hard rock, cuts through soft clay, and "
                "slowly carves a valley that is wider than the river itself. Over thousands of years the bends move "
                "downstream, and the old channels become quiet lakes shaped like the moon.")
CODE = ("def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
        "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result\n")
BATCH1_PROMPTS = {
    "copy": ("Copy the following passage exactly, word for word:\n\n" + COPY_PASSAGE, 0.0),
    "edit": (PROMPTS["grounded"], 0.0),
    "code": ("Add type hints and a docstring to this Python function and return the whole function:\n\n"
             "```python\n" + CODE + "```", 0.0),
    "creative": (PROMPTS["creative"], 0.8),
}
ENGINE_KINDS = ("edit", "creative")


def run(quick: bool) -> dict:
    from minillm import LLM

    quick = quick or common.quick_mode()
    llm = LLM(model="smollm2", dtype="float32", device="auto")
    tok = llm.get_tokenizer()
    prompts = {kind: tok.apply_chat_template([{"role": "user", "content": text}])
               for kind, text in PROMPTS.items()}
    config = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32)",
        "max_tokens": 12 if quick else 40,
        "ks": [2, 4] if quick else [1, 2, 4, 8],
        "temperatures": [0.0, 1.0] if quick else [0.0, 0.7, 1.0],
        "kinds": ["grounded"] if quick else list(PROMPTS),
        "methods": list(METHODS),
        "prompts": PROMPTS,
        "skipped_layers": default_skipped_layers(llm.config.n_layers),
        "note": "one prompt per kind, one speculative run per cell (seed 0), each paired with a plain "
                "run of the same request just before it; speedup = plain request time / speculative "
                "request time (prefill included; decode_speedup excludes it)",
    }
    greedy_outputs = {kind: generate_greedy(llm.model, [tok.encode(p)], 24 if quick else 40)[0]
                      for kind, p in prompts.items()}
    teacher = [(tok.encode(prompts[k]), greedy_outputs[k]) for k in config["kinds"]]
    draft_choice = measure_draft_choice(llm.model, teacher, reps=3 if quick else 10)
    layers = [] if quick else measure_layer_importance(llm.model, teacher)
    for method in config["methods"]:                       # untimed: compile every draft's shapes first
        for k in config["ks"]:
            for temperature in config["temperatures"]:
                for _ in speculative_stream(llm, _request(llm, prompts[config["kinds"][0]], temperature, 8),
                                            method, k, SpecStats(), make_draft(llm.model, method)):
                    pass
    results = []
    for kind in config["kinds"]:
        for temperature in config["temperatures"]:
            results += measure_block(llm, prompts[kind], kind, temperature, config)
    summary = summarise(results, draft_choice)
    summary["draft_choice"] = draft_choice
    summary["layer_importance"] = layers
    batch1 = measure_batch1(llm, quick)
    engine, cost = measure_engine(llm, quick)
    summary["batch1"] = summarise_batch1(batch1)
    summary["engine"] = summarise_engine(engine)
    summary["engine"]["cost_model"] = cost
    doc = common.document(NAME, config, results, summary)
    doc["batch1"], doc["engine"] = batch1, engine
    return doc


# ---- batch 1 on the fast path: plain vs n-gram (fixed k and the adaptive policy), fp32 and bf16 -------

def measure_batch1(llm, quick: bool) -> list[dict]:
    """LLM.generate of one request (through the engine, a batch of one), plain vs n-gram speculation with
    k = 4 and with the adaptive policy (k up to 8), for each prompt of BATCH1_PROMPTS, in fp32 and
    bf16. Modes run interleaved, repeated; each row is one dtype x prompt x mode with the median."""
    from minillm import LLM

    tok = llm.get_tokenizer()
    max_tokens, reps = (24, 1) if quick else (96, 2)
    modes = {"plain": {}, "ngram k=4": dict(speculative_method="ngram", num_speculative_tokens=4,
                                            speculative_policy="always"),
             "ngram adaptive": dict(speculative_method="ngram", num_speculative_tokens=8)}
    kinds = ["copy", "creative"] if quick else list(BATCH1_PROMPTS)
    rows = []
    for dtype in ("float32", "bfloat16"):
        model = llm.model if dtype == "float32" else LLM(model="smollm2", dtype=dtype).model
        llms = {mode: LLM(model=model, tokenizer=tok, max_model_len=llm.max_model_len, **kw)
                for mode, kw in modes.items()}
        for kind in kinds:
            text, temperature = BATCH1_PROMPTS[kind]
            prompt = tok.apply_chat_template([{"role": "user", "content": text}])
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
            times, last = common.interleaved_generate(llms, prompt, params, reps,
                                                      lambda m: _spec_counts(m) if m.speculative_method else None)
            outputs = {mode: (tokens, _spec_delta(llms[mode], before)) for mode, (tokens, before) in last.items()}
            plain = statistics.median(times["plain"])
            for mode in modes:
                tokens, counts = outputs[mode]
                rows.append({"dtype": dtype, "kind": kind, "temperature": temperature, "mode": mode,
                             "tokens": len(tokens), "seconds": statistics.median(times[mode]),
                             "all_seconds": times[mode], "tokens_per_s": len(tokens) / statistics.median(times[mode]),
                             "speedup": plain / statistics.median(times[mode]),
                             "same_tokens_as_plain": tokens == outputs["plain"][0], **counts})
    return rows


def _spec_counts(llm) -> tuple:
    """(drafted, accepted, target calls) so far: the engine's counters; every engine step is one
    target forward (one request alone: all of its steps)."""
    spec = llm.engine.speculation
    return spec.drafted, spec.accepted, len(llm.engine.step_log)


def _spec_delta(llm, before) -> dict:
    if llm.speculative_method is None:
        return {}
    drafted, accepted, calls = (now - then for now, then in zip(_spec_counts(llm), before))
    return {"drafted": drafted, "accepted": accepted, "target_calls": calls,
            "acceptance_rate": accepted / drafted if drafted else 0.0}


def summarise_batch1(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        out[f"{r['dtype']} {r['kind']} {r['mode']}"] = round(r["speedup"], 3)
    return out


# ---- inside the engine: throughput vs batch size, with and without speculation -----------------------

def measure_engine(llm, quick: bool) -> tuple[list[dict], dict | None]:
    """B copies of one prompt through the continuous batching engine (every B, including 1), plain vs
    n-gram k = 5 every step ("always") vs the adaptive policy (k up to 5): generated tokens per second
    of the whole batch and the median request latency. Modes interleaved, medians over reps; the
    adaptive policy's cost model keeps what it learned in earlier runs (as a server would); its last
    fit t(N) = a + b N is returned beside the rows."""
    from minillm import LLM

    tok = llm.get_tokenizer()
    batches, reps, max_tokens = ((1, 4), 1, 16) if quick else ((1, 4, 16, 64), 2, 48)
    modes = {"plain": {}, "ngram always": dict(speculative_method="ngram", num_speculative_tokens=5,
                                               speculative_policy="always"),
             "ngram adaptive": dict(speculative_method="ngram", num_speculative_tokens=5)}
    llms = {mode: LLM(model=llm.model, tokenizer=tok, max_model_len=llm.max_model_len, max_num_seqs=64, **kw)
            for mode, kw in modes.items()}
    rows = []
    for kind in ENGINE_KINDS:
        text, temperature = BATCH1_PROMPTS[kind]
        prompt = tok.apply_chat_template([{"role": "user", "content": text}])
        for B in batches:
            params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=s)
                      for s in range(B)]
            runs = {mode: [] for mode in modes}
            for rep in range(reps + 1):                    # rep 0: warm-up
                for mode, m in llms.items():
                    engine = m.engine
                    spec = engine.speculation
                    before = (spec.drafted, spec.accepted, spec.verify_runs) if spec else (0, 0, 0)
                    first_step = len(engine.step_log)
                    requests = m.make_requests([prompt] * B, params)
                    t0 = time.perf_counter()
                    engine.run(requests)
                    seconds = time.perf_counter() - t0
                    steps = engine.step_log[first_step:]
                    if rep:
                        latency = statistics.median(r.metrics.finished_time - r.metrics.arrival_time for r in requests)
                        drafted = spec.drafted - before[0] if spec else 0
                        runs[mode].append({"seconds": seconds, "latency": latency, "steps": len(steps),
                                           "drafted": drafted, "accepted": (spec.accepted - before[1]) if spec else 0,
                                           "verify_runs": (spec.verify_runs - before[2]) if spec else 0,
                                           "tokens": sum(len(r.output_token_ids) for r in requests)})
            plain = statistics.median(r["seconds"] for r in runs["plain"])
            for mode, rs in runs.items():
                seconds = statistics.median(r["seconds"] for r in rs)
                drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
                rows.append({"kind": kind, "temperature": temperature, "batch": B, "mode": mode,
                             "seconds": seconds, "tokens_per_s": rs[0]["tokens"] / seconds,
                             "latency_s": statistics.median(r["latency"] for r in rs),
                             "speedup": plain / seconds, "steps": statistics.median(r["steps"] for r in rs),
                             "drafted": drafted, "accepted": accepted,
                             "acceptance_rate": accepted / drafted if drafted else 0.0,
                             "drafts_per_request_step": drafted / max(1, sum(r["verify_runs"] for r in rs))
                             if drafted else 0.0,
                             "accepted_per_step": accepted / max(1, sum(r["steps"] for r in rs))})
    fit = llms["ngram adaptive"].engine.speculation.cost.fit()       # t(N) = a + b N over its last steps
    cost = None if fit is None else {"a_s": fit[0], "b_s_per_token": fit[1],
                                     "knee_tokens": fit[0] / fit[1] if fit[1] else None}
    return rows, cost


def summarise_engine(rows: list[dict]) -> dict:
    """The crossover: per prompt kind, the largest measured batch where speculating every step
    ("always") is still faster than plain, and the adaptive policy's speedup at each batch."""
    out = {}
    for kind in ENGINE_KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        always = sorted((r for r in mine if r["mode"] == "ngram always"), key=lambda r: r["batch"])
        adaptive = sorted((r for r in mine if r["mode"] == "ngram adaptive"), key=lambda r: r["batch"])
        paying = [r["batch"] for r in always if r["speedup"] > 1.0]
        out[kind] = {"largest_batch_where_always_pays": max(paying) if paying else None,
                     "always_speedup": {str(r["batch"]): r["speedup"] for r in always},
                     "adaptive_speedup": {str(r["batch"]): r["speedup"] for r in adaptive}}
    return out


def _request(llm, prompt: str, temperature: float, max_tokens: int):
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    (req,) = llm.make_requests([prompt], params)
    return req


def _timed(stream) -> tuple[float, float]:
    """(whole request seconds, seconds after the first token) of consuming a runner."""
    t0 = time.perf_counter()
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return end - t0, end - first


def measure_block(llm, prompt: str, kind: str, temperature: float, config: dict) -> list[dict]:
    """Plain vs every draft and k for one prompt and temperature. Each speculative run is paired
    with a plain run just before it, so a change in machine load hits both sides of the ratio."""
    n = config["max_tokens"]
    _timed(stream_contiguous(llm, _request(llm, prompt, temperature, n)))                # warm-up
    rows = []
    for method in config["methods"]:
        draft = make_draft(llm.model, method)
        for k in config["ks"]:
            plain, plain_decode = _timed(stream_contiguous(llm, _request(llm, prompt, temperature, n)))
            req = _request(llm, prompt, temperature, n)
            stats = SpecStats()
            total, decode = _timed(speculative_stream(llm, req, method, k, stats, draft))
            rows.append({"kind": kind, "temperature": temperature, "method": method, "k": k,
                         "acceptance_rate": stats.acceptance_rate, "alpha": stats.alpha,
                         "tokens_per_call": stats.tokens_per_call, "target_calls": stats.target_calls,
                         "drafted": stats.drafted, "accepted": stats.accepted, "rejections": stats.rejections,
                         "draft_seconds": stats.draft_seconds, "target_seconds": stats.target_seconds,
                         "seconds": total, "decode_seconds": decode, "tokens": len(req.output_token_ids),
                         "plain_seconds": plain, "speedup": plain / total,
                         "decode_speedup": plain_decode / decode,
                         "plain_tokens_per_s": n / plain, "tokens_per_s": n / total})
    return rows


# ---- which draft model? -----------------------------------------------------------------------------

def draft_candidates(model) -> dict:
    """Cheaper models derived from the target, each a plausible 'separate draft'."""
    from minillm.quant import quantize_model

    half = model.cfg.n_layers // 2
    return {
        "bf16 copy (chosen)": bf16_copy(model),
        "int8 weight-only copy": quantize_model(_unfused_copy(model), "int8"),
        f"first {half} layers (truncated)": layer_subset(model, list(range(half))),
        "layerskip (middle layers skipped)": layer_subset(
            model, [i for i in range(model.cfg.n_layers) if i not in default_skipped_layers(model.cfg.n_layers)]),
    }


def _unfused_copy(model: Llama) -> Llama:
    """An fp32 copy with plain projections (quantize_model replaces nn.Linear modules)."""
    state = {name: t.clone() for name, t in model.state_dict().items()
             if ".wqkv." not in name and ".w_gate_up." not in name}
    with torch.device("meta"):
        out = Llama(model.cfg)
    out.load_state_dict(state, assign=True)
    return out.eval()


@torch.no_grad()
def agreement(model, teacher) -> float:
    """Fraction of positions where the model's argmax equals the target's greedy token."""
    hit = total = 0
    for prompt, out in teacher:
        ids = torch.tensor([prompt + out], device=model.embed.weight.device)   # (1, T)
        pred = model(ids)[0, len(prompt) - 1:-1].argmax(-1).cpu()              # (len(out),)
        hit += int((pred == torch.tensor(out)).sum())
        total += len(out)
    return hit / total


@torch.no_grad()
def step_seconds(models: dict, reps: int, context: int = 150) -> dict:
    """Median seconds of one decode step per model (the teaching loop's own Stepper, its FastDecoder's
    2-byte build tuned first), measured interleaved."""
    steppers, times = {}, {name: [] for name in models}
    for name, m in models.items():
        decoder = FastDecoder(m)
        decoder.tune()                                     # bf16: the faster compiled build here; fp32: no-op
        steppers[name] = Stepper(decoder, context + 1)
        steppers[name].step([0] * context)
    for _ in range(reps + 1):
        for name, stepper in steppers.items():
            common.sync(stepper.cache.k.device)
            t0 = time.perf_counter()
            stepper.step([42])
            common.sync(stepper.cache.k.device)
            times[name].append(time.perf_counter() - t0)
            stepper.rollback(context)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def measure_draft_choice(model, teacher, reps: int) -> list[dict]:
    candidates = draft_candidates(model)
    seconds = step_seconds({"target": model, **candidates}, reps)
    rows = []
    for name, m in candidates.items():
        c = seconds[name] / seconds["target"]
        alpha = agreement(m, teacher)
        best = max(range(1, 9), key=lambda k: expected_speedup(alpha, k, c))
        rows.append({"candidate": name, "step_ms": 1e3 * seconds[name], "target_step_ms": 1e3 * seconds["target"],
                     "cost_ratio_c": c, "greedy_agreement": alpha, "best_k": best,
                     "predicted_speedup": expected_speedup(alpha, best, c)})
    return rows


def measure_layer_importance(model, teacher) -> list[dict]:
    n = model.cfg.n_layers
    return [{"skipped_layer": i,
             "greedy_agreement": agreement(layer_subset(model, [j for j in range(n) if j != i]), teacher)}
            for i in range(n)]


# ---- summary and plots ------------------------------------------------------------------------------

def summarise(results: list[dict], draft_choice: list[dict]) -> dict:
    greedy_grounded = [r for r in results if r["temperature"] == 0 and r["kind"] == "grounded"]
    best = max(greedy_grounded, key=lambda r: r["speedup"])
    summary = {"best_speedup_greedy_grounded": best["speedup"],
               "best_greedy_grounded": {"method": best["method"], "k": best["k"],
                                        "tokens_per_call": best["tokens_per_call"]}}
    for method in {r["method"] for r in results}:
        mine = [r for r in results if r["method"] == method]
        top = max(mine, key=lambda r: r["speedup"])
        low = min(mine, key=lambda r: r["speedup"])
        summary[method] = {
            "best_speedup": top["speedup"], "best_at": {c: top[c] for c in ("kind", "temperature", "k")},
            "worst_speedup": low["speedup"], "worst_at": {c: low[c] for c in ("kind", "temperature", "k")},
            "slower_than_plain": sum(r["speedup"] < 1 for r in mine), "cells": len(mine),
            "acceptance_rate_by_temperature": {
                str(t): statistics.mean(r["acceptance_rate"] for r in mine if r["temperature"] == t)
                for t in sorted({r["temperature"] for r in mine})},
        }
    return summary


def theory_curves(results: list[dict]) -> list[dict]:
    """Per (method, kind, temperature): alpha pooled over k, measured vs predicted tokens per call."""
    out = []
    keys = sorted({(r["method"], r["kind"], r["temperature"]) for r in results})
    for method, kind, temperature in keys:
        rows = sorted((r for r in results if (r["method"], r["kind"], r["temperature"]) == (method, kind, temperature)),
                      key=lambda r: r["k"])
        accepted = sum(r["accepted"] for r in rows)
        tested = accepted + sum(r["rejections"] for r in rows)
        alpha = accepted / tested if tested else 0.0
        out.append({"method": method, "kind": kind, "temperature": temperature, "alpha": alpha,
                    "k": [r["k"] for r in rows], "measured": [r["tokens_per_call"] for r in rows],
                    "theory": [expected_tokens_per_call(alpha, r["k"]) for r in rows]})
    return out


def plot(doc: dict, out_dir="results") -> list[str]:
    """speculative.png: tokens per target call, measured vs theory; speculative-speedup.png."""
    import matplotlib.pyplot as plt
    from pathlib import Path

    results, paths = doc["results"], []
    methods = doc["config"]["methods"]
    temps = doc["config"]["temperatures"]
    kinds = doc["config"]["kinds"]
    fig, axes = plt.subplots(len(methods), len(kinds), figsize=(4 * len(kinds), 3.2 * len(methods)),
                             squeeze=False, sharex=True)
    for curve in theory_curves(results):
        ax = axes[methods.index(curve["method"])][kinds.index(curve["kind"])]
        color = f"C{temps.index(curve['temperature'])}"
        ax.plot(curve["k"], curve["measured"], "o", color=color,
                label=f"T={curve['temperature']} measured (alpha={curve['alpha']:.2f})")
        ax.plot(curve["k"], curve["theory"], "-", color=color, alpha=0.6)
        ax.set_title(f"{curve['method']} / {curve['kind']}", fontsize=9)
    for ax in axes.flat:
        ax.legend(fontsize=6)
        ax.set_xlabel("k (draft tokens per round)", fontsize=8)
        ax.set_ylabel("tokens per target call", fontsize=8)
    fig.suptitle("dots: measured; lines: (1 - alpha^(k+1)) / (1 - alpha) with alpha pooled over k", fontsize=9)
    fig.tight_layout()
    paths.append(str(Path(out_dir) / "speculative.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(temps), figsize=(4.2 * len(temps), 3.4), squeeze=False, sharey=True)
    for ti, t in enumerate(temps):
        ax = axes[0][ti]
        for mi, method in enumerate(methods):
            for ki, kind in enumerate(kinds):
                rows = sorted((r for r in results if (r["method"], r["kind"], r["temperature"]) == (method, kind, t)),
                              key=lambda r: r["k"])
                ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], ["-o", "--s", ":^"][ki % 3],
                        color=f"C{mi}", markersize=3, label=f"{method} / {kind}")
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_title(f"temperature {t}", fontsize=9)
        ax.set_xlabel("k", fontsize=8)
    axes[0][0].set_ylabel("wall-clock speedup over plain decoding", fontsize=8)
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    paths.append(str(Path(out_dir) / "speculative-speedup.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
