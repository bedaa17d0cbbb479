"""What every notebook does first: pick its device and say which machine produced its outputs.

The first line a notebook prints is `machine: <name> | device: <cpu|cuda> | torch .. | triton .. | mode: ..`.
README's learning-path table quotes where each committed notebook's outputs came from, and
tests/course/test_notebooks.py reads that back from the notebook itself (`produced_on`), so a notebook
committed from a CPU run never claims a GPU's numbers.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from minillm.course.benchmarks.common import _cpu_name, machine_info, quick_mode, write_json

FIRST_LINE = re.compile(r"^machine: (?P<machine>[^|]+?) \| device: (?P<device>\w+) \| torch \S+ \| "
                        r"triton \S+ \| mode: (?P<mode>quick|full)$")


def machine_name(device: str) -> str:
    """'NVIDIA H200 (139 GiB)' on a GPU; 'Intel(R) Xeon(R) Processor (2 threads)' on a CPU."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return f"{_cpu_name()} ({torch.get_num_threads()} threads)"


def start(device: str | None = None) -> tuple[str, bool]:
    """-> (device, quick). device None: cuda when present, else cpu; pass "cpu" where a notebook's
    subject runs on CPU processes whatever the machine (notebook 11's gloo ranks)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device = {device!r}; allowed: None, 'cpu', 'cuda'")
    quick = quick_mode()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    print(f"machine: {machine_name(device)} | device: {device} | torch {torch.__version__} | "
          f"triton {triton_version} | mode: {'quick' if quick else 'full'}")
    return device, quick


def produced_on(path: str | Path) -> str:
    """The machine and mode of a notebook's committed outputs, read from its first printed line:
    e.g. 'Intel(R) Xeon(R) Processor (2 threads), cpu, full'."""
    nb = json.loads(Path(path).read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            streams = [o for o in cell.get("outputs", []) if o.get("output_type") == "stream"]
            text = "".join(streams[0]["text"]) if streams else ""
            match = FIRST_LINE.match(text.split("\n", 1)[0])
            if match is None:
                raise ValueError(f"{Path(path).name}: its first code cell's output does not start with the "
                                 f"machine line of minillm.course.notebook.start(); it starts {text[:80]!r}")
            return f"{match['machine']}, {match['device']}, {match['mode']}"
    raise ValueError(f"{Path(path).name} has no code cell")


def save_notebook_values(notebook: str, values: dict, quick: bool) -> Path | None:
    """Write the figures a lesson quotes from a notebook's full run to results/notebook-NAME.json.
    Quick runs (CI) write nothing, so the committed file always comes from a full run."""
    if quick:
        return None
    doc = {"name": f"notebook {notebook}", "machine": machine_info(), "values": values}
    return write_json(doc, Path(__file__).resolve().parents[2] / "results" / f"notebook-{notebook}.json")
