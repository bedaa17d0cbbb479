"""One side of `bench redesign`: minillm imported from a given source tree, measuring on command.

    python redesign_worker.py /path/to/tree      # then one JSON command per line on stdin

Run by minillm/course/benchmarks/redesign.py, once for this tree and once for a previous commit checked out
in a worktree, so the script uses only the public interface both trees share (LLM, SamplingParams,
RequestMetrics, the engine's step log, evaluate.perplexity, benchmarks.batching.make_workload).
Each command answers one JSON line on stdout; everything else goes to stderr.
"""
from __future__ import annotations

import gc
import json
import statistics
import sys
import time

KINDS = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
         "int8": dict(dtype="float32", quantization="int8"), "int4": dict(dtype="float32", quantization="int4"),
         "fp32-ngram": dict(dtype="float32", speculative_method="ngram", num_speculative_tokens=4,
                            speculative_policy="always")}
QUESTION = "Explain in a few sentences why the sky is blue."
COPY = ("Copy this sentence exactly, word for word: The lighthouse keeper wrote a long letter to the sea, "
        "and the sea answered with a storm that lasted for three whole days and nights.")


def build(kind: str, max_num_seqs: int):
    from minillm import LLM

    return LLM(model="smollm2", num_kv_blocks=1024, max_num_seqs=max_num_seqs, **KINDS[kind])


def one_prompt(llm, tokens: int, copy: bool = False) -> dict:
    """LLM.generate of one chat prompt, greedy: TTFT, decode tokens/s after the first token, the tokens.
    copy: a prompt whose answer is in the prompt (where n-gram drafts are accepted)."""
    from minillm import SamplingParams

    prompt = chat_prompt(llm, copy)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    return {"ttft_s": m.time_to_first_token, "decode_tok_s": 1 / m.time_per_output_token,
            "tokens": list(out.outputs[0].token_ids), "build_16bit": build_16bit(llm)}


def top2_gap(llm, token_ids: list[int]) -> dict:
    """The naive forward's last-position logits after token_ids (the model's own dtype): the gap
    between its two largest and the logits' range, for the near-tie rule at a first differing token."""
    import torch

    logits = llm.model(torch.tensor([token_ids]))[0, -1].float()        # (V,)
    top2 = logits.topk(2).values
    return {"top2_gap": float(top2[0] - top2[1]), "logit_range": float(logits.max() - logits.min())}


def chat_prompt(llm, copy: bool = False) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": COPY if copy else QUESTION}])


def build_16bit(llm) -> str:
    """Which compiled 2-byte decode build this side runs: "row blocks" (after: the engine's one build,
    over transforms.gemv_blocks), or what the contiguous path chose at its first 2-byte step (before);
    "" for fp32 weights."""
    if llm.model.embed.weight.element_size() != 2:
        return ""
    if getattr(llm.engine.runner, "decode_head", None) is not None:
        return "row blocks"
    from minillm.stages.fast_decode import chosen_16bit_builds
    return ",".join(sorted(set(chosen_16bit_builds().values())))


def decode_batch(llm, n: int, tokens: int) -> dict:
    """n copies of a 64-token prompt through the engine at once: the median decode-only step (what
    bench engine-step reports) and n / that step as tokens/s."""
    from minillm import SamplingParams

    words = llm.get_tokenizer().encode(" ".join(["the lighthouse keeper wrote a letter to the sea"] * 8))[:64]
    llm.engine.step_log.clear()
    outs = llm.generate([{"prompt_token_ids": words}] * n,
                        SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    steps = [1e3 * s["seconds"] for s in llm.engine.step_log if s["num_decodes"] == s["num_seqs"] == s["num_tokens"] == n]
    step_ms = statistics.median(steps)
    return {"step_ms": step_ms, "tok_s": n / step_ms * 1e3, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def workload(llm, n: int) -> dict:
    """bench batching's main workload shape (prompts 64-512 tokens, outputs 16-128, log-uniform) of n
    requests through the engine: output tokens per second of wall time."""
    from minillm import SamplingParams
    from minillm.course.benchmarks.batching import make_workload

    prompts, outputs = make_workload(llm.get_tokenizer(), n, (64, 512), (16, 128))
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tok_s": sum(outputs) / wall, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def main() -> None:
    sys.path[0] = sys.argv[1]       # this tree's minillm ahead of any installed one, and not the script's
                                    # folder (its profile.py would shadow the standard library's)
    import torch

    import minillm
    print(f"minillm from {minillm.__file__}", file=sys.stderr)
    llm = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        with torch.no_grad():
            if op == "load":
                llm = None
                gc.collect()
                llm = build(cmd["kind"], cmd.get("max_num_seqs", 64))
                answer = {"loaded": cmd["kind"], "module": minillm.__file__,
                          "gemm_libraries": getattr(llm.engine.runner, "gemm_libraries", None)}
            elif op == "one":
                answer = one_prompt(llm, cmd["tokens"], cmd.get("copy", False))
            elif op == "batch":
                answer = decode_batch(llm, cmd["n"], cmd["tokens"])
            elif op == "workload":
                answer = workload(llm, cmd["n"])
            elif op == "gap":
                prompt_ids = llm.get_tokenizer().encode(chat_prompt(llm, cmd.get("copy", False)))
                answer = top2_gap(llm, prompt_ids + cmd["generated"])
            elif op == "perplexity":
                from minillm.evaluate import perplexity
                answer = {"perplexity": perplexity(llm, max_windows=cmd["windows"])}
            elif op == "quit":
                return
            else:
                answer = {"error": f"unknown op {op!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
