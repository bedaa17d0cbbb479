"""Memory measured, not estimated: the resident-set growth of one call on CPU, and the bytes autograd keeps
from forward to backward.

peak_rss_growth runs the call in a fresh Python process (the way `timeit` takes a setup and a statement):
glibc keeps freed heap pages for reuse, so in a process that has already run something large the next
allocation may not raise the resident set at all. The child runs the setup (inputs and a small warm-up, so
lazily allocated thread pools are not counted), writes 5 to /proc/self/clear_refs (VmHWM := current VmRSS),
runs the statement once and reports VmHWM minus the VmRSS before it. Linux only.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import json, time
from pathlib import Path
def rss(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field + " not in /proc/self/status")
{setup}
Path("/proc/self/clear_refs").write_text("5")
before = rss("VmRSS")
_out = {stmt}
peak = rss("VmHWM") - before
del _out
seconds = []
for _ in range({repeats}):
    t0 = time.perf_counter(); {stmt}; seconds.append(time.perf_counter() - t0)
print(json.dumps({{"peak_bytes": peak, "seconds": sorted(seconds)[len(seconds) // 2] if seconds else None}}))
"""


def peak_rss_growth(setup: str, stmt: str, repeats: int = 0, trials: int = 1) -> dict:
    """Median over `trials` fresh processes of {"peak_bytes": resident-set growth during one `stmt`,
    "seconds": median wall time of `repeats` further runs (None when repeats is 0)}. `setup` is Python
    source run first in the child (imports, inputs, warm-up); `stmt` is one expression."""
    if not Path("/proc/self/clear_refs").exists():
        raise RuntimeError("peak_rss_growth needs Linux's /proc/self/clear_refs")
    if trials < 1 or repeats < 0:
        raise ValueError(f"trials must be >= 1 and repeats >= 0, got trials={trials}, repeats={repeats}")
    code = _CHILD.format(setup=setup, stmt=stmt, repeats=repeats)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    runs = []
    for _ in range(trials):
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the measured child failed:\n{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    seconds = [r["seconds"] for r in runs if r["seconds"] is not None]
    return {"peak_bytes": statistics.median(r["peak_bytes"] for r in runs),
            "seconds": statistics.median(seconds) if seconds else None}


def saved_for_backward_bytes(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from fn(*inputs)'s forward for its backward: distinct storages,
    the inputs included when they are saved (they are, for a matmul)."""
    storages = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fn(*inputs)
    return sum(storages.values())
