"""Lesson 08: the EAGLE head's drafts as the batch grows (its batch crossover), in the engine.

B requests (B in BATCHES) of the held-out QA and creative prompts, alternating, greedy, through one LLM.generate
call per mode and B: plain decoding, the head under the adaptive policy (drafts only while they are expected to raise
the step's throughput, speculative/engine.py), and the head drafting k = 3 every step. Modes interleaved per round,
a warm-up round then REPS timed rounds, medians. Needs the head `bench eagle` saves.

Per row: tokens per second, speedup over plain at the same B, whether the tokens equal plain's, and per request
and step the drafts verified and accepted.
"""
from __future__ import annotations

import statistics
import time

from minillm.engine.sampling import SamplingParams
from .common import document
from .eagle import held_out_prompts

NAME = "eagle-batch"


def modes() -> dict[str, dict]:
    return {"plain": {},
            "eagle adaptive": dict(speculative_method="eagle", num_speculative_tokens=6),
            "eagle k=3": dict(speculative_method="eagle", num_speculative_tokens=3, speculative_policy="always")}


def _counts(llm) -> tuple[int, int, int, int]:
    """(engine steps, drafts, accepted drafts, verifications) so far."""
    spec = llm.engine.speculation
    steps = sum(e["num_seqs"] for e in llm.engine.step_log)                  # request-steps
    return (steps, 0, 0, 0) if spec is None else (steps, spec.drafted, spec.accepted, spec.verify_runs)


def run(quick: bool) -> dict:
    from minillm import LLM

    base = LLM(model="smollm2", dtype="float32", device="cpu")
    tok = base.get_tokenizer()
    batches, reps, max_tokens = ((1, 4), 1, 16) if quick else ((1, 4, 16), 2, 64)
    llms = {mode: LLM(model=base.model, tokenizer=tok, max_model_len=base.max_model_len, **kw)
            for mode, kw in modes().items()}
    texts = [held_out_prompts()[kind] for kind in ("qa", "creative")]
    prompts = [tok.apply_chat_template([{"role": "user", "content": texts[i % 2]}]) for i in range(max(batches))]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for B in batches:
        times, tokens, deltas = {mode: [] for mode in llms}, {}, {}
        for rep in range(reps + 1):
            for mode, llm in llms.items():
                before = _counts(llm)
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:B], params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                if rep:
                    times[mode].append(seconds)
                tokens[mode] = [o.outputs[0].token_ids for o in outs]
                deltas[mode] = [a - b for a, b in zip(_counts(llm), before)]
        plain = statistics.median(times["plain"])
        for mode in llms:
            median = statistics.median(times[mode])
            steps, drafted, accepted, verifications = deltas[mode]
            rows.append({"batch": B, "mode": mode, "tokens": B * max_tokens, "seconds": median,
                         "all_seconds": times[mode], "tokens_per_s": B * max_tokens / median,
                         "speedup": plain / median, "same_tokens_as_plain": tokens[mode] == tokens["plain"],
                         "request_steps": steps, "drafted": drafted, "accepted": accepted,
                         "verifications": verifications, "drafts_per_request_step": drafted / steps})
    summary = {"speedup": {f"B={r['batch']} {r['mode']}": round(r["speedup"], 3) for r in rows},
               "greedy_tokens_equal_plain": all(r["same_tokens_as_plain"] for r in rows)}
    config = {"batches": list(batches), "max_tokens": max_tokens, "reps": reps, "modes": list(llms),
              "dtype": "float32", "prompts": ["qa", "creative"],
              "note": "B requests per LLM.generate, modes interleaved per round, medians of the timed rounds"}
    return document(NAME, config, rows, summary)
