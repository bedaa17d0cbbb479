"""Lesson 09: the OpenAI-compatible server under load: throughput, TTFT and TPOT against request rate.

minillm's server (minillm/serving/server.py) runs in this process on loopback; an open-loop load
generator sends chat requests with Poisson arrivals at each rate (a fixed number of requests
per rate), each from its own thread through the official openai client, streamed, so time to
first token is measured on the client side, as a user would see it. Greedy with ignore_eos:
every request produces exactly max_tokens tokens, so the work per request is fixed and only
the arrival rate changes.

Per rate: output tokens/s (all tokens / time from the first request sent to the last token),
completed requests/s, TTFT p50/p99 (request sent -> first content chunk), TPOT p50/p99
((last token - first token) / (tokens - 1)), end-to-end latency p50, and the mean number of
requests the engine ran per step during that rate (how much batching the load bought).

Client threads and the server share this process and its cores; the numbers include that
overhead, as a real deployment's would include its network stack.

Then the server under faults (summary["faults"]): one burst of hostile_traffic.py's mixed traffic
(openai-client requests of which a third hang up, malformed and hypothesis-generated bodies,
odd-but-valid ones) against a second server with a short context and a tight KV pool; counted:
requests served, hang-ups, 429s, bad inputs and how they were answered, 5xx answers to client
errors, engine failures, and after the burst what is still running, waiting or holding KV blocks.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import hostile_traffic
from .batching import percentiles
from .common import document

NAME = "serve"
QUESTIONS = ["What is a KV cache?", "Explain continuous batching in two sentences.",
             "Write a haiku about the sea.", "Give me three tips for readable Python code.",
             "What is the difference between a list and a tuple?", "Why is the sky blue?",
             "Summarise the plot of Hamlet.", "What does an operating system do?"]


def poisson_arrivals(rate: float, num_requests: int, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start: exponential gaps with mean 1 / rate, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)
    return np.cumsum(gaps) - gaps[0]


def timed_chat(client, model: str, question: str, max_tokens: int) -> dict:
    """One streamed chat request; client-side times of sending, first and last content chunk."""
    sent = time.perf_counter()
    chunk_times, usage = [], None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunk_times.append(time.perf_counter())
        usage = chunk.usage or usage
    tokens = usage.completion_tokens
    return {"sent": sent, "first": chunk_times[0], "last": chunk_times[-1], "tokens": tokens,
            "ttft": chunk_times[0] - sent,
            "tpot": (chunk_times[-1] - chunk_times[0]) / (tokens - 1) if tokens > 1 else None}


def load_test(base_url: str, model: str, rate: float, num_requests: int, max_tokens: int, seed: int = 0) -> dict:
    """Open loop: request i is sent at its Poisson arrival time whether or not earlier ones finished."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    start = time.perf_counter()

    def at(send_time: float, question: str) -> dict:
        time.sleep(max(0.0, start + send_time - time.perf_counter()))
        return timed_chat(client, model, question, max_tokens)

    with ThreadPoolExecutor(num_requests) as pool:
        futures = [pool.submit(at, t, QUESTIONS[i % len(QUESTIONS)])
                   for i, t in enumerate(poisson_arrivals(rate, num_requests, seed))]
        done = [f.result() for f in futures]
    client.close()
    wall = max(d["last"] for d in done) - min(d["sent"] for d in done)
    tokens = sum(d["tokens"] for d in done)
    ttft, tpot = percentiles(d["ttft"] for d in done), percentiles(d["tpot"] for d in done)
    return {"rate_req_s": rate, "num_requests": num_requests, "max_tokens": max_tokens, "seconds": wall,
            "output_tok_s": tokens / wall, "completed_req_s": num_requests / wall,
            "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
            "tpot_p50_ms": 1e3 * tpot["p50"], "tpot_p99_ms": 1e3 * tpot["p99"],
            "e2e_p50_s": percentiles(d["last"] - d["sent"] for d in done)["p50"]}


def plot(rows: list[dict]):
    """Throughput, TTFT and TPOT against the offered load; returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    rates = [r["rate_req_s"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(11, 3.3))
    a.plot(rates, [r["output_tok_s"] for r in rows], "o-")
    a.set_ylabel("output tokens/s")
    for key, label in (("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")):
        b.plot(rates, [r[key] for r in rows], "o-", label=label)
    b.set_ylabel("TTFT (s)")
    for key, label in (("tpot_p50_ms", "p50"), ("tpot_p99_ms", "p99")):
        c.plot(rates, [r[key] for r in rows], "o-", label=label)
    c.set_ylabel("TPOT (ms)")
    for ax in (a, b, c):
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("offered load (requests/s)")
    b.legend(); c.legend()
    fig.suptitle("minillm serve, SmolLM2-135M, streamed chat requests (Poisson arrivals)")
    fig.tight_layout()
    return fig


def fault_run(num_load: int, num_generated: int, seed: int = 0) -> dict:
    """One burst of mixed hostile traffic against a fresh server; the counts before and after."""
    import httpx
    import openai

    from minillm import LLM
    from minillm.serving.server import ServerThread, build_app

    llm = LLM(model="smollm2", device="auto", **hostile_traffic.server_llm_args())
    with ServerThread(build_app(llm, served_model_name=hostile_traffic.MODEL)) as server:
        start = time.perf_counter()
        outcomes = hostile_traffic.burst(server.base_url, num_load, num_generated, seed)
        seconds = time.perf_counter() - start
        after = hostile_traffic.drained_metrics(server.url, timeout_s=30.0)
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        same, served = hostile_traffic.same_as_alone(client, outcomes)
        health = httpx.get(f"{server.url}/health").status_code

    def count(kind, test):
        return sum(o.kind == kind and test(o.result) for o in outcomes)

    raw_kinds = ("bad", "odd")
    return {
        "load_requests": num_load, "served": served, "served_same_text_as_alone": same,
        "hung_up": count("load", lambda r: r[0] == "hung_up"),
        "rejected_429": count("load", lambda r: r[0] == "rejected"),
        "bad_inputs": sum(o.kind == "bad" for o in outcomes),
        "bad_inputs_answered_4xx": count("bad", lambda r: hostile_traffic.is_openai_error(*r)),
        "odd_valid_inputs": sum(o.kind == "odd" for o in outcomes),
        "odd_valid_answered_200": count("odd", lambda r: hostile_traffic.is_well_formed_completion(*r)),
        "client_inputs_answered_5xx": sum(count(kind, lambda r: r[0] >= 500) for kind in raw_kinds),
        "engine_failures": int(after["vllm:request_success_total{finished_reason=error}"]),
        "aborted": int(after["vllm:request_success_total{finished_reason=abort}"]),
        "preemptions": int(after["vllm:num_preemptions_total"]),
        "running_after": int(after["vllm:num_requests_running"]),
        "waiting_after": int(after["vllm:num_requests_waiting"]),
        "leaked_kv_blocks": int(after["minillm:kv_blocks_used"]), "num_kv_blocks": hostile_traffic.NUM_KV_BLOCKS,
        "health_after": health, "burst_seconds": seconds,
    }


def run(quick: bool) -> dict:
    from minillm import LLM
    from minillm.serving.server import ServerThread, build_app

    rates = [1.0, 4.0] if quick else [0.5, 1.0, 2.0, 4.0]
    num_requests, max_tokens = (4, 8) if quick else (32, 64)
    llm = LLM(model="smollm2", dtype="float32", device="auto")
    results = []
    with ServerThread(build_app(llm, served_model_name="smollm2")) as server:
        load_test(server.base_url, "smollm2", rate=100.0, num_requests=2, max_tokens=4)     # warm-up
        for rate in rates:
            first_step = len(llm.engine.step_log)       # the engine appends; this thread only reads
            row = load_test(server.base_url, "smollm2", rate, num_requests, max_tokens)
            steps = llm.engine.step_log[first_step:]
            row["mean_running_requests"] = float(np.mean([s["num_seqs"] for s in steps]))
            results.append(row)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = "results/quick/serve.png" if quick else "results/serve.png"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig = plot(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    keys = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "mean_running_requests")
    summary = {key: {str(r["rate_req_s"]): r[key] for r in results} for key in keys}      # per rate
    summary["max_output_tok_s"] = max(r["output_tok_s"] for r in results)
    num_load, num_generated = (16, 10) if quick else (256, 100)
    summary["faults"] = fault_run(num_load, num_generated)
    config = {"model": "smollm2", "dtype": "float32", "device": str(llm.device), "rates_req_s": rates,
              "num_requests_per_rate": num_requests, "max_tokens": max_tokens, "ignore_eos": True,
              "temperature": 0, "client": "openai (sync), one thread per request, streamed, in-process, loopback",
              "plot": path,
              "faults": {"load_requests": num_load, "generated_bad_bodies": num_generated,
                         "hand_written_bad_bodies": len(hostile_traffic.MALFORMED), "seed": 0,
                         "server": hostile_traffic.server_llm_args(), "max_tokens_served": hostile_traffic.MAX_TOKENS,
                         "max_tokens_hang_ups": hostile_traffic.HANGUP_MAX_TOKENS}}
    return document(NAME, config, results, summary)
