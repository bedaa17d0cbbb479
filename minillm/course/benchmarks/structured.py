"""Lesson 12: what structured output costs and what jump-forward saves, with the real model.

Per schema (a flat record with long fixed keys, a nested one with an array and enums):

    compile      schema -> grammar -> rule DFAs -> pushdown automaton (seconds, once per schema),
                 and the token masks of every frame (rule, state) over SmolLM2's vocabulary (what
                 the lazy cache pays at most, pushdown.precompute; --quick leaves all_masks_s empty)
    mask/step    the per-step cost once a mask is cached: a lookup + masked_fill (ms, median over
                 many calls); and the first visit of a frame: one walk of the vocabulary (ms, median)
    tokens/s     the same prompts through the engine, free text vs guided vs guided with
                 jump-forward (warm: the masks are cached by a warm-up run); output tokens /
                 wall time, median over repeats
    jump-forward tokens appended without a model step, and model steps per request

Free text runs with ignore_eos, each request for as many tokens as its guided output has, so
both generate the same amount and the batch shrinks at the same steps. All outputs of the guided runs are checked to parse as JSON.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from .common import document

NAME = "structured"
MAX_MODEL_LEN = 512
SCHEMAS = {
    "record": {"type": "object", "properties": {
        "customer_full_name": {"type": "string", "maxLength": 24},
        "customer_age_in_years": {"type": "integer"},
        "customer_home_city": {"type": "string", "maxLength": 20},
        "customer_is_subscribed": {"type": "boolean"}},
        "required": ["customer_full_name", "customer_age_in_years", "customer_home_city", "customer_is_subscribed"]},
    "nested": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 12},
                                                    "last": {"type": "string", "maxLength": 12}},
                   "required": ["first", "last"]},
        "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science"]}, "maxItems": 3},
        "year": {"type": "integer"}},
        "required": ["title", "author", "genres", "year"]},
}
QUESTIONS = {"record": ["Describe a customer.", "Invent a customer from Lyon.", "A young customer, please.",
                        "Describe an old customer."],
             "nested": ["Describe a novel.", "Describe a history book.", "A science book, please.",
                        "Describe a book of poems."]}


def _compile_costs(llm, schema, quick: bool) -> dict:
    from minillm.guided.grammar import Grammar
    from minillm.guided.guide import compile_guide
    from minillm.guided.json_schema import schema_to_grammar
    from minillm.guided.pushdown import PushdownAutomaton
    from minillm.engine.sampling import GuidedDecodingParams

    t0 = time.perf_counter()
    grammar = Grammar(schema_to_grammar(schema))
    compile_s = time.perf_counter() - t0
    vocab = compile_guide(GuidedDecodingParams(json=schema), llm.tokenizer, llm.config.vocab_size).automaton.vocab
    fresh = PushdownAutomaton(grammar, vocab)                              # empty mask caches
    frames = [(r, s) for r, rule in enumerate(grammar.rules) for s in range(rule.dfa.num_states)
              if fresh.has_bytes[r][s]]
    measured = frames if not quick else frames[::max(1, len(frames) // 48)]
    cold = []
    for rule, state in measured:                                           # the first visit of a frame
        node = fresh._node(rule, state, -1)
        t0 = time.perf_counter()
        fresh.frame_mask(node)
        cold.append(time.perf_counter() - t0)
    logits = torch.randn(llm.config.vocab_size)                                # (V,)
    masks = [fresh.frame_masks[k][0] for k in list(fresh.frame_masks)]
    warm = []
    for i in range(400):
        mask = masks[i % len(masks)]
        t0 = time.perf_counter()
        logits.masked_fill(~mask, float("-inf"))
        warm.append(time.perf_counter() - t0)
    all_masks = None
    if not quick:
        eager = PushdownAutomaton(grammar, vocab)
        t0 = time.perf_counter()
        eager.precompute()
        all_masks = time.perf_counter() - t0
    return {"grammar_rules": len(grammar.rules), "rule_states": sum(r.dfa.num_states for r in grammar.rules),
            "schema_to_automaton_s": compile_s, "mask_frames_timed": len(cold), "all_masks_s": all_masks,
            "cold_mask_ms": 1e3 * statistics.median(cold), "warm_mask_ms": 1e3 * statistics.median(warm)}


def _generate(llm, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    reqs = llm.make_requests(prompts, params)
    llm.engine.run(reqs)
    return time.perf_counter() - t0, reqs


def _throughputs(llm, schema, prompts, repeats: int) -> dict:
    from minillm.engine.sampling import GuidedDecodingParams, SamplingParams

    guided = SamplingParams(temperature=0, max_tokens=160, guided_decoding=GuidedDecodingParams(json=schema))
    jump = SamplingParams(temperature=0, max_tokens=160,
                          guided_decoding=GuidedDecodingParams(json=schema, jump_forward=True))
    _, warm_reqs = _generate(llm, prompts, guided)                 # warm-up: fills the mask cache
    _generate(llm, prompts, jump)
    # free text with each request's own guided length: the batch shrinks at the same steps
    free = [SamplingParams(temperature=0, max_tokens=len(r.output_token_ids), ignore_eos=True) for r in warm_reqs]
    _generate(llm, prompts, free)
    runs = {"free": [], "guided": [], "jump_forward": []}
    last = {}
    for _ in range(repeats):                                      # the three interleaved in each repeat
        for name, params in (("free", free), ("guided", guided), ("jump_forward", jump)):
            seconds, reqs = _generate(llm, prompts, params)
            runs[name].append(sum(len(r.output_token_ids) for r in reqs) / seconds)
            last[name] = reqs
    for name in ("guided", "jump_forward"):
        for r in last[name]:
            json.loads(r.text)                                     # every guided output is JSON
    forced = [r.guide.num_forced_tokens for r in last["jump_forward"]]
    out_tokens = [len(r.output_token_ids) for r in last["jump_forward"]]
    return {"free_tok_s": statistics.median(runs["free"]), "guided_tok_s": statistics.median(runs["guided"]),
            "jump_forward_tok_s": statistics.median(runs["jump_forward"]),
            "guided_tokens_per_request": statistics.mean(len(r.output_token_ids) for r in last["guided"]),
            "jump_forward_tokens_per_request": statistics.mean(out_tokens),
            "jump_forward_forced_tokens_per_request": statistics.mean(forced),
            "jump_forward_model_steps_per_request": statistics.mean(o - f for o, f in zip(out_tokens, forced)),
            "example_output": last["guided"][0].text}


def run(quick: bool) -> dict:
    from minillm.llm import LLM

    llm = LLM(model="smollm2", dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=256)
    repeats = 1 if quick else 3
    results = []
    for name, schema in SCHEMAS.items():
        questions = QUESTIONS[name][:2 if quick else 4]
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q + " Answer in JSON."}])
                   for q in questions]
        row = {"schema": name, "num_prompts": len(prompts), **_compile_costs(llm, schema, quick),
               **_throughputs(llm, schema, prompts, repeats)}
        row["guided_vs_free"] = row["guided_tok_s"] / row["free_tok_s"]
        row["jump_forward_vs_guided"] = row["jump_forward_tok_s"] / row["guided_tok_s"]
        row["forced_fraction"] = (row["jump_forward_forced_tokens_per_request"]
                                  / row["jump_forward_tokens_per_request"])
        results.append(row)
    summary = {"warm_mask_ms": statistics.median(r["warm_mask_ms"] for r in results),
               "cold_mask_ms": statistics.median(r["cold_mask_ms"] for r in results),
               "guided_vs_free": statistics.median(r["guided_vs_free"] for r in results),
               "jump_forward_vs_guided": statistics.median(r["jump_forward_vs_guided"] for r in results),
               "forced_fraction": statistics.median(r["forced_fraction"] for r in results)}
    config = {"model": "smollm2", "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "repeats": repeats,
              "temperature": 0, "schemas": SCHEMAS, "path": "engine (continuous batching), all prompts at once"}
    return document(NAME, config, results, summary)
