"""Lesson 11: tensor and pipeline parallelism on this CPU, and what they would cost on real GPUs.

Four parts:
1. end-to-end: LLM.generate through the batching engine with one process, tensor_parallel_size 3
   and pipeline_parallel_size 2, 3; tokens/s, and the bytes every rank sent (minillm.parallel.comm
   counts them) against the formulas: TP (2 n_layers + 1) all-reduces of dim values per token
   computed (+ one logits all-gather per sampled row), PP one dim-vector per token per boundary.
   All ranks share this machine's cores, so this measures the accounting, not a speed-up. Each
   configuration runs in a fresh interpreter: one process with 2 torch threads, each rank of the
   others with 1.
2. all-reduce latency: gloo's all-reduce (2 and 3 ranks) and send/recv (2 ranks) of (tokens, dim)
   fp32 activations for the token counts a decode or prefill step has.
3. bubble: GPipe over p stages with m micro-batches (pipeline_forward, one thread per rank, SmolLM2's
   layer shape, 2 layers per stage): the idle share of each stage, 1 - busy / wall, against
   (p - 1) / (m + p - 1).
4. calculator: Llama-3-70B in bf16 on 8 H200s, TP = 1..8 over NVLink 4 and PP = 1..8 over
   InfiniBand NDR, batch 1 and 64 at a 4096-token context (published peaks, counted times).
"""
from __future__ import annotations

import ast
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minillm.course.calculators import bubble_fraction
from minillm.model.llama import random_model, tiny_config
from minillm.parallel.calculator import pp_bytes_per_token, table, tensor_parallel_step, tp_bytes_per_token
from minillm.parallel.launch import launch
from minillm.perf.roofline import LLAMA3_70B
from .common import document

NAME = "parallel"
SMOLLM2_SHAPE = dict(vocab_size=49152, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                     rope_theta=100000.0, max_seq_len=8192)


class IdsTokenizer:
    """Token ids as text: the quick run's random model has no vocabulary (prompts are given as ids)."""
    eos_token_id = -1

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


# --- 1. end to end ------------------------------------------------------------------------------

def _llm(model, tokenizer, **kwargs):
    from minillm import LLM
    if model is None:
        return LLM(model="smollm2", dtype="float32", device="cpu", **kwargs)
    return LLM(model=model, tokenizer=tokenizer, device="cpu", max_model_len=512, **kwargs)


def end_to_end(quick: bool) -> list[dict]:
    """One row per configuration, each measured in a fresh interpreter: the CLI has imported every
    benchmark module by now, numpy among them, and with numpy's OpenBLAS threads loaded torch's 2
    spinning OpenMP threads ran the one-process engine many times slower on this 2-core machine."""
    rows = []
    for mode, size in (("single", 1), ("tensor", 3), ("pipeline", 2), ("pipeline", 3)):
        code = f"from minillm.course.benchmarks.parallel import end_to_end_row as f; print(repr(f({mode!r}, {size}, {quick})))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                              cwd=Path(__file__).resolve().parents[3])
        if done.returncode:
            raise RuntimeError(f"end-to-end {mode} x{size} failed:\n{done.stderr[-3000:]}")
        rows.append(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
    single = rows[0]["tokens_per_s"]
    for row in rows:
        row["speed_vs_single"] = row["tokens_per_s"] / single
    return rows


def end_to_end_row(mode: str, size: int, quick: bool) -> dict:
    """LLM.generate of a fixed workload with one parallel configuration: tokens/s and bytes sent."""
    from minillm import SamplingParams

    model = tokenizer = None
    if quick:                                      # SmolLM2's shape with 6 random layers
        model, tokenizer = random_model(tiny_config(**SMOLLM2_SHAPE, n_layers=6)), IdsTokenizer()
    gen = torch.Generator().manual_seed(0)
    n_prompts, prompt_len, new = (4, 32, 8) if quick else (8, 64, 16)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (prompt_len,), generator=gen).tolist()}
               for _ in range(n_prompts)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    kwargs = {"tensor": {"tensor_parallel_size": size}, "pipeline": {"pipeline_parallel_size": size}}.get(mode, {})
    with _llm(model, tokenizer, **kwargs) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        times, counts, processed = [], None, 0
        for _ in range(1 if quick else 3):
            if llm.parallel is not None:
                llm.parallel.counts(reset=True)
            first = len(llm.engine.step_log)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            processed = sum(s["num_tokens"] for s in llm.engine.step_log[first:])
            if llm.parallel is not None:
                counts = llm.parallel.counts()
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"part": "end-to-end", "mode": mode, "size": size, "processes": size, "cores": os.cpu_count(),
               "threads_per_process": torch.get_num_threads(), "tokens_generated": generated,
               "tokens_computed": processed, "tokens_per_s": generated / statistics.median(times),
               "seconds": statistics.median(times)}
        row.update(_accounting(mode, llm.config, counts, processed, generated))
    return row


def _accounting(mode: str, cfg, counts, processed: int, generated: int) -> dict:
    """Bytes each rank sent in the timed run vs the formula (fp32: 4 bytes a value)."""
    if counts is None:
        return {}
    if mode == "tensor":
        n_layers = cfg.n_layers
        sent = counts[0]["all_reduce.bytes"]
        formula = (2 * n_layers + 1) * cfg.dim * 4 * processed             # layers' 2 per layer + the embedding's
        return {"allreduce_bytes_rank0": sent, "allreduce_bytes_formula": formula,
                "allreduce_calls_per_step": counts[0]["all_reduce.calls"] / counts[0]["all_gather.calls"],
                "layer_bytes_per_computed_token": (sent - cfg.dim * 4 * processed) / processed,
                "layer_bytes_formula": 2 * n_layers * cfg.dim * 4,
                "comm_bytes_per_generated_token": (sent + counts[0]["all_gather.bytes"]) / generated,
                "metadata_bytes_per_step": counts[0]["broadcast.bytes"] / counts[0]["broadcast.calls"]}
    boundary = [c.get("send.bytes", 0) for c in counts[:-1]]               # rank r -> r + 1
    return {"activation_bytes_per_boundary": boundary, "activation_bytes_formula": cfg.dim * 4 * processed,
            "activation_bytes_per_computed_token": sum(boundary) / processed,
            "activation_bytes_per_token_formula": pp_bytes_per_token(cfg, len(counts), 4),
            "comm_bytes_per_generated_token": (sum(boundary) + counts[-1].get("send.bytes", 0)) / generated,
            "metadata_bytes_per_step": counts[0]["broadcast.bytes"] / counts[0]["broadcast.calls"]}


# --- 2. latency of one collective ----------------------------------------------------------------

def _latency_rank(rank: int, size: int, op: str, token_counts: list[int], dim: int, repeats: int) -> list[dict]:
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, dim)                                         # (tokens, dim) fp32
        times = []
        for i in range(repeats + 2):                                         # 2 warm-up rounds
            dist.barrier()
            t0 = time.perf_counter()
            if op == "send_recv":                                            # rank 0 -> rank 1
                (dist.send if rank == 0 else dist.recv)(x, 1 - rank)
            else:
                dist.all_reduce(x)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        rows.append({"tokens": tokens, "bytes": tokens * dim * 4, "median_s": statistics.median(times)})
    return rows


def collective_latency(quick: bool) -> list[dict]:
    counts, repeats, dim = ([1, 64] if quick else [1, 8, 64, 256]), (5 if quick else 30), SMOLLM2_SHAPE["dim"]
    rows = []
    for op, size in (("all_reduce", 2), ("all_reduce", 3), ("send_recv", 2)):
        for r in launch(_latency_rank, size, op, counts, dim, repeats, threads=1)[0]:
            rows.append({"part": "latency", "op": op, "ranks": size, **r, "us": r["median_s"] * 1e6})
    return rows


# --- 3. the pipeline bubble --------------------------------------------------------------------

def _bubble_rank(rank: int, size: int, micro: list[int], batch: int, seq: int, layers_per_stage: int,
                 repeats: int) -> list[dict]:
    from minillm.parallel.pipeline import pipeline_forward, stage_model
    # a 256-token vocabulary: SmolLM2's LM head alone costs more than 2 of its layers and would make the last
    # stage the slowest; the formula is for equal stages
    cfg = tiny_config(**{**SMOLLM2_SHAPE, "vocab_size": 256}, n_layers=layers_per_stage * size)
    stage = stage_model(random_model(cfg, seed=0), rank, size)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    rows = []
    for m in micro:
        idle = []
        for i in range(repeats + 1):                                         # 1 warm-up
            dist.barrier()
            timing = {}
            pipeline_forward(stage, tokens, m, timing)
            if i:
                idle.append(1 - timing["busy"] / timing["wall"])
        rows.append({"micro_batches": m, "idle_share": statistics.median(idle)})
    return rows


def bubble(quick: bool) -> list[dict]:
    micro = [1, 4] if quick else [1, 2, 4, 8]
    batch, seq, repeats = (8, 16, 1) if quick else (16, 32, 3)
    rows = []
    for p in (2, 3):
        per_rank = launch(_bubble_rank, p, micro, batch, seq, 2, repeats, threads=1)
        for i, m in enumerate(micro):
            idle = [r[i]["idle_share"] for r in per_rank]
            rows.append({"part": "bubble", "stages": p, "micro_batches": m,
                         "idle_share_measured": statistics.mean(idle), "idle_share_per_stage": idle,
                         "idle_share_formula": bubble_fraction(p, m)})
    return rows


# --- 4. the real case, on paper ------------------------------------------------------------------

def calculator() -> list[dict]:
    rows = []
    for batch in (1, 64):
        for r in table(LLAMA3_70B, "H200", range(1, 9), batch=batch, context=4096):
            rows.append({"part": "calculator", "model": "Llama-3-70B", "gpu": "H200", "batch": batch, **r})
    for link in ("NVLink 4", "InfiniBand NDR"):
        r = tensor_parallel_step(LLAMA3_70B, "H200", 8, 64, 4096, link=link)
        rows.append({"part": "calculator-tp-link", "model": "Llama-3-70B", "gpu": "H200", "batch": 64, **r})
    return rows


def run(quick: bool) -> dict:
    torch.manual_seed(0)
    results = end_to_end(quick) + collective_latency(quick) + bubble(quick) + calculator()
    e2e = {(r["mode"], r["size"]): r for r in results if r["part"] == "end-to-end"}
    tp = e2e[("tensor", 3)]
    lat = {(r["op"], r["ranks"], r["tokens"]): r["us"] for r in results if r["part"] == "latency"}
    bub = {(r["stages"], r["micro_batches"]): r for r in results if r["part"] == "bubble"}
    calc = {(r["part"], r["mode"], r["gpus"], r["batch"], r["link"]): r for r in results if r["part"].startswith("calc")}
    summary = {
        "cores": os.cpu_count(),
        "tokens_per_s": {f"{m}-{s}": r["tokens_per_s"] for (m, s), r in e2e.items()},
        "tp3_allreduce_bytes_match_formula": tp["allreduce_bytes_rank0"] == tp["allreduce_bytes_formula"],
        "tp3_layer_bytes_per_token": tp["layer_bytes_per_computed_token"],
        "pp_activation_bytes_match_formula": all(
            b == r["activation_bytes_formula"] for (m, _), r in e2e.items() if m == "pipeline"
            for b in r["activation_bytes_per_boundary"]),
        "allreduce_us_3ranks_1token": lat[("all_reduce", 3, 1)],
        "allreduce_us_3ranks_64tokens": lat[("all_reduce", 3, 64)],
        "send_recv_us_1token": lat[("send_recv", 2, 1)],
        "bubble_p2_m1": bub[(2, 1)]["idle_share_measured"], "bubble_p2_m4": bub[(2, 4)]["idle_share_measured"],
        "bubble_p3_m1": bub[(3, 1)]["idle_share_measured"], "bubble_p3_m4": bub[(3, 4)]["idle_share_measured"],
        "llama3_70b_h200_tp8_b1_ms": calc[("calculator", "TP", 8, 1, "NVLink 4")]["token_latency_s"] * 1e3,
        "llama3_70b_h200_pp8_b1_ms": calc[("calculator", "PP", 8, 1, "InfiniBand NDR")]["token_latency_s"] * 1e3,
        "llama3_70b_h200_tp8_b64_comm_ms_nvlink": calc[("calculator-tp-link", "TP", 8, 64, "NVLink 4")]["comm_s"] * 1e3,
        "llama3_70b_h200_tp8_b64_comm_ms_infiniband":
            calc[("calculator-tp-link", "TP", 8, 64, "InfiniBand NDR")]["comm_s"] * 1e3,
    }
    config = {"model": "random SmolLM2-shaped, 6 layers" if quick else "SmolLM2-135M fp32",
              "cores": os.cpu_count(), "backend": "gloo (CPU)",
              "note": "all ranks share this machine's cores: the end-to-end rows measure the accounting, not a speed-up",
              "timing": "median of repeated runs after a warm-up; latency: median of repeated collectives after 2 "
                        "warm-ups, one thread per rank",
              "formulas": {"tp_layer_bytes_per_token": "2 x n_layers x dim x dtype bytes",
                           "pp_bytes_per_token": "(stages - 1) x dim x dtype bytes",
                           "bubble": "(p - 1) / (m + p - 1)"},
              "calculator_tp_bytes_per_token_llama3_70b_bf16": tp_bytes_per_token(LLAMA3_70B, 2)}
    return document(NAME, config, results, summary)
