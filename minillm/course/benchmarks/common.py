"""Shared helpers for every benchmark: machine description, honest timing, JSON and tables.

A benchmark module in this package defines
    NAME = "kv-cache"                      # what `python -m minillm bench NAME` calls it
    def run(quick: bool) -> dict           # returns the JSON document described below
and is listed in minillm/course/benchmarks/__init__.py.

Every JSON document is {"name", "machine", "config", "results": [...], "summary": {...}}.
A ratio between two systems is measured in the same run, after warm-up, as a median.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from minillm.perf.timing import sync, time_median  # noqa: F401  (benchmarks time with the library's clock)


def quick_mode() -> bool:
    """MINILLM_QUICK=1 shrinks benchmarks and notebooks to CI size."""
    return os.environ.get("MINILLM_QUICK", "0") not in ("", "0", "false", "False")


def machine_info() -> dict:
    info = {
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    else:
        info["gpu"] = None
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def interleaved_generate(llms: dict, prompt, params, reps: int, counts=None) -> tuple[dict, dict]:
    """One request through each LLM in turn, a warm-up round (it compiles the shapes) then `reps` timed rounds:
    interleaving keeps both sides of every ratio under the same load. counts(llm) -> a snapshot of its counters,
    taken before each run (the runs of other LLMs do not move them). -> ({name: seconds per timed round},
    {name: (token ids of the last round, the counts snapshot before it)})."""
    times, last = {name: [] for name in llms}, {}
    for rep in range(reps + 1):
        for name, llm in llms.items():
            before = counts(llm) if counts else None
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            seconds = time.perf_counter() - t0
            if rep:
                times[name].append(seconds)
            last[name] = (out.token_ids, before)
    return times, last


def document(name: str, config: dict, results: list, summary: dict) -> dict:
    return {"name": name, "machine": machine_info(), "config": config,
            "results": results, "summary": summary}


def figure_path(json_path: str | None, suffix: str, default_name: str, quick: bool) -> str:
    """Where a benchmark's figure goes: beside its JSON (x.json -> x<suffix>.png) when the CLI names one,
    else results/<default_name> (results/quick/<default_name> in quick mode)."""
    if json_path:
        return json_path.removesuffix(".json") + suffix + ".png"
    return f"results/quick/{default_name}" if quick else f"results/{default_name}"


def write_json(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=float) + "\n")
    return path


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain-text table of dicts (floats shown with 4 significant digits)."""
    if not rows:
        return "(no rows)"
    if columns is None:                       # union of the rows' keys, in first-seen order
        columns = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (dict, list))))

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


class Worker:
    """A worker process spoken to in JSON lines: one request in, one answer out. Side-by-side benchmarks keep
    one per system alive (each loaded once) and ask them in turn, so the machine's drift hits both alike."""

    def __init__(self, command: list[str], env: dict | None = None):
        self.command = command
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker {self.command[1:2]} stopped while answering {cmd.get('op')!r} "
                               f"(exit code {self.proc.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
