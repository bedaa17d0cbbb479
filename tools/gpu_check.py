"""One prepared run on a lent CUDA GPU (`make gpu-check`): the GPU-only measurements and the CUDA
kernel tests, each step time-boxed, every result written under $OUT (default results/gpu/) as soon
as it exists, so that a lease running out still leaves the finished parts.

    1. W4A16 (Triton, int4 g128) vs fp16 cuBLAS matmul at batch 1..64, Llama-2-7B's shapes, and the
       card's copy bandwidth the int4 GB/s are compared with
    2. paged decode kernel on scattered 16-token pages vs the same kernel on contiguous memory
    3. FlashAttention (Triton) vs naive vs torch SDPA (flash backend): ms and TFLOP/s, N = 1K..16K
    4. end to end: a random-weight Llama-2-7B shape decoding at batch 1 with fp16 then int4 weights
    5. pytest on the kernel tests (they run on CUDA when it is present), the Triton backward included

Every kernel is timed by minillm/benchmarks/kernel_timing.py (CUDA events, L2 flushed before each
sample; each JSON row names its method). The files it writes are *-kernel.json; the older
*-gpu.json files were timed with perf_counter around single calls (the launch, not the kernel) and
stay only as the example lesson 04 explains.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

OUT = Path(os.environ.get("OUT", "results/gpu"))


def save(name: str, payload) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"[{time.strftime('%H:%M:%S')}] wrote {name}.json", flush=True)


def step(name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        save(name, {"seconds": None, **fn()})
    except Exception:                                  # keep going: the next step may still work
        save(name, {"error": traceback.format_exc()})
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    import torch

    from minillm.benchmarks import common
    print(common.machine_info(), flush=True)
    from minillm.benchmarks.flash_attention import measure_gpu
    from minillm.benchmarks.paged import kernel_paging_cost
    from minillm.benchmarks.quant import end_to_end_decode, kernel_benchmark

    step("w4a16-kernel", lambda: kernel_benchmark(quick=False))
    step("paged-kernel", lambda: {"rows": kernel_paging_cost([(1, 4096), (8, 1024), (32, 2048), (64, 4096)])})
    step("flash-attention-kernel", lambda: {"machine": common.machine_info(), "rows": measure_gpu(quick=False)})
    step("decode-7b-int4", lambda: end_to_end_decode("llama2-7b", "cuda", new_tokens=64))
    budget = int(os.environ.get("GPU_TEST_SECONDS", "180"))
    tests = ["tests/test_flash_attention.py", "tests/test_flash_attention_backward.py", "tests/test_paged_attention.py",
             "tests/test_quant_w4a16.py", "tests/test_kernel_timing.py", "tests/test_published_models.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          capture_output=True, text=True, timeout=budget)
    (OUT / "pytest-cuda.log").write_text(proc.stdout[-20000:] + proc.stderr[-5000:])
    print(proc.stdout[-1500:], flush=True)
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())


if __name__ == "__main__":
    main()
