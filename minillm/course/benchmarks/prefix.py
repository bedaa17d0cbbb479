"""Lesson 12: prefix caching by block hashes (vLLM) vs a radix tree (SGLang) vs none, on the
workloads where reuse happens, through the engine with the real model.

Four workloads, each a few waves of requests submitted together (a wave waits for the last):

- system_prompt: one long system prompt shared by every request, a different question each;
- multi_turn:    several chats side by side; turn t of every chat is one wave, and each turn's
                 prompt is the whole conversation so far (earlier messages and the model's answers);
- few_shot:      an instruction and four worked examples in different orders, then a question:
                 a prefix is shared only up to the first example that differs;
- branches:      one long document, then continuations of it (an agent's tool calls, a tree of
                 thought), all arriving at once: the requests of the first wave compute the
                 document side by side before anyone has cached it.

Each runs with caching off, with the hash index and with the radix tree, twice: with a KV pool
that holds everything ("roomy") and with one that holds little more than a wave's working set
("tight"), where what gets evicted decides what later waves find. Per run:

    prefill tokens computed   sum over steps of the tokens that were not decodes (recomputation
                              after a preemption included): the work caching saves
    hit rate                  prompt tokens served from the cache / prompt tokens
    TTFT                      first token time - arrival, median over requests (queueing included)
    throughput                output tokens / wall time of the whole workload

Greedy outputs must be equal across the three modes (the bench checks it). Counts do not depend
on timing; times are medians over repeats, the three modes interleaved in each repeat.
"""
from __future__ import annotations

import itertools
import math
import statistics
import time

from .common import document

NAME = "prefix"
MODES = ("none", "hash", "radix")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
SYSTEM_PROMPT_TOKENS = 512          # the full run's sizes (--quick halves them)
DOCUMENT_TOKENS = 768


# --- workloads: lists of waves; a prompt is token ids, or a function of earlier outputs ---------

def _sentences(tok, text: str, n: int, length: int) -> list[list[int]]:
    """n distinct token runs of about `length` tokens cut from text."""
    ids = tok.encode(text)
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def system_prompt(tok, text: str, quick: bool) -> list[list]:
    system = tok.encode(text)[:SYSTEM_PROMPT_TOKENS // (2 if quick else 1)]
    questions = [tok.encode(f"\nQuestion {i}: summarise the passage above in {i + 3} words.\nAnswer:")
                 for i in range(8 if quick else 16)]
    prompts = [system + q for q in questions]
    half = len(prompts) // 2
    return [prompts[:half], prompts[half:]]


def multi_turn(tok, text: str, quick: bool) -> list[list]:
    chats, turns = (2, 3) if quick else (4, 4)
    system = tok.encode("You are a patient tutor. Answer briefly.\n")
    topics = ["a KV cache", "paged attention", "speculative decoding", "quantisation"]
    questions = ["What is {}?", "Why does {} help?", "What does {} cost?", "When would you not use {}?"]
    messages = [[tok.encode(f"\nUser: {questions[t].format(topics[c])}\nAssistant:") for t in range(turns)]
                for c in range(chats)]

    def prompt(c, t):
        def build(outputs):                     # outputs: {(chat, turn): token ids} of earlier waves
            ids = list(system)
            for k in range(t):
                ids += messages[c][k] + outputs[(c, k)]
            return ids + messages[c][t]
        build.key = (c, t)
        return build
    return [[prompt(c, t) for c in range(chats)] for t in range(turns)]


def few_shot(tok, text: str, quick: bool) -> list[list]:
    instruction = tok.encode("Classify the sentiment of each review as positive or negative.\n")
    examples = [e + tok.encode(f"\nSentiment: {'positive' if k % 2 == 0 else 'negative'}\n")
                for k, e in enumerate(_sentences(tok, text, 4, 48))]
    orders = list(itertools.permutations(range(4)))[:: 3 if quick else 2][: 6 if quick else 12]
    prompts = [instruction + sum((examples[i] for i in order), []) + tok.encode(f"\nReview {q}: fine.\nSentiment:")
               for q, order in enumerate(orders)]
    half = len(prompts) // 2
    return [prompts[:half], prompts[half:]]


def branches(tok, text: str, quick: bool) -> list[list]:
    document_ids = tok.encode(text)[:DOCUMENT_TOKENS // (2 if quick else 1)]
    tails = [tok.encode(f"\nStep {k}: call tool number {k} on the document and report.\n") for k in range(12)]
    n = 4 if quick else 8
    return [[document_ids + tails[k] for k in range(n)], [document_ids + tails[k] + tails[k + 1] for k in range(n)]]


WORKLOADS = {"system_prompt": system_prompt, "multi_turn": multi_turn, "few_shot": few_shot, "branches": branches}


# --- one run -----------------------------------------------------------------------------

def run_workload(llm, waves: list[list], max_tokens: int) -> dict:
    """Submit each wave together through the engine and wait for it; returns counts, times and
    the output token ids (in submission order)."""
    from minillm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    first_step = len(engine.step_log)
    outputs, by_key, reqs_all = [], {}, []
    t0 = time.perf_counter()
    for wave in waves:
        prompts = [p(by_key) if callable(p) else p for p in wave]
        reqs = llm.make_requests([{"prompt_token_ids": p} for p in prompts], params)
        engine.run(reqs)
        for p, req in zip(wave, reqs):
            if callable(p):
                by_key[p.key] = req.output_token_ids
        outputs += [r.output_token_ids for r in reqs]
        reqs_all += reqs
    wall = time.perf_counter() - t0
    steps = engine.step_log[first_step:]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs_all)
    cached = sum(r.num_cached_tokens for r in reqs_all)
    return {
        "wall_s": wall,
        "ttft_p50_s": statistics.median(r.metrics.time_to_first_token for r in reqs_all),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "prefill_tokens_computed": sum(s["num_tokens"] - s["num_decodes"] for s in steps),
        "output_tokens": sum(len(o) for o in outputs),
        "preemptions": sum(s["num_preempted"] for s in steps),
        "steps": len(steps),
        "peak_blocks_used": engine.block_manager.num_blocks - min(s["free_blocks"] for s in steps),
        "outputs": outputs,
    }


def working_set_blocks(waves: list[list], max_tokens: int) -> int:
    """Blocks one wave needs without sharing (the largest wave; functions counted at their first turn)."""
    def length(p):
        return len(p({k: [0] * max_tokens for k in itertools.product(range(8), range(8))})) if callable(p) else len(p)
    return max(sum(math.ceil((length(p) + max_tokens) / BLOCK_SIZE) for p in wave) for wave in waves)


# --- the benchmark ------------------------------------------------------------------------

def run(quick: bool) -> dict:
    from minillm import LLM
    from minillm.evaluate import evaluation_text

    repeats, max_tokens = (1, 8) if quick else (3, 16)
    base = LLM(model="smollm2", dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
    tok, text = base.get_tokenizer(), evaluation_text()
    results, summary = [], {}
    base.generate(["warm-up: compile and allocate"], use_tqdm=False)
    for name, build in WORKLOADS.items():
        waves = build(tok, text, quick)
        need = working_set_blocks(waves, max_tokens)
        min_blocks = MAX_MODEL_LEN // BLOCK_SIZE          # the engine wants room for one full-length sequence
        pools = {"roomy": 4 * need + min_blocks, "tight": max(min_blocks, need // 2)}
        for pool, num_blocks in pools.items():
            runs = {mode: [] for mode in MODES}
            for _, mode in itertools.product(range(repeats), MODES):
                llm = LLM(model=base.model, tokenizer=tok, device="cpu", max_model_len=MAX_MODEL_LEN,
                          num_kv_blocks=num_blocks, enable_prefix_caching=mode != "none",
                          prefix_cache="radix" if mode == "radix" else "hash")
                runs[mode].append(run_workload(llm, waves, max_tokens))
            reference, reference_prefill = runs["none"][0]["outputs"], runs["none"][0]["prefill_tokens_computed"]
            for mode in MODES:
                r = runs[mode]
                first = r[0]
                wall = statistics.median(x["wall_s"] for x in r)
                results.append({
                    "workload": name, "pool": pool, "num_kv_blocks": num_blocks, "mode": mode,
                    "requests": sum(len(w) for w in waves), "prompt_tokens": first["prompt_tokens"],
                    "prefill_tokens_computed": first["prefill_tokens_computed"],
                    "prefill_tokens_saved": reference_prefill - first["prefill_tokens_computed"],
                    "hit_rate": first["cached_tokens"] / first["prompt_tokens"],
                    "ttft_p50_s": statistics.median(x["ttft_p50_s"] for x in r),
                    "wall_s": wall, "output_tok_s": first["output_tokens"] / wall,
                    "preemptions": first["preemptions"], "steps": first["steps"],
                    "peak_blocks_used": first["peak_blocks_used"],
                    "outputs_equal_no_cache": all(x["outputs"] == reference for x in r),
                    "counts_stable": all(x["prefill_tokens_computed"] == first["prefill_tokens_computed"] for x in r),
                })
            rows = {m: results[-3 + i] for i, m in enumerate(MODES)}
            summary[f"{name}_{pool}_peak_blocks_hash_over_radix"] = \
                rows["hash"]["peak_blocks_used"] / rows["radix"]["peak_blocks_used"]
            for mode in ("hash", "radix"):
                summary[f"{name}_{pool}_{mode}_hit_rate"] = rows[mode]["hit_rate"]
                summary[f"{name}_{pool}_{mode}_prefill_saved_fraction"] = \
                    rows[mode]["prefill_tokens_saved"] / rows["none"]["prefill_tokens_computed"]
                summary[f"{name}_{pool}_{mode}_ttft_speedup"] = rows["none"]["ttft_p50_s"] / rows[mode]["ttft_p50_s"]
                summary[f"{name}_{pool}_{mode}_throughput_speedup"] = \
                    rows[mode]["output_tok_s"] / rows["none"]["output_tok_s"]
    summary["all_outputs_equal"] = all(r["outputs_equal_no_cache"] for r in results)
    config = {"model": "SmolLM2-135M", "dtype": "float32", "block_size": BLOCK_SIZE, "max_tokens": max_tokens,
              "repeats": repeats, "greedy": True, "quick": quick}
    return document(NAME, config, results, summary)
