"""Timing a GPU kernel so that the number is the kernel's, not the launch's.

`perf_counter(); fn(); synchronize()` around ONE call measures the Python call, the launch
(microseconds on a GPU) and the synchronisation round trip; a kernel that runs for a few microseconds
then reads several times longer, and a "bandwidth" from it comes out at a fraction of the card's. The old results/gpu/
files were timed that way (lesson 04 explains what went wrong). Here:

    cuda events    start/end events recorded around each call on the GPU's own clock, so host
                   time outside the GPU work is not counted; every sample is preceded by writing
                   a buffer twice the L2 size (flush_l2=True), which (a) evicts the previous call's
                   data, so a bandwidth-bound kernel reads from HBM as it would in a model, and
                   (b) keeps the GPU busy while the host enqueues the call, so the launch latency
                   is hidden behind the flush, not added to the sample;
    cuda graph     (cuda_graph=True) `calls_per_sample` calls captured in one CUDA graph and
                   replayed, events around each replay: one launch for the whole graph, so even
                   a microsecond kernel is timed back to back; L2 is not flushed between the calls
                   inside a replay (use it where launches, not caches, are the question);
    perf_counter   on CPU: wall clock around each call (there is no launch to hide).

Every result carries `method`, a sentence saying which of these produced it, for the JSON rows.
Medians, with the 10th and 90th percentiles as the spread.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (q in [0, 1])."""
    if not sorted_values:
        raise ValueError("no samples")
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_s: list[float], method: str, calls_per_sample: int = 1) -> dict:
    """Per-call seconds from samples that each covered `calls_per_sample` calls."""
    per_call = sorted(s / calls_per_sample for s in samples_s)
    return {"median_s": statistics.median(per_call), "p10_s": _percentile(per_call, 0.1),
            "p90_s": _percentile(per_call, 0.9), "samples": len(per_call), "method": method}


def l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """A byte buffer twice the device's L2 cache (64 MiB where the size is not reported)."""
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or 32 * 2**20
    return torch.empty(2 * l2, dtype=torch.uint8, device=device)


def time_kernel(fn: Callable[[], object], device: str | torch.device = "cuda", samples: int = 50,
                warmup: int = 5, flush_l2: bool = True, cuda_graph: bool = False,
                calls_per_sample: int = 20) -> dict:
    """Seconds per call of fn() (median, p10, p90 over `samples`) and the method that timed it."""
    device = torch.device(device)
    if samples < 1 or warmup < 0 or calls_per_sample < 1:
        raise ValueError(f"samples = {samples}, warmup = {warmup}, calls_per_sample = {calls_per_sample}; "
                         "allowed: samples >= 1, warmup >= 0, calls_per_sample >= 1")
    if device.type != "cuda":
        if cuda_graph:
            raise ValueError("cuda_graph=True needs a CUDA device")
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return summarize(times, f"perf_counter around each call on {device.type}, {samples} samples after "
                                f"{warmup} warm-up calls, median")
    if cuda_graph:
        return _time_graph(fn, device, samples, warmup, calls_per_sample)
    return _time_events(fn, device, samples, warmup, flush_l2)


def _time_events(fn, device, samples: int, warmup: int, flush_l2: bool) -> dict:
    for _ in range(warmup):
        fn()
    flush = l2_flush_buffer(device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    torch.cuda.synchronize(device)
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()                              # evicts L2 and hides the next launch behind itself
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    flushed = "L2 flushed (2x its size written) before each" if flush_l2 else "L2 not flushed"
    return summarize(times, f"CUDA events around each call, {samples} samples, {flushed}, after {warmup} "
                            "warm-up calls, median")


def _time_graph(fn, device, samples: int, warmup: int, calls_per_sample: int) -> dict:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):                    # warm up (and let Triton compile) off the graph
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_sample):
            fn()
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    torch.cuda.synchronize(device)
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    return summarize(times, f"CUDA graph of {calls_per_sample} back-to-back calls, CUDA events around each "
                            f"replay, {samples} samples, L2 warm, median", calls_per_sample)


def copy_bandwidth(device: str | torch.device = "cuda", mbytes: int = 1024) -> dict:
    """Bytes/s of a device-to-device copy of `mbytes` MiB (read + write counted), by time_kernel:
    the achievable-bandwidth yardstick kernels' GB/s are compared with."""
    n = mbytes * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = time_kernel(lambda: dst.copy_(src), device=device, samples=20, flush_l2=True)
    return {"bytes_per_s": 2 * n / timing["median_s"], "mbytes": mbytes, **timing}
