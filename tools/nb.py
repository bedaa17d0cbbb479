"""Build a notebook from a list of ("md" | "code", source) cells and execute it in place.

Used to (re)generate the committed notebooks with the outputs of a real run:
    python tools/nb.py tools/notebooks/01_where_time_goes.py   # defines CELLS; writes notebooks/01_where_time_goes.ipynb
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def build(cells, path: Path, execute: bool = True, timeout: int = 1800) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, src in cells:
        src = src.strip("\n")
        nb.cells.append(nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src))
    if execute:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)


if __name__ == "__main__":
    spec_path = Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("nbspec", spec_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = Path(__file__).parent.parent / "notebooks" / (spec_path.stem + ".ipynb")
    build(mod.CELLS, out, execute="--no-exec" not in sys.argv)
    print("wrote", out)
