"""The prepared runs on a lent CUDA GPU: two calls of one lease, each time-boxed, every result written
under $OUT (default results/gpu/) as soon as it exists, so that a lease running out still leaves the
finished parts. Here, first: `make gpu-carry` (tools/gpu_carry.py fills .gpu/, ignored by git).

Call 1, `make gpu-check` (carry .gpu/wheels and .gpu/model.1; run's timeout_s=430): no model file needed
    1. W4A16 (Triton, int4 g128: the split-K GEMV to 8 rows, tensor cores above, each tuned; the first
       run's kernel; both GEMV word layouts) vs fp16 cuBLAS at batch 1..256, Llama-2-7B's shapes, and
       the card's copy bandwidth the int4 GB/s are compared with
    2. FlashAttention (Triton, tiles tuned per shape) vs naive vs torch SDPA (flash backend), bf16: ms and
       TFLOP/s, N = 1K..16K; from 4K also the backward (Triton vs SDPA's flash backward)
    3. end to end: a random-weight Llama-2-7B shape decoding at batch 1 with fp16 then int4 weights, op by
       op (generate_greedy) and through the engine replaying CUDA graphs
    4. the engine on GPU-sized random models (benchmarks/gpu_engine.py): 7B batch-1 decode against the HBM
       bound, eager vs CUDA graphs; continuous batching vs transformers on a 1B; decode tok/s vs batch to 512
    5. pytest on the kernel tests (they run on CUDA when it is present), the Triton backward included
    6. paged decode kernel on scattered 16-token pages vs the same kernel on contiguous memory
    It also installs the wheels into /tmp/site and keeps the model's first half in /tmp/minillm-gpu.
Call 2, `make gpu-notebooks`, right after (carry .gpu/wheels.2 and .gpu/model.2; timeout_s=340; a warm machine keeps /tmp):
    7. the model joined from its halves (sha256 checked by minillm.loading.loader)
    8. pytest on the engine's CUDA tests (Triton paged attention, CUDA graphs)
    9. every notebook executed in full mode, in order, while the time box lasts: $OUT/notebooks.tar
       (one file: a call returns at most 8) and $OUT/notebooks.json (seconds and status of each)
GPU_STEPS (comma-separated, default all) runs only some of call 1's steps (KERNEL_STEPS), for a lease
that redoes what an earlier one left; GPU_NOTEBOOKS (numbers, e.g. "02,07") likewise for call 2.
Each step has its own time box, cut to what is left of the call's deadline (GPU_CALL_SECONDS: 390 s for
call 1, 300 s for call 2), so the two calls and the machine's start fit one 15-minute lease.
Back here: `python tools/gpu_check.py unpack DIR` puts DIR's notebooks into notebooks/ and its JSON
files into results/gpu/.

Every kernel is timed by minillm/perf/kernel_timing.py (CUDA events, L2 flushed before each
sample; each JSON row names its method). The files it writes are *-kernel.json; the older
*-gpu.json files were timed with perf_counter around single calls (the launch, not the kernel) and
stay only as the example lesson 04 explains.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from importlib import import_module
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", ROOT / "results" / "gpu"))
KEEP = Path("/tmp/minillm-gpu")              # survives between the two calls while the machine is warm
NOTEBOOK_ORDER = ["01", "02", "05", "06", "07", "04", "03", "08", "09", "12", "10", "11", "13"]   # GPU-heavy first
KERNEL_TESTS = ["tests/attention/test_flash_attention.py", "tests/attention/test_flash_attention_backward.py",
                "tests/attention/test_paged_attention.py", "tests/quant/test_quant_w4a16.py", "tests/perf/test_kernel_timing.py",
                "tests/model/test_published_models.py"]
ENGINE_TESTS = ["tests/engine/test_engine_cuda.py", "tests/model/test_cuda_graphs.py"]


def save(name: str, payload) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"[{time.strftime('%H:%M:%S')}] wrote {name}.json", flush=True)


class StepTimeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise StepTimeout


class Deadline:
    """The whole call's seconds: each step's time box is cut to what is left, so that the call ends on time
    however long the steps before it took (a 15-minute lease holds the machine's start and both calls)."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def box(self, limit_s: float) -> int:
        return int(max(0.0, min(limit_s, self.end - time.perf_counter())))


deadline = Deadline(float("inf"))                       # set by kernels() / notebooks()
MIN_STEP_S = 10                                         # a step with less left is recorded as not run


def step(name: str, fn, limit_s: int) -> None:
    """Run one measurement inside its own time box (SIGALRM), so that one slow step cannot eat the lease."""
    t0 = time.perf_counter()
    limit_s = deadline.box(limit_s)
    if limit_s < MIN_STEP_S:
        save(name, {"error": "not run: the call's deadline was reached"})
        return
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.alarm(limit_s)
    try:
        save(name, {"seconds": None, **fn()})
    except StepTimeout:
        save(name, {"error": f"time box of {limit_s} s spent"})
    except Exception:                                  # keep going: the next step may still work
        save(name, {"error": traceback.format_exc()})
    finally:
        signal.alarm(0)
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)


def run_pytest(tests: list[str], log_name: str, budget_s: int) -> None:
    budget_s = deadline.box(budget_s)
    if budget_s < MIN_STEP_S:
        text = "not run: the call's deadline was reached\n"
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / log_name).write_text(text)
        print(text, flush=True)
        return
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                              capture_output=True, text=True, timeout=budget_s, cwd=ROOT)
        text = proc.stdout[-20000:] + proc.stderr[-5000:]
    except subprocess.TimeoutExpired as e:
        text = f"TIMED OUT after {budget_s} s\n" + (e.stdout or b"").decode()[-20000:]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / log_name).write_text(text)
    print(text[-1500:], flush=True)


def keep_model_half(carried: Path = ROOT / ".gpu" / "model.1") -> None:
    if carried.is_file():
        KEEP.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(carried, KEEP / "model.1")


def join_model(second: Path = ROOT / ".gpu" / "model.2", keep: Path = KEEP) -> Path:
    """The GGUF from its two halves, in MINILLM_CACHE; the loader checks its sha256."""
    from minillm.loading.loader import SMOLLM2, cache_dir
    first = keep / "model.1"
    if not first.is_file() or not second.is_file():
        raise FileNotFoundError(f"need {first} (left by call 1, `make gpu-check`, on this warm machine) and "
                                f"{second} (carried by this call); run `make gpu-carry` here first")
    target = cache_dir() / SMOLLM2["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as out:
        for part in (first, second):
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out)
    return target


def execute_notebooks(paths: list[Path], out_dir: Path, budget_s: float, cell_timeout_s: int = 300) -> list[dict]:
    """Execute each notebook in full mode (its folder as working directory), in order, while the budget
    lasts; after each one, rewrite out_dir/notebooks.tar (executed copies) and notebooks.json."""
    import nbformat
    from nbclient import NotebookClient

    env_quick = os.environ.pop("MINILLM_QUICK", None)     # full mode: the kernel inherits this environment
    done, staging, t_start = [], out_dir / "executed", time.perf_counter()
    staging.mkdir(parents=True, exist_ok=True)
    try:
        for path in paths:
            left = budget_s - (time.perf_counter() - t_start)
            if left < 30:
                done.append({"notebook": path.name, "status": "not run: time box spent"})
                continue
            nb = nbformat.read(path, as_version=4)
            t0 = time.perf_counter()
            try:
                NotebookClient(nb, timeout=int(min(cell_timeout_s, left)), kernel_name="python3",
                               resources={"metadata": {"path": str(path.parent)}}).execute()
                status = "ok"
            except Exception as e:                         # keep the outputs so far; say what stopped it
                status = f"error: {type(e).__name__}: {str(e)[-300:]}"
            nbformat.write(nb, staging / path.name)
            done.append({"notebook": path.name, "status": status, "seconds": round(time.perf_counter() - t0, 1)})
            with tarfile.open(out_dir / "notebooks.tar", "w") as tar:
                for executed in sorted(staging.glob("*.ipynb")):
                    tar.add(executed, arcname=executed.name)
            (out_dir / "notebooks.json").write_text(json.dumps(done, indent=2) + "\n")
            print(f"[{time.strftime('%H:%M:%S')}] {path.name}: {status} ({done[-1]['seconds']} s)", flush=True)
    finally:
        if env_quick is not None:
            os.environ["MINILLM_QUICK"] = env_quick
    (out_dir / "notebooks.json").write_text(json.dumps(done, indent=2) + "\n")
    shutil.rmtree(staging)
    return done


def kernel_pythonpath(value: str | None, root: Path = ROOT) -> str:
    """PYTHONPATH for the notebooks' kernels, which start in notebooks/: every entry made absolute (a "."
    meant the repository to make but notebooks/ to the kernel: the lease of 2026-12-04 lost nine notebooks
    to `No module named 'minillm'`), and the repository added if missing."""
    entries = [str((root / e).resolve()) if not Path(e).is_absolute() else e for e in (value or "").split(os.pathsep) if e]
    return os.pathsep.join(entries + ([str(root)] if str(root) not in entries else []))


def ordered_notebooks(folder: Path = ROOT / "notebooks", only: str | None = None) -> list[Path]:
    """The notebooks in NOTEBOOK_ORDER; `only` (GPU_NOTEBOOKS, e.g. "02,07") keeps just those numbers."""
    by_number = {p.name[:2]: p for p in folder.glob("*.ipynb")}
    ordered = [by_number[n] for n in NOTEBOOK_ORDER if n in by_number] + \
        sorted(p for n, p in by_number.items() if n not in NOTEBOOK_ORDER)
    if not only:
        return ordered
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_number]
    if unknown or not wanted:
        raise ValueError(f"GPU_NOTEBOOKS = {only!r}: no notebook numbered {unknown}; allowed: {', '.join(sorted(by_number))}")
    return [p for p in ordered if p.name[:2] in wanted]


def unpack(folder: Path) -> None:
    """Here, after the lease: executed notebooks into notebooks/, JSON and logs into results/gpu/."""
    folder = Path(folder)
    tar_path = folder / "notebooks.tar"
    if tar_path.is_file():
        with tarfile.open(tar_path) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".ipynb") and "/" not in member.name:
                    (ROOT / "notebooks" / member.name).write_bytes(tar.extractfile(member).read())
                    print("notebooks/" + member.name)
    for f in sorted(folder.iterdir()):
        if f.suffix in (".json", ".log"):
            shutil.copyfile(f, ROOT / "results" / "gpu" / f.name)
            print("results/gpu/" + f.name)


def flash_attention_step() -> dict:
    from minillm.course.benchmarks import common
    from minillm.course.benchmarks.flash_attention import gpu_summary, measure_gpu
    from minillm.kernel_support.tuning import chosen_configs, failed_configs

    rows = measure_gpu(quick=False)
    return {"machine": common.machine_info(), "summary": gpu_summary(rows), "chosen_configs": chosen_configs(),
            "failed_configs": failed_configs(), "rows": rows}


KERNEL_STEPS = ("w4a16-kernel", "flash-attention-kernel", "decode-7b-int4", "gpu-engine", "pytest-cuda",
                "paged-kernel")


def selected_steps(value: str | None) -> tuple[str, ...]:
    """GPU_STEPS, e.g. "pytest-cuda,paged-kernel": the kernels stage's steps to run (default: all), so that a
    later lease can redo only what an earlier one left; a step not run writes nothing."""
    if not value:
        return KERNEL_STEPS
    chosen = tuple(s.strip() for s in value.split(",") if s.strip())
    unknown = [s for s in chosen if s not in KERNEL_STEPS]
    if unknown or not chosen:
        raise ValueError(f"GPU_STEPS = {value!r}: unknown {unknown}; allowed: {', '.join(KERNEL_STEPS)}")
    return chosen


def kernels() -> None:
    global deadline
    chosen = selected_steps(os.environ.get("GPU_STEPS"))
    deadline = Deadline(float(os.environ.get("GPU_CALL_SECONDS", "390")))
    import torch

    from minillm.course.benchmarks import common
    print(common.machine_info(), "steps:", ", ".join(chosen), flush=True)
    keep_model_half()
    # each step imports what it needs inside its own time box: one failing import costs one step, not the call
    timed = {   # name -> (what it measures, time box in s); pytest-cuda is run_pytest's
        "w4a16-kernel": (lambda: import_module("minillm.course.benchmarks.quant").kernel_benchmark(quick=False), 100),
        "flash-attention-kernel": (flash_attention_step, 90),
        "decode-7b-int4": (lambda: import_module("minillm.course.benchmarks.quant").end_to_end_decode(
            "llama2-7b", "cuda", new_tokens=64), 60),
        "gpu-engine": (lambda: import_module("minillm.course.benchmarks.gpu_engine").run("cuda", quick=False), 120),
        "paged-kernel": (lambda: {"rows": import_module("minillm.course.benchmarks.paged").kernel_paging_cost(
            [(1, 4096), (8, 1024), (32, 2048), (64, 4096)])}, 30),
    }
    for name in KERNEL_STEPS:                          # always in this order (the most wanted first)
        if name == "pytest-cuda" and name in chosen:
            run_pytest(KERNEL_TESTS, "pytest-cuda.log", int(os.environ.get("GPU_TEST_SECONDS", "130")))
        elif name in chosen:
            step(name, *timed[name])
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())


def notebooks() -> None:
    global deadline
    chosen = ordered_notebooks(only=os.environ.get("GPU_NOTEBOOKS"))          # a bad list fails before any work
    deadline = Deadline(float(os.environ.get("GPU_CALL_SECONDS", "300")))
    os.environ.setdefault("MINILLM_CACHE", str(KEEP / "cache"))
    os.environ["PYTHONPATH"] = kernel_pythonpath(os.environ.get("PYTHONPATH"))
    from minillm.loading.loader import fetch_smollm2
    join_model()
    print("model:", fetch_smollm2(), flush=True)           # raises if the joined file fails its sha256
    run_pytest(ENGINE_TESTS, "pytest-engine-cuda.log", int(os.environ.get("GPU_ENGINE_TEST_SECONDS", "90")))
    execute_notebooks(chosen, OUT, budget_s=deadline.box(float(os.environ.get("GPU_NOTEBOOK_SECONDS", "330"))))


if __name__ == "__main__":
    stage = sys.argv[1] if len(sys.argv) > 1 else "kernels"
    if stage == "unpack" and len(sys.argv) == 3:
        unpack(Path(sys.argv[2]))
    elif stage in ("kernels", "notebooks") and len(sys.argv) == 2:
        {"kernels": kernels, "notebooks": notebooks}[stage]()
    else:
        sys.exit("usage: python tools/gpu_check.py [kernels | notebooks | unpack DIR]")
