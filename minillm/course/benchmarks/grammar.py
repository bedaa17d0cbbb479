"""Lesson 12: minillm's grammar engine against xgrammar, on the same schemas, documents and vocabulary.

    agreement   per schema of the corpus (schema_corpus.py): how many generated documents (valid
                and adversarial) each engine accepts as a whole; both are scored against jsonschema
                (with RFC 5321 emails) and against each other
    compile     schema -> ready to mask: ours (schema -> grammar -> rule DFAs -> automaton, masks
                computed lazily), ours with every frame's mask computed up front, xgrammar's
                compile_json_schema (its token mask cache is built at compile time)
    mask/token  per token of SmolLM2's tokenisation of valid documents: produce the mask for the
                current state, then advance by the token. Ours lazy (a fresh automaton: frame masks
                computed on first use), ours after precompute() (every frame's mask ready, as
                xgrammar's compile leaves it; configuration masks cached as they are visited), and
                that with the configuration cache off (frame masks only); xgrammar's
                fill_next_token_bitmask + accept_token. Means over all tokens, one thread.
    generated   SmolLM2 under each schema of the corpus (sampled, 160 tokens at most): how many outputs
                stopped, and how many of those validate with jsonschema (the rest were cut by max_tokens:
                a recursive schema or an unbounded string the model kept going)
    decode      one SmolLM2 decode step at batch 1 (fp32), to put the mask in proportion

Both engines get the same vocabulary (SmolLM2's tokens as bytes) and the same layout
(separators ", " and ": ", no other whitespace).
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from .common import document
from .schema_corpus import SCHEMAS, documents

NAME = "grammar"


def _ours(schema, vocab):
    from minillm.guided.grammar import Grammar
    from minillm.guided.json_schema import schema_to_grammar
    from minillm.guided.pushdown import PushdownAutomaton

    return PushdownAutomaton(Grammar(schema_to_grammar(schema)), vocab)


def _accepts_ours(pda, text: str) -> bool:
    config = pda.start
    for b in text.encode():
        config = pda.step(config, b)
    return pda.is_accepting(config)


def _agreement(compiler, schema, seed: int) -> dict:
    import xgrammar as xgr
    from minillm.guided.token_automaton import TokenVocabulary

    pda = _ours(schema, TokenVocabulary([b"x"], None))
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    row = {"documents": 0, "valid": 0, "ours_right": 0, "xgrammar_right": 0, "agree": 0, "xgrammar_wrong_examples": []}
    for text, valid in documents(schema, seed):
        ours = _accepts_ours(pda, text)
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        theirs = matcher.accept_string(text) and matcher.is_completed()
        row["documents"] += 1
        row["valid"] += valid
        row["ours_right"] += ours == valid
        row["xgrammar_right"] += theirs == valid
        row["agree"] += ours == theirs
        if theirs != valid and len(row["xgrammar_wrong_examples"]) < 2:
            row["xgrammar_wrong_examples"].append({"text": text[:160], "valid": valid})
    return row


def _token_docs(tokenizer, schema, compiled, seed: int, limit: int) -> list[list[int]]:
    """SmolLM2's tokens of valid documents that both engines accept (xgrammar refuses some valid
    ones, e.g. an escape in a length-bounded string: those are counted above, not timed)."""
    import xgrammar as xgr

    docs = []
    for text, valid in documents(schema, seed):
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        if valid and matcher.accept_string(text) and matcher.is_completed() and len(docs) < limit:
            docs.append(tokenizer.encode(text))
    return docs


def _time_ours(pda, docs, clear_configs: bool) -> list[float]:
    times = []
    for ids in docs:
        config = pda.start
        for t in ids:
            if clear_configs:
                pda.clear_mask_cache()
            t0 = time.perf_counter()
            mask = pda.mask(config)
            config = pda.next_state(config, t)
            times.append(time.perf_counter() - t0)
            assert mask[t]
    return times


def _time_xgrammar(compiled, docs, vocab_size: int) -> list[float]:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    times = []
    for ids in docs:
        matcher = xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            ok = matcher.accept_token(t)
            times.append(time.perf_counter() - t0)
            assert ok
    return times


def _decode_step_ms(llm) -> float:
    from minillm.engine.sampling import SamplingParams

    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        runs.append((time.perf_counter() - t0) / 64)
    return 1e3 * statistics.median(runs)


def _generated(llm, names) -> dict:
    from minillm.engine.sampling import GuidedDecodingParams, SamplingParams
    from .schema_corpus import format_checker
    import jsonschema

    question = "Reply with an example JSON value for a record called {}."
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": question.format(n)}]) for n in names]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=160,
                             guided_decoding=GuidedDecodingParams(json=SCHEMAS[n])) for i, n in enumerate(names)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stopped = [(n, o.outputs[0].text) for n, o in zip(names, outs) if o.outputs[0].finish_reason == "stop"]
    valid = sum(jsonschema.Draft202012Validator(SCHEMAS[n], format_checker=format_checker()).is_valid(json.loads(t))
                for n, t in stopped)
    return {"generated": len(names), "generated_stopped": len(stopped), "generated_valid": valid}


def run(quick: bool) -> dict:
    import xgrammar as xgr
    from minillm.guided.token_automaton import TokenVocabulary, vocabulary_bytes
    from minillm.llm import LLM

    llm = LLM(model="smollm2", dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=64)
    tok, vocab_size = llm.tokenizer, llm.config.vocab_size
    token_bytes = vocabulary_bytes(tok, vocab_size)
    vocab = TokenVocabulary(token_bytes, tok.eos_token_id)
    info = xgr.TokenizerInfo(token_bytes, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    limit = 3 if quick else 8
    names = list(SCHEMAS)[:4] if quick else list(SCHEMAS)
    results = []
    for name in names:
        schema = SCHEMAS[name]
        row = {"schema": name, **_agreement(compiler, schema, seed=0)}
        t0 = time.perf_counter()
        pda = _ours(schema, vocab)
        row["ours_compile_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        eager = _ours(schema, vocab)
        eager.precompute()
        row["ours_compile_all_frames_s"] = time.perf_counter() - t0
        row["frames"] = len(eager.frame_masks)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        row["xgrammar_compile_s"] = time.perf_counter() - t0
        first, second = (_token_docs(tok, schema, compiled, seed, limit) for seed in (1, 2))
        if not first or not second:          # xgrammar refuses every valid document here: nothing to time
            row.update({"tokens_timed": 0, "ours_vs_xgrammar": None, "frames_only_vs_xgrammar": None})
            results.append(row)
            continue
        lazy = _time_ours(pda, first, clear_configs=False)            # frames computed on first use
        compiled_ours = _time_ours(eager, second, clear_configs=False)  # after precompute(), as xgrammar
        frames_only = _time_ours(eager, second, clear_configs=True)
        _time_xgrammar(compiled, first, vocab_size)                      # warm-up
        theirs = _time_xgrammar(compiled, second, vocab_size)
        row.update({"tokens_timed": len(theirs), "ours_lazy_ms": 1e3 * statistics.mean(lazy),
                    "ours_ms": 1e3 * statistics.mean(compiled_ours),
                    "ours_frames_only_ms": 1e3 * statistics.mean(frames_only),
                    "xgrammar_ms": 1e3 * statistics.mean(theirs),
                    "ours_median_ms": 1e3 * statistics.median(compiled_ours),
                    "xgrammar_median_ms": 1e3 * statistics.median(theirs),
                    "uncertain_tokens_per_frame": eager.stats()["uncertain_tokens_mean"]})
        row["ours_vs_xgrammar"] = row["ours_ms"] / row["xgrammar_ms"]
        row["frames_only_vs_xgrammar"] = row["ours_frames_only_ms"] / row["xgrammar_ms"]
        results.append(row)
    total = {k: sum(r[k] for r in results) for k in ("documents", "valid", "ours_right", "xgrammar_right", "agree")}
    timed = [r for r in results if r["tokens_timed"]]
    summary = {**total, "schemas_timed": len(timed),
               **{k: statistics.median(r[k] for r in timed) for k in
                  ("ours_vs_xgrammar", "frames_only_vs_xgrammar", "ours_ms", "ours_lazy_ms", "ours_frames_only_ms",
                   "xgrammar_ms", "ours_compile_s", "ours_compile_all_frames_s", "xgrammar_compile_s")},
               "decode_step_ms": _decode_step_ms(llm), **_generated(llm, names)}
    summary["mask_vs_decode_step"] = summary["ours_ms"] / summary["decode_step_ms"]
    config = {"model": "smollm2", "vocab_size": vocab_size, "threads": torch.get_num_threads(),
              "xgrammar_threads": 1, "layout": "separators ', ' and ': ', no other whitespace",
              "documents_timed_per_schema": limit}
    return document(NAME, config, results, summary)
