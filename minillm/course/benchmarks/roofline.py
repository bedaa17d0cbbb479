"""Lesson 01: where the time goes in batch-1 decode on this machine.

Measures the machine (read bandwidth: the faster of a GEMV and a plain read, sampled between the
timed runs and the fastest kept; GEMM FLOP/s: the fastest of torch's a @ b and each prepacking
library), the model's bytes and FLOPs per token,
and three decode speeds side by side: the naive baseline (no cache), the KV-cached runner,
and a loop that does nothing but the model's weight GEMVs (the physics floor actually reached).
Then the read bandwidth over time, with two threads and with one (bandwidth_over_time): on a VM it
is not one number.
"""
from __future__ import annotations

import time

import torch

from minillm.loading.loader import load_model
from minillm.perf import roofline
from minillm.stages.fast_decode import FastDecoder, fuse_projections, weights_only_step
from minillm.stages.kv_cache import generate_greedy_naive
from .common import document, time_median

NAME = "roofline"


def bandwidth_over_time(samples: int, seconds_apart: float = 0.5, mbytes: int = 512) -> dict:
    """fp32 read bandwidth (GB/s) sampled `samples` times, seconds_apart apart, with every thread and
    with one; and the lowest and highest of the all-thread samples."""
    probe = roofline.BandwidthProbe(mbytes)
    threads = torch.get_num_threads()
    series = {}
    try:
        for n in (threads, 1):
            torch.set_num_threads(n)
            first = len(probe.samples)
            for _ in range(samples):
                probe.sample(3)
                time.sleep(seconds_apart)
            series[f"threads_{n}"] = [b / 1e9 for b in probe.samples[first:]]
    finally:
        torch.set_num_threads(threads)
    every = series[f"threads_{threads}"]
    return {"seconds_apart": seconds_apart, **series, "lowest_GBps": min(every), "highest_GBps": max(every)}


def run(quick: bool) -> dict:
    prompt_len, new_tokens = (16, 8) if quick else (16, 32)
    repeats = 3 if quick else 5
    results = []
    summary = {}
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model, _ = load_model("smollm2", dtype=dtype_name, device="cpu")
        elem = torch.tensor([], dtype=dtype).element_size()
        probe = roofline.BandwidthProbe(256 if quick else 512, dtype=dtype)
        probe.sample(repeats)
        by_route = roofline.measure_gemm_rates(1024 if quick else 2048, dtype, repeats)
        flops = max(by_route.values())                                    # the fastest library: the machine's peak
        wbytes = roofline.weight_bytes(model.cfg, elem)
        prompt = list(range(100, 100 + prompt_len))
        # the naive baseline only in fp32: it is the reference, and minutes slower in bf16 on CPU
        t_naive = (time_median(lambda: generate_greedy_naive(model, prompt, new_tokens), repeats=1)
                   if dtype_name == "float32" else float("nan"))
        decoder = FastDecoder(fuse_projections(model))                   # lesson 02's fast path
        decoder.tune()                                                    # bf16: the faster compiled build, once
        t_cached = time_median(lambda: decoder.generate_greedy(prompt, new_tokens), repeats=repeats)
        probe.sample(repeats)
        t_floor = time_median(lambda: weights_only_step(model), repeats=20)
        probe.sample(repeats)
        bandwidth = probe.best
        bound = bandwidth / wbytes
        row = {
            "dtype": dtype_name, "params_M": model.cfg.num_parameters() / 1e6, "weight_MB": wbytes / 1e6,
            "bandwidth_GBps": bandwidth / 1e9, "bandwidth_samples_GBps": [b / 1e9 for b in probe.samples],
            "gemm_GFLOPs": flops / 1e9, "gemm_GFLOPs_by_route": {k: v / 1e9 for k, v in by_route.items()},
            "ridge_flop_per_byte": flops / bandwidth,
            "decode_intensity": roofline.arithmetic_intensity(model.cfg, elem, 1, prompt_len),
            "prefill512_intensity": roofline.arithmetic_intensity(model.cfg, elem, 512, 0),
            "bound_tok_s": bound,
            "naive_tok_s": new_tokens / t_naive, "cached_tok_s": new_tokens / t_cached,
            "weights_only_tok_s": 1 / t_floor, "decode_build": decoder.build,
        }
        row["cached_fraction_of_bound"] = row["cached_tok_s"] / bound
        results.append(row)
        summary[f"bandwidth_bound_tok_s_{dtype_name}"] = bound
        summary[f"naive_tok_s_{dtype_name}"] = row["naive_tok_s"]
        summary[f"cached_tok_s_{dtype_name}"] = row["cached_tok_s"]
        del model, probe
    summary["bandwidth_over_time"] = bandwidth_over_time(10 if quick else 40)
    config = {"prompt_len": prompt_len, "new_tokens": new_tokens, "batch": 1, "greedy": True,
              "repeats": repeats, "time": time.strftime("%Y-%m-%d %H:%M")}
    return document(NAME, config, results, summary)
