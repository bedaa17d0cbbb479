"""A kernel's tile configuration chosen by timing, once per shape: what triton.autotune does, for a
whole launch (a split-K GEMV's second kernel included).

A Triton kernel's speed depends on its tiles (BLOCK_M, BLOCK_N, ...), warps and pipeline stages, and the
best choice depends on the shape and the GPU: too few programs leave SMs idle, too many registers
lower occupancy. So each launcher lists a few configurations, the first a safe default, and asks
choose_config for one: on CUDA every configuration is timed once per key by triton.testing.do_bench
(CUDA events around each call, the L2 cleared before it; median) and the fastest is remembered for the
process. Nothing is timed off CUDA (the interpreter's speed says nothing about a GPU's) or while a CUDA
graph is captured (a capture records kernels without running them): there the first configuration is
used. Keys should bucket sizes that vary per call (sequence lengths) so that a server does not time on
every request. A leaf module like kernel_args.py: kernels/ may import it (tests/test_layout.py).
"""
from __future__ import annotations

from typing import Callable

import torch

_chosen: dict[tuple, dict] = {}      # key -> the configuration timed fastest in this process
_failed: dict[tuple, list] = {}      # key -> [(configuration, error)] that could not run (e.g. out of shared memory)


def choose_config(key: tuple, configs: list[dict], run: Callable[[dict], object]) -> dict:
    """The fastest of `configs` for `key` (its last element: the device, as a string), timed once per
    key by running run(config); configs[0] where nothing is timed."""
    if not configs:
        raise ValueError(f"no configuration to choose from for {key}")
    if key in _chosen:
        return _chosen[key]
    device = str(key[-1])
    if not device.startswith("cuda") or torch.cuda.is_current_stream_capturing():
        return configs[0]
    seconds, error = [], None
    with torch.cuda.device(device):
        for c in configs:
            try:
                seconds.append(median_seconds(lambda: run(c)))
            except Exception as e:                     # noqa: BLE001 - a tile that does not fit is skipped
                seconds.append(float("inf"))
                error = e
                _failed.setdefault(key, []).append((c, f"{type(e).__name__}: {str(e)[:200]}"))
    if min(seconds) == float("inf"):
        raise error
    _chosen[key] = configs[min(range(len(configs)), key=seconds.__getitem__)]
    return _chosen[key]


def median_seconds(fn: Callable[[], object]) -> float:
    """Median seconds per call of fn on the current CUDA device (triton.testing.do_bench, short: a tuning
    measures several configurations of many shapes)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20, return_mode="median") / 1e3


def chosen_configs() -> dict[str, dict]:
    """What choose_config picked so far in this process, for a benchmark's JSON."""
    return {" ".join(map(str, key)): config for key, config in _chosen.items()}


def failed_configs() -> dict[str, list]:
    """The configurations choose_config skipped because they raised (with the error), per key."""
    return {" ".join(map(str, key)): failures for key, failures in _failed.items()}


def length_bucket(n: int) -> int:
    """n rounded up to a power of two: one key for every length in (n/2, n]."""
    return 1 << max(0, (int(n) - 1).bit_length())
