"""Lesson 09, section 3: which thread steps the engine, measured.

    python -m minillm bench engine-thread [--quick] [--json results/engine-thread-amd.json]

One engine (bf16 SmolLM2 as `minillm serve` builds it: bench peers' folder, max_num_seqs 64, prefix caching on,
warmed by serving.server.warm_up) runs the same closed-loop load (serve_peers.engine_alone: INPUT_LEN-token random
prompts, OUTPUT_LEN output tokens, at most `concurrency` requests in the engine) stepped in one of two places:
    loader thread   the thread that loaded and warmed the model (what `minillm serve` does now)
    new thread      a thread started for the run (what an in-process server's engine thread is, and what
                    `minillm serve` did before)
Nothing else differs: no HTTP, no client. The two alternate within each of ROUNDS rounds; medians over rounds.

Why they differ: torch's OpenMP runtime (libgomp) keeps a pool of worker threads for each thread that opens
parallel regions. The loader thread's pool stays; a second thread's pool pushes the process's managed threads past
the number of cores, and libgomp then spins only briefly at its barriers before sleeping in the kernel (its
"throttled" spin count), so every parallel region pays for waking its workers. Recorded beside the times: the
process's OS thread count after each run (the second pool's workers show up there).
"""
from __future__ import annotations

import os
import statistics
import threading

from . import common

NAME = "engine-thread"
ROUNDS = 3
CONCURRENCY = (1, 4, 16)
OUTPUT_LEN = 64


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def on_new_thread(fn, *args):
    """fn(*args) on a thread started for it -> its result (its exception re-raised here)."""
    out = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as e:                   # noqa: BLE001 - handed back to the caller
            out["error"] = e

    thread = threading.Thread(target=target, name="engine-on-new-thread")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def measure(llm, concurrency: int, prompts: int, output_len: int, where: str) -> dict:
    from .serve_peers import engine_alone

    point = (engine_alone(llm, concurrency, prompts, output_len) if where == "loader thread"
             else on_new_thread(engine_alone, llm, concurrency, prompts, output_len))
    return {**point, "os_threads_after": os_threads()}


def run(quick: bool) -> dict:
    from minillm import LLM
    from minillm.serving.server import warm_up

    from .peers import weights_folder
    from .serve_peers import INPUT_LEN, MAX_NUM_SEQS

    concurrencies, rounds, output_len = ((2,), 1, 8) if quick else (CONCURRENCY, ROUNDS, OUTPUT_LEN)
    llm = LLM(model=str(weights_folder()), dtype="bfloat16", max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=True)
    warm_up(llm)
    threads_loaded = os_threads()
    places = ("loader thread", "new thread")
    runs = {(c, w): [] for c in concurrencies for w in places}
    for r in range(rounds):
        for c in concurrencies:
            for where in (places if r % 2 == 0 else places[::-1]):
                runs[c, where].append(measure(llm, c, max(8, 2 * c), output_len, where))
                print(c, where, runs[c, where][-1], flush=True)
    rows = []
    for c in concurrencies:
        row = {"concurrency": c, "requests": max(8, 2 * c)}
        for where in places:
            key = where.split()[0]
            for metric in ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms"):
                row[f"{key}_{metric}"] = statistics.median(x[metric] for x in runs[c, where])
            row[f"{key}_os_threads_after"] = max(x["os_threads_after"] for x in runs[c, where])
        row["new_over_loader_tpot"] = row["new_tpot_p50_ms"] / row["loader_tpot_p50_ms"]
        row["loader_over_new_output_tok_s"] = row["loader_output_tok_s"] / row["new_output_tok_s"]
        rows.append(row)
    llm.close()
    config = {"model": "SmolLM2-135M-Instruct, bf16 (bench peers' transformers folder), as minillm serve builds it",
              "workload": f"closed loop, {INPUT_LEN}-token random prompts, {output_len} output tokens, greedy, "
                          "ignore_eos; requests per point max(8, 2 x concurrency)",
              "rounds": rounds, "order": "the two places alternate within each round; medians over rounds",
              "quick": quick}
    return common.document(NAME, config, rows, {"os_threads_after_warm_up": threads_loaded,
                                                "per_round": {f"{c} {w}": v for (c, w), v in runs.items()}})
