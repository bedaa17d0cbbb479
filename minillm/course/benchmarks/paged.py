"""Lesson 06: how much KV memory holds real tokens, contiguous vs paged, and what prefix caching saves.

Three parts, the first two without a model (they are about memory bookkeeping, so they run the
real BlockManager against simple reservation allocators on a synthetic request trace):

1. KV utilisation and concurrency: a long-tailed backlog served from a fixed KV budget under the vLLM
   paper's four policies (contiguous max / pow2 / oracle reservations, and the BlockManager's blocks), as
   minillm/stages/kv_allocation.py simulates them. While requests are waiting (the system is memory-bound),
   each step records used = tokens whose K/V is stored and allocated = slots handed to requests; reported:
   used / allocated (the share of allocated KV memory holding real tokens) and the running sequences.
2. Prefix caching bookkeeping: N requests share a 1024-token system prompt; prefill tokens computed
   with and without caching (from BlockManager.allocate's num_cached_tokens).
3. On a GPU only: the paged decode kernel's cost on scattered 16-token pages vs the same kernel on
   contiguous memory (one page per sequence), and vs torch SDPA on a contiguous padded cache.

4. TTFT with and without prefix caching on the real model through the engine: requests that
   share a 1024-token system prompt, one after another (TTFT = the prefill each one needs).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from minillm.attention.paged import block_table_tensor
from minillm.course.calculators import kv_cache_bytes
from minillm.engine.request import Request as EngineRequest
from minillm.kvcache.block_manager import BlockManager
from minillm.stages.kv_allocation import ContiguousPolicy, PagedPolicy, make_workload, simulate
from .common import document

NAME = "paged"
RESULTS = Path(__file__).resolve().parents[3] / "results"

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; bf16 K/V
KV_BYTES_PER_TOKEN = kv_cache_bytes(30, 3, 64, 1, 1, 2)


# --- the trace ---------------------------------------------------------------------------

def describe(values) -> dict:
    v = np.asarray(values)
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p90": float(np.percentile(v, 90)),
            "max": int(v.max())}


# --- prefix caching ---------------------------------------------------------------------

def prefix_sharing(num_requests: int, system_len: int, block_size: int, seed: int = 0) -> dict:
    """N requests = one shared system prompt + a different user question each (20-80 tokens)."""
    rng = np.random.default_rng(seed)
    system = list(range(1000, 1000 + system_len))
    bm = BlockManager(num_blocks=4 * num_requests * (system_len // block_size + 8), block_size=block_size,
                      enable_prefix_caching=True)
    rows = []
    for i in range(num_requests):
        question = rng.integers(5000, 6000, int(rng.integers(20, 81))).tolist()
        req = EngineRequest.from_token_ids(str(i), system + question)
        cached = bm.allocate(req)
        req.num_computed_tokens = req.num_tokens         # prefilled: its full blocks become findable
        bm.cache_blocks(req)
        rows.append({"request": i, "prompt_tokens": req.num_tokens, "cached_tokens": cached,
                     "computed_tokens": req.num_tokens - cached})
        if i % 2:                                        # half finish at once: hits on freed blocks too
            bm.free(req.request_id)
    later = rows[1:]
    return {
        "rows": rows,
        "prefill_tokens_without_caching": sum(r["prompt_tokens"] for r in rows),
        "prefill_tokens_with_caching": sum(r["computed_tokens"] for r in rows),
        "prefix_reuse_fraction": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
    }


def prefix_ttft(num_requests: int, system_len: int) -> dict:
    """The real model through the engine: requests that share a system prompt of system_len
    tokens (a passage of the evaluation text) and differ in a short question, served one after
    another, with and without prefix caching, interleaved. TTFT of each request = its prefill."""
    from minillm import LLM, SamplingParams
    from minillm.evaluate import evaluation_text

    plain = LLM(model="smollm2", dtype="float32", device="cpu", max_model_len=system_len + 256)
    tok = plain.get_tokenizer()
    cached = LLM(model=plain.model, tokenizer=tok, device="cpu", max_model_len=system_len + 256,
                 enable_prefix_caching=True)
    system = tok.encode(evaluation_text())[:system_len]
    questions = [f"Question {i}: what is the main point of the passage above, in {i + 3} words?"
                 for i in range(num_requests)]
    prompts = [{"prompt_token_ids": system + tok.encode(q)} for q in questions]
    params = SamplingParams(temperature=0, max_tokens=1)
    plain.generate(prompts[:1], params, use_tqdm=False)                 # warm-up, nothing cached
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"request": i, "prompt_tokens": len(prompt["prompt_token_ids"])}
        for name, llm in (("no_cache", plain), ("prefix_cache", cached)):
            (req,) = llm.make_requests([prompt], params)
            llm.engine.run([req])
            row[f"ttft_{name}_s"] = req.metrics.time_to_first_token
            if name == "prefix_cache":
                row["cached_tokens"] = req.num_cached_tokens
        rows.append(row)
    later = rows[1:]
    ratio = float(np.median([r["ttft_no_cache_s"] for r in later]) / np.median([r["ttft_prefix_cache_s"] for r in later]))
    return {"rows": rows, "ttft_ratio_later_requests": ratio}


# --- the kernel on a GPU ----------------------------------------------------------------

def kernel_paging_cost(shapes: list[tuple[int, int]], device: str = "cuda") -> list[dict]:
    """Decode attention time for (batch, seq_len) shapes: the paged kernel on scattered 16-token
    pages vs the same kernel on contiguous memory (one page per sequence) vs SDPA."""
    from kernels.paged_attention import paged_attention_decode

    from minillm.perf.kernel_timing import time_kernel

    rows = []
    Hq, Hkv, D, dtype = 32, 8, 128, torch.bfloat16              # Llama-3-8B-like attention
    for batch, seq_len in shapes:
        gen = torch.Generator().manual_seed(0)
        per_seq = seq_len // 16
        k_pages = torch.randn(batch * per_seq, 16, Hkv, D, generator=gen).to(device, dtype)
        v_pages = torch.randn(batch * per_seq, 16, Hkv, D, generator=gen).to(device, dtype)
        order = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
        q = torch.randn(batch, Hq, D, generator=gen).to(device, dtype)
        lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        paged_tables = block_table_tensor(order.tolist(), device)
        # the same K/V laid out contiguously: one page of seq_len tokens per sequence
        k_flat = k_pages[order.to(device)].reshape(batch, seq_len, Hkv, D)   # (B, L, Hkv, D)
        v_flat = v_pages[order.to(device)].reshape(batch, seq_len, Hkv, D)
        contiguous_tables = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
        k_sdpa = k_flat.transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, L, D)
        v_sdpa = v_flat.transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
        num_splits = max(1, min(16, 132 * 2 // (batch * Hkv)))              # fill the SMs when B is small
        timings = {
            "paged_ms": lambda: paged_attention_decode(q, k_pages, v_pages, paged_tables, lens,
                                                       num_splits=num_splits),
            "contiguous_ms": lambda: paged_attention_decode(q, k_flat, v_flat, contiguous_tables, lens,
                                                            num_splits=num_splits),
            "sdpa_ms": lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k_sdpa, v_sdpa),
        }
        row = {"batch": batch, "seq_len": seq_len, "num_splits": num_splits}
        for name, fn in timings.items():
            timing = time_kernel(fn, device=device)
            row[name] = 1e3 * timing["median_s"]
        row["timing"] = timing["method"]
        row["paging_overhead"] = row["paged_ms"] / row["contiguous_ms"] - 1
        rows.append(row)
    return rows


# --- the benchmark ----------------------------------------------------------------------

def run(quick: bool) -> dict:
    max_model_len, block_size = 2048, 16
    num_requests = 300 if quick else 2000
    budget = 16384 if quick else 32768                  # KV slots (tokens) shared by all requests
    requests = make_workload(num_requests, max_model_len)
    config = {
        "workload": "log-normal prompt and output lengths (median 150, sigma 1.0), clipped to "
                    f"prompt <= {max_model_len // 2}, prompt + output <= {max_model_len}; all requests "
                    "queued at t=0, served FCFS, one decode token per running request per step",
        "num_requests": num_requests, "max_model_len": max_model_len, "block_size": block_size,
        "kv_budget_tokens": budget,
        "kv_budget_MiB_smollm2_bf16": budget * KV_BYTES_PER_TOKEN / 2 ** 20,
        "prompt_len": describe([r.prompt_len for r in requests]),
        "output_len": describe([r.output_len for r in requests]),
        "paged_admission_watermark": 0.01,
        "measured_while": "requests are waiting (memory-bound phase)",
    }
    policies = {
        "contiguous-max": ContiguousPolicy("max", budget, max_model_len),
        "contiguous-pow2": ContiguousPolicy("pow2", budget, max_model_len),
        "contiguous-oracle": ContiguousPolicy("oracle", budget, max_model_len),
        "paged": PagedPolicy(budget, block_size),
    }
    results, traces = [], {}
    for name, policy in policies.items():
        sim = simulate(policy, requests)
        traces[name] = sim.pop("trace")
        row = {"part": "kv-memory", "policy": name, **sim,
               "pool_utilization": sim.pop("pool_tokens_used") / budget}
        if isinstance(policy, PagedPolicy):       # no external fragmentation: any free block will do
            row.update(preemptions=policy.preemptions, recomputed_tokens=policy.recomputed_tokens,
                       fragmentation_stalls=0)
        else:                                     # a reservation covers the whole request: never preempted
            row.update(preemptions=0, recomputed_tokens=0, fragmentation_stalls=policy.fragmentation_stalls)
        results.append(row)
    by = {r["policy"]: r for r in results}

    sharing = prefix_sharing(num_requests=8 if quick else 16, system_len=1024, block_size=block_size)
    results.append({"part": "prefix-caching", "requests": len(sharing["rows"]), "system_prompt_tokens": 1024,
                    "prefill_tokens_without_caching": sharing["prefill_tokens_without_caching"],
                    "prefill_tokens_with_caching": sharing["prefill_tokens_with_caching"],
                    "prefix_reuse_fraction": sharing["prefix_reuse_fraction"]})

    summary = {
        "kv_utilization_paged": by["paged"]["kv_utilization"],
        "kv_utilization_contiguous": by["contiguous-max"]["kv_utilization"],
        "kv_utilization_pow2": by["contiguous-pow2"]["kv_utilization"],
        "kv_utilization_oracle": by["contiguous-oracle"]["kv_utilization"],
        "concurrency_paged_over_contiguous": by["paged"]["mean_running"] / by["contiguous-max"]["mean_running"],
        "concurrency_paged_over_pow2": by["paged"]["mean_running"] / by["contiguous-pow2"]["mean_running"],
        "concurrency_paged_over_oracle": by["paged"]["mean_running"] / by["contiguous-oracle"]["mean_running"],
        "prefix_reuse_fraction": sharing["prefix_reuse_fraction"],
        "prefill_tokens_saved_fraction": 1 - sharing["prefill_tokens_with_caching"]
        / sharing["prefill_tokens_without_caching"],
    }
    ttft = prefix_ttft(num_requests=3 if quick else 8, system_len=256 if quick else 1024)
    results += [{"part": "prefix-ttft", **row} for row in ttft["rows"]]
    summary["ttft_ratio_prefix_caching"] = ttft["ttft_ratio_later_requests"]
    if torch.cuda.is_available():
        shapes = [(8, 1024), (32, 2048)] if quick else [(1, 4096), (8, 1024), (32, 2048), (64, 4096)]
        kernel_rows = kernel_paging_cost(shapes)
        results += [{"part": "kernel-gpu", **row} for row in kernel_rows]
        summary["kernel_paging_overhead_median"] = float(np.median([r["paging_overhead"] for r in kernel_rows]))
    else:
        summary["kernel_paging_overhead_median"] = None   # not measured: no GPU on this machine
    if not quick:
        _plot(results, traces, RESULTS / "paged.png")
    return document(NAME, config, results, summary)


def _plot(results: list[dict], traces: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = [r for r in results if r["part"] == "kv-memory"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["policy"] for r in memory]
    shares = [100 * r["kv_utilization"] for r in memory]
    left.bar(names, shares, color=["#bbb", "#999", "#777", "#2a7"])
    for i, s in enumerate(shares):
        left.text(i, s + 1, f"{s:.1f}%", ha="center")
    left.set_ylabel("allocated KV slots holding a real token (%)")
    left.set_ylim(0, 110)
    left.set_title("KV utilisation (memory-bound phase)")
    left.tick_params(axis="x", labelrotation=15)
    for name, trace in traces.items():
        right.plot(trace, label=name)
    right.set_xlabel("decode step")
    right.set_ylabel("running sequences")
    right.set_title("sequences that fit the same KV budget")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
