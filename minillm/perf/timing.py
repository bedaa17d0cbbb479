"""Wall-clock timing for the library's own measurements (roofline's attainable rates, the engine's
tuning step) and for the benchmarks, which import it from here: the library never imports
minillm.course.benchmarks."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device: str | torch.device | None = None) -> None:
    """Wait for queued GPU work (CUDA calls return before the kernel ends); nothing on CPU."""
    if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        torch.cuda.synchronize()


def time_median(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
                device: str | torch.device | None = None) -> float:
    """Median wall-clock seconds of fn() over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
