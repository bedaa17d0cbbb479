"""Lessons 07 and 08: the small step. How long a step of a few rows takes, by the path it takes.

    python -m minillm bench small-step [--quick] [--json results/small-step-amd.json]

A step of 1-8 new tokens is what batch-1 speculation verifies (one request, 1 + k rows) and what a lightly loaded
server decodes (a few requests, one row each). Its weights are read once whatever the rows, so on a CPU it should
cost about what one row costs. Two ways to run the same batch through ModelRunner.forward, SmolLM2 in fp32 and bf16:
    small     the compiled small step: every row a query of its own, projections by the few-row kernel over the
              weights in row blocks (model/cpu_gemm.c; one row: the generated GEMV loops)
    batched   what these rows run where the small step does not take them (runner.small_step_rows = 1): a run,
              the compiled batched step (prepacked library GEMMs, attention outside the graph); decode rows,
              where the C attention kernel attends, its decode-only form (the same GEMMs and the kernel's op in
              one graph per layer)
Shapes: one request's run of R rows continuing its cached context (R = 1, 2, 4, 8: a verification of R - 1 drafts),
and R requests with one decode row each (R = 2, 4, 8), all after PROMPT_TOKENS of context. The two ways alternate in
each of `rounds` rounds, each timed as the median of `repeats` calls after a warm-up; medians over rounds.
Recorded beside the times: the verification cost ratio v = t(R rows) / t(1 row) that lesson 08's speed-up formula
uses, and the largest logit difference between the two ways (fp32: summation order only).
"""
from __future__ import annotations

import statistics

import torch

from minillm.perf.timing import time_median
from . import common

NAME = "small-step"
RUNS = (1, 2, 4, 8)               # rows of one request's run
DECODES = (2, 4, 8)               # requests with one decode row each
PROMPT_TOKENS = 48


def settings(quick: bool) -> dict:
    if quick:
        return dict(dtypes=("float32",), rounds=2, repeats=3)
    return dict(dtypes=("float32", "bfloat16"), rounds=5, repeats=15)


def prepared(llm, requests: int = 8):
    """`requests` requests of PROMPT_TOKENS tokens prefilled and decoded a few steps, held in the engine (their
    context stays cached) -> (engine, requests)."""
    from minillm import SamplingParams

    engine = llm.engine
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 20 for j in range(PROMPT_TOKENS)]} for i in range(requests)]
    reqs = llm.make_requests(prompts, SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    for req in reqs:
        engine.add_request(req)
    for _ in range(12):
        engine.step()
    return engine, reqs


def batch_of(engine, runs: list[tuple]) -> object:
    """A PagedBatch of (request, rows) runs that recompute each request's last `rows` cached positions (their
    slots exist; the K/V written is what is there), every row's logits wanted."""
    from minillm.model.runner import build_batch

    bm, parts = engine.block_manager, []
    for req, rows in runs:
        start = req.num_computed_tokens - rows
        parts.append((req.all_token_ids[start:start + rows], start, bm.block_table(req.request_id),
                      bm.slot_mapping(req.request_id, start, start + rows)))
    return build_batch(parts, ["all"] * len(parts), bm.block_size, engine.kv.k.device, engine.decode_group_cost)


def measure(llm, dtype_name: str, rounds: int, repeats: int) -> list[dict]:
    """The two ways on every shape, alternating within each round -> one row per shape."""
    engine, reqs = prepared(llm)
    runner = engine.runner
    if runner.small_step_rows < max(RUNS):
        raise RuntimeError(f"this engine's small step takes {runner.small_step_rows} row(s) (the few-row kernel: "
                           f"{runner.compile_failed or 'not usable here'}); nothing to compare")
    shapes = [(f"run of {r}", [(reqs[0], r)]) for r in RUNS] + [(f"{r} decodes", [(q, 1) for q in reqs[:r]])
                                                                 for r in DECODES]
    batches = {name: batch_of(engine, runs) for name, runs in shapes}
    times = {(name, way): [] for name, _ in shapes for way in ("small", "batched")}
    logits = {}
    with torch.no_grad():
        for _ in range(rounds):
            for way, rows in (("small", runner.small_step_rows), ("batched", 1)):
                saved, runner.small_step_rows = runner.small_step_rows, rows
                try:
                    for name, _ in shapes:
                        batch = batches[name]
                        times[(name, way)].append(1000 * time_median(lambda: runner.forward(batch), repeats, 2))
                        logits[(name, way)] = runner.forward(batch).float()
                finally:
                    runner.small_step_rows = saved
    one_row = {way: statistics.median(times[("run of 1", way)]) for way in ("small", "batched")}
    out = []
    for name, runs in shapes:
        small, batched = (statistics.median(times[(name, way)]) for way in ("small", "batched"))
        out.append({"dtype": dtype_name, "shape": name, "rows": sum(r for _, r in runs), "small_ms": small,
                    "batched_ms": batched, "small_speedup": batched / small,
                    "small_vs_one_row": small / one_row["small"], "batched_vs_one_row": batched / one_row["small"],
                    "max_logit_diff": (logits[(name, "small")] - logits[(name, "batched")]).abs().max().item()})
    for req in reqs:
        engine.abort_request(req.request_id)
    return out


def run(quick: bool) -> dict:
    from minillm.llm import LLM

    cfg = settings(quick)
    rows = []
    for dtype_name in cfg["dtypes"]:
        llm = LLM(model="smollm2", dtype=dtype_name, device="cpu", max_num_seqs=16)
        got = measure(llm, dtype_name, cfg["rounds"], cfg["repeats"])
        print(common.format_table(got, ["dtype", "shape", "small_ms", "batched_ms", "small_speedup",
                                        "small_vs_one_row", "batched_vs_one_row", "max_logit_diff"]), flush=True)
        rows += got
        del llm
    summary = {f"{r['dtype']}_{r['shape'].replace(' ', '_')}": {k: r[k] for k in ("small_ms", "batched_ms",
                                                                                   "small_speedup", "small_vs_one_row",
                                                                                   "batched_vs_one_row")}
               for r in rows}
    return common.document(NAME, {"model": "SmolLM2-135M-Instruct", "prompt_tokens": PROMPT_TOKENS, **cfg,
                                  "quick": quick}, rows, summary)
